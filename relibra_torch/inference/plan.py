"""Replicate-and-Quantize decisions (pure, deterministic) and the live token split.

Per MoE layer, from calibration loads and importances:

1. :func:`choose_replicas` adds resident replicas greedily. A GPU's load is the sum over
   the instances it holds of ``load_e / instances_e`` (the live split divides an expert's
   tokens evenly), per calibration forward when the loads are given per forward. Over
   every used expert and every GPU with a free replica slot that does not hold it yet, it
   adds the replica giving the lowest sum over forwards of the busiest GPU's load, then the
   lowest sum of squared GPU loads (ties: lower expert, then GPU); kept if the first does
   not rise and the second falls. It stops when no replica helps or the slots run out.
2. :func:`fit_budget` keeps the replicas while the layer's expert memory fits the budget:
   it quantizes experts to int8 (every instance of an expert, so a token's result never
   depends on which instance computes it) in increasing order of importance until the
   memory fits; if even quantizing every expert does not, it drops the last replica added
   and tries again. Raises when the budget is below every expert in int8 without replicas.
3. :func:`live_layer_plan` is what runs at inference, where there is no replay: from the
   live counts ``[S, E]`` it divides every expert's tokens evenly over its instances (the
   first ``n_e mod c_e`` instances in slot order take one more), and the project's
   ``token_split`` rule assigns them by source rank and token order, deterministically.

Legend: E experts, G GPUs, El native experts per GPU, R replica slots, J = El + R slots,
S source ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..moe.schedule import LayerPlan
from ..planning.plan import StepPlan, token_split
from ..planning.topology import Topology

__all__ = ["LayerDecision", "choose_replicas", "decide_layer", "even_quota", "fit_budget", "gpu_loads",
           "live_layer_plan"]


@dataclass(frozen=True)
class LayerDecision:
    """What the transform does to one layer.

    Attributes:
        slot_expert_GJ: int64 ``[G, J]``: native experts in ``j < El`` (the placement), the
            resident replicas in ``j >= El``, ``-1`` for an empty slot.
        quantized_E: bool ``[E]``: stored as int8 (every instance of the expert).
        expert_bytes: bytes of the layer's experts after the transform, all GPUs.
        original_bytes: bytes before (every expert once, full precision).
        budget_bytes: the budget it was fitted to.
        replicas_dropped: replicas :func:`choose_replicas` wanted that did not fit.
    """

    slot_expert_GJ: torch.Tensor
    quantized_E: torch.Tensor
    expert_bytes: int
    original_bytes: int
    budget_bytes: int
    replicas_dropped: int

    @property
    def instances_E(self) -> torch.Tensor:
        E = self.quantized_E.numel()
        se = self.slot_expert_GJ.flatten()
        return torch.bincount(se[se >= 0], minlength=E)


def _native_slots(topology: Topology, placement_E: torch.Tensor) -> torch.Tensor:
    G, El, J, E = topology.num_gpus, topology.experts_per_gpu, topology.slots_per_gpu, topology.num_experts
    native_E = torch.empty(E, dtype=torch.int64)
    native_E[placement_E] = torch.arange(E)
    se = torch.full((G, J), -1, dtype=torch.int64)
    se[:, :El] = native_E.view(G, El)
    return se


def even_quota(slot_expert_GJ: torch.Tensor, count_E: torch.Tensor) -> torch.Tensor:
    """int64 ``[G, J]``: every expert's ``count_E`` divided evenly over its instances, the
    first ``count mod instances`` instances (slot order: GPU, then slot) taking one more."""
    se = slot_expert_GJ.flatten()
    E = count_E.numel()
    valid = se >= 0
    e = se.clamp(min=0)
    inst_E = torch.bincount(se[valid], minlength=E)
    # Rank of every instance among its expert's instances, in slot order.
    onehot_XE = torch.nn.functional.one_hot(e, E) * valid.unsqueeze(1)
    rank_X = (onehot_XE.cumsum(0) - 1).gather(1, e.unsqueeze(1)).squeeze(1)
    c = count_E.to(torch.int64)[e]
    n = inst_E[e].clamp(min=1)
    quota = c // n + (rank_X < c % n).to(torch.int64)
    return torch.where(valid, quota, 0).view_as(slot_expert_GJ)


def gpu_loads(slot_expert_GJ: torch.Tensor, count_E: torch.Tensor) -> torch.Tensor:
    """int64 ``[G]`` token-expert pairs every GPU computes under the live split."""
    return even_quota(slot_expert_GJ, count_E).sum(-1)


def _fractional_loads(se_GJ: torch.Tensor, load_FE: torch.Tensor) -> torch.Tensor:
    """float64 ``[F, G]``: every GPU's load per forward when each expert's load is divided
    evenly over its instances."""
    E = load_FE.shape[-1]
    valid = se_GJ >= 0
    inst_E = torch.bincount(se_GJ[valid], minlength=E).clamp(min=1).to(torch.float64)
    share_FGJ = (load_FE.to(torch.float64) / inst_E)[:, se_GJ.clamp(min=0)]
    return torch.where(valid, share_FGJ, 0.0).sum(-1)


def choose_replicas(load_E: torch.Tensor, topology: Topology, placement_E: torch.Tensor) -> list[tuple[int, int]]:
    """``(expert, gpu)`` of every replica to add, in the order added (greedy, see module doc).

    ``load_E``: ``[E]`` calibration loads, or ``[F, E]`` per calibration forward: then the
    objective is the sum over forwards of the busiest GPU's load (a batch waits for its
    busiest GPU), so routing that changes between forwards (prefill vs decoding) counts as
    it runs, not only in aggregate.
    """
    G, El, R = topology.num_gpus, topology.experts_per_gpu, topology.replica_slots
    load_FE = load_E.reshape(-1, load_E.shape[-1])
    se = _native_slots(topology, placement_E)
    free_G = [R] * G
    added: list[tuple[int, int]] = []
    used = [int(e) for e in (load_FE.sum(0) > 0).nonzero().flatten()]

    def cost(se_GJ):
        load_FG = _fractional_loads(se_GJ, load_FE)
        return float(load_FG.max(-1).values.sum()), float((load_FG ** 2).sum())

    while True:
        peak, sq = cost(se)
        best = None
        for e in used:
            for g in range(G):
                if free_G[g] == 0 or bool((se[g] == e).any()):
                    continue
                trial = se.clone()
                trial[g, El + R - free_G[g]] = e
                key = (*cost(trial), e, g)
                if best is None or key < best[0]:
                    best = (key, e, g, trial)
        tol = 1e-12 * max(sq, peak, 1.0)
        if best is None or best[0][0] > peak + tol or best[0][1] >= sq - tol:
            return added
        _, e, g, se = best
        free_G[g] -= 1
        added.append((e, g))


def fit_budget(replicas: list[tuple[int, int]], importance_E: torch.Tensor, full_bytes: int, int8_bytes: int,
               budget_bytes: int) -> tuple[list[tuple[int, int]], torch.Tensor, int]:
    """``(kept replicas, quantized_E, bytes)``: see the module doc (step 2)."""
    E = importance_E.numel()
    order = sorted(range(E), key=lambda e: (float(importance_E[e]), e))
    reps = list(replicas)
    while True:
        inst_E = torch.ones(E, dtype=torch.int64)
        for e, _ in reps:
            inst_E[e] += 1
        quantized = torch.zeros(E, dtype=torch.bool)
        total = int(inst_E.sum()) * full_bytes
        for e in order:
            if total <= budget_bytes:
                break
            quantized[e] = True
            total -= int(inst_E[e]) * (full_bytes - int8_bytes)
        if total <= budget_bytes:
            return reps, quantized, total
        if not reps:
            raise ValueError(f"budget_bytes={budget_bytes} is below the layer's minimum {E * int8_bytes} "
                             f"(every expert int8, no replica); allowed: at least that")
        reps.pop()


def decide_layer(load_E: torch.Tensor, importance_E: torch.Tensor, topology: Topology, placement_E: torch.Tensor,
                 full_bytes: int, int8_bytes: int, budget_bytes: int | None = None) -> LayerDecision:
    """Replicas and quantization of one layer (budget default: the original expert memory).

    ``load_E``: ``[E]`` or per calibration forward ``[F, E]`` (see :func:`choose_replicas`)."""
    E = topology.num_experts
    for name, t in (("load_E", load_E), ("importance_E", importance_E)):
        if t.shape[-1:] != (E,) or t.dim() > (2 if name == "load_E" else 1) or bool((t < 0).any()):
            raise ValueError(f"{name} must be [E={E}] (loads also [forwards, E]) and >= 0, got shape "
                             f"{tuple(t.shape)}")
    original = E * full_bytes
    budget = original if budget_bytes is None else int(budget_bytes)
    wanted = choose_replicas(load_E, topology, placement_E)
    kept, quantized_E, total = fit_budget(wanted, importance_E, full_bytes, int8_bytes, budget)
    se = _native_slots(topology, placement_E)
    El = topology.experts_per_gpu
    for e, g in kept:  # replica slots fill in the order added
        j = El + int((se[g, El:] >= 0).sum())
        se[g, j] = e
    return LayerDecision(se, quantized_E, total, original, budget, len(wanted) - len(kept))


def live_layer_plan(topology: Topology, placement_E: torch.Tensor, slot_expert_GJ: torch.Tensor,
                    counts_SE: torch.Tensor) -> LayerPlan:
    """The :class:`LayerPlan` of one forward from its live counts (every rank's ``[S, E]``)."""
    counts_SE = counts_SE.to(torch.int64)
    quota_GJ = even_quota(slot_expert_GJ, counts_SE.sum(0))
    plan = StepPlan(topology, placement_E.view(1, -1), slot_expert_GJ.view(1, 1, *slot_expert_GJ.shape),
                    quota_GJ.view(1, 1, *quota_GJ.shape), "replicate-quantize")
    split_SGJ = token_split(plan, counts_SE.view(1, 1, *counts_SE.shape))[0, 0]
    # Replica slots without tokens this forward stay listed: they hold resident weights.
    return LayerPlan(slot_expert_GJ.clone(), split_SGJ, placement_E.clone(), topology)
