"""Cross-node replicas that keep tokens inside their node: the traffic side of relibra.

The all-to-all, not expert compute, is most of an MoE layer's time: a token-expert pair
that crosses nodes costs several times its expert compute (Qwen3-30B-A3B on H200: about
3.6e-7 s of inter-node transfer against 4.8e-8 s of compute). Routing replay tells the
planner, per micro-batch, how many of each node's tokens want each expert. A replica of
expert ``e`` on a GPU of node ``n`` that takes exactly node ``n``'s tokens for ``e`` removes
them from the inter-node exchange (``planning.token_split`` keeps tokens local first), and
the owner no longer receives them: it relieves the node that holds a hot expert too.

Per layer and node, two ways of filling the node's ``g * r`` traffic slots are compared by
the seconds they save net of their fills, and the better one is kept: a set fixed for the
step (the remote experts with the most step demand, each filled once, EPLB's economics but
with the node's exact demand), or a set chosen per micro-batch (below), which follows hot
experts that change from one micro-batch to the next. Per micro-batch, layer and node, the
traffic slots hold the non-owned experts with the most local demand whose saving pays for
their fill. A replica that stays
from the previous micro-batch is already filled (the cost model charges fills per
residency), so it only has to be worth its slot; a new one must save more than an
inter-node fill (weights in, gradients back). Kept replicas stay in their slot; new ones go
to the node's least-loaded GPUs with a free slot. Everything is integer arithmetic on
counts plus one float64 comparison per candidate, so plans are identical on every machine.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, g GPUs per node,
G GPUs, El native experts per GPU, r traffic slots per GPU, B = g * r traffic slots per node.
"""

from __future__ import annotations

import torch

from .fill_spread import spread_step_fills
from .residency import residency_masks
from .topology import Topology

__all__ = ["step_replicas", "step_slots", "traffic_replicas"]


def traffic_replicas(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                     slots_per_gpu: int, token_s: float, fill_s: float, also_step: bool = False,
                     spread: tuple[int, float, float] | None = None):
    """Cross-node replicas per micro-batch under a fixed placement.

    Args:
        loads_MLSE: int ``[M, L, S, E]`` token counts.
        placement_LE: int64 ``[L, E]`` physical native slot of every expert.
        slots_per_gpu: ``r`` replica slots per GPU these replicas may use.
        token_s: seconds one token-expert pair kept off the inter-node link saves, per GPU
            of the sending node (``cross_node_s_per_token / g``).
        fill_s: seconds of one inter-node replica residency (0: fills are free).
        spread: ``(top_k, row_s, pair_s)`` under hierarchical dispatch: per layer, keep the
            cheapest of this choice and step-long sets capped at a few copies per owner
            GPU (:func:`~relibra_torch.planning.fill_spread.spread_step_fills`; ``row_s``:
            one ``(token, remote node)`` row at the busiest GPU, ``pair_s``: one pair's
            expert compute). ``None``: no cap.

    Returns:
        ``(expert_MLGr, quota_MLGr)`` int64 ``[M, L, G, r]``: the expert in each traffic
        slot (``-1`` empty) and its quota, exactly the slot node's tokens for that expert.
    """
    M, L, S, E = loads_MLSE.shape
    N, g, El = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu
    G, r = topology.num_gpus, slots_per_gpu
    expert_MLGr = torch.full((M, L, G, r), -1, dtype=torch.int64)
    quota_MLGr = torch.zeros(M, L, G, r, dtype=torch.int64)
    if r == 0 or N == 1 or M == 0:
        empty = expert_MLGr.contiguous(), quota_MLGr.contiguous()
        return (empty, empty) if also_step else empty
    B = g * r
    loads_MLSE = loads_MLSE.to(torch.int64)
    demand_MLNE = loads_MLSE.view(M, L, N, g, E).sum(3)
    owner_node_LE = placement_LE // El // g
    remote_MLNE = demand_MLNE.masked_fill(owner_node_LE.view(1, L, 1, E) == torch.arange(N).view(1, 1, N, 1), 0)
    # Native load of every GPU per micro-batch (where new replicas should go).
    native_MLG = torch.zeros(M, L, G, dtype=torch.int64).scatter_add_(
        2, (placement_LE // El).unsqueeze(0).expand(M, L, E), loads_MLSE.sum(2))

    held_LNE = torch.zeros(L, N, E, dtype=torch.bool)        # replicas resident after m - 1
    slot_LNB = [[[-1] * B for _ in range(N)] for _ in range(L)]
    for m in range(M):
        value_LNE = remote_MLNE[m].to(torch.float64) * token_s - torch.where(held_LNE, 0.0, fill_s)
        value_LNE = value_LNE.masked_fill(remote_MLNE[m] <= 0, -1.0)
        # The B best candidates per (layer, node); stable sort: ties go to the lower id.
        order_LNE = (-value_LNE).argsort(dim=2, stable=True)[..., :B]
        chosen_LNB = order_LNE.masked_fill(value_LNE.gather(2, order_LNE) <= 0, -1)
        chosen, native = chosen_LNB.tolist(), native_MLG[m].tolist()
        for l in range(L):
            for n in range(N):
                want = [e for e in chosen[l][n] if e >= 0]
                slots = slot_LNB[l][n]
                keep = set(want)
                for b in range(B):                       # drop what is no longer wanted
                    if slots[b] not in keep:
                        slots[b] = -1
                new = [e for e in want if e not in slots]
                if new:
                    gpu_load = native[l][n * g:(n + 1) * g]
                    for b in range(B):                   # kept replicas load their GPU
                        if slots[b] >= 0:
                            gpu_load[b // r] += int(remote_MLNE[m, l, n, slots[b]])
                    for e in new:                        # heaviest first: the order chosen
                        free = [b for b in range(B) if slots[b] < 0]
                        b = min(free, key=lambda q: (gpu_load[q // r], q))
                        slots[b] = e
                        gpu_load[b // r] += int(remote_MLNE[m, l, n, e])
        slot_t = torch.tensor(slot_LNB, dtype=torch.int64)                    # [L, N, B]
        expert_MLGr[m] = slot_t.view(L, G, r)
        quota = remote_MLNE[m].gather(2, slot_t.clamp(min=0)) * (slot_t >= 0)
        quota_MLGr[m] = quota.view(L, G, r)
        held_LNE = torch.zeros(L, N, E, dtype=torch.bool)
        held_LNE.scatter_(2, slot_t.clamp(min=0), slot_t >= 0)

    # The alternative: one set per (layer, node) for the whole step, chosen from the step's
    # demand and filled once (EPLB's economics, with each node's exact demand). Per (layer,
    # node) the option that saves more seconds net of fills wins.
    static_e_MLGr, static_q_MLGr = step_replicas(remote_MLNE, native_MLG.sum(0), topology, r, token_s, fill_s)
    dyn_value_LN = _net_value(expert_MLGr, quota_MLGr, N, g, token_s, fill_s)
    static_value_LN = _net_value(static_e_MLGr, static_q_MLGr, N, g, token_s, fill_s)
    use_static_LG = (static_value_LN > dyn_value_LN).repeat_interleave(g, dim=1)          # [L, G]
    pick = use_static_LG.view(1, L, G, 1)
    expert_MLGr = torch.where(pick, static_e_MLGr, expert_MLGr)
    quota_MLGr = torch.where(pick, static_q_MLGr, quota_MLGr)
    best = expert_MLGr.contiguous(), quota_MLGr.contiguous()
    if spread is not None and fill_s > 0:
        top_k, row_s, pair_s = spread
        best = spread_step_fills(best, remote_MLNE.sum(0), placement_LE // El, loads_MLSE, g, B, top_k,
                                 (token_s, row_s, pair_s, fill_s),
                                 lambda chosen_LNB: step_slots(chosen_LNB, remote_MLNE, native_MLG.sum(0), topology, r))
    return (best, (static_e_MLGr, static_q_MLGr)) if also_step else best


def _net_value(expert_MLGr: torch.Tensor, quota_MLGr: torch.Tensor, N: int, g: int, token_s: float,
               fill_s: float) -> torch.Tensor:
    """float64 ``[L, N]``: seconds of inter-node traffic the replicas save over the step,
    less one fill per residency (``planning.residency``: filled at its first micro-batch
    with tokens)."""
    M, L, G, r = expert_MLGr.shape
    saved = quota_MLGr.to(torch.float64).sum((0, 3)) * token_s                          # [L, G]
    fill_start = residency_masks(expert_MLGr, expert_MLGr >= 0, quota_MLGr)[0]
    new = fill_start.sum((0, 3)).to(torch.float64)                                       # [L, G]
    return (saved - new * fill_s).view(L, N, g).sum(-1)


def step_replicas(remote_MLNE: torch.Tensor, native_LG: torch.Tensor, topology: Topology, r: int,
                   token_s: float, fill_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Traffic replicas fixed for the step: per (layer, node) the ``g * r`` remote experts with
    the most step demand whose saving beats one fill, heaviest first to the node's GPU with
    the least step load; quotas per micro-batch are the node's demand then."""
    M, L, N, E = remote_MLNE.shape
    B = topology.gpus_per_node * r
    step_LNE = remote_MLNE.sum(0)
    value_LNE = step_LNE.to(torch.float64) * token_s - fill_s
    order_LNE = (-value_LNE).argsort(dim=2, stable=True)[..., :B]
    chosen_LNB = order_LNE.masked_fill(value_LNE.gather(2, order_LNE) <= 0, -1)
    return step_slots(chosen_LNB, remote_MLNE, native_LG, topology, r)


def step_slots(chosen_LNB: torch.Tensor, remote_MLNE: torch.Tensor, native_LG: torch.Tensor, topology: Topology,
               r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert_MLGr, quota_MLGr)`` of a step-long set ``chosen_LNB`` (``[L, N, B]``, ``-1``:
    none): each node's experts in that order to its GPU with the least step load so far,
    quotas per micro-batch the node's demand."""
    M, L, N, E = remote_MLNE.shape
    g, G = topology.gpus_per_node, topology.num_gpus
    B = g * r
    step_LNE = remote_MLNE.sum(0)
    chosen = chosen_LNB.tolist()
    step, native = step_LNE.tolist(), native_LG.tolist()
    slot_LNB = [[[-1] * B for _ in range(N)] for _ in range(L)]
    for l in range(L):
        for n in range(N):
            gpu_load = native[l][n * g:(n + 1) * g]
            for e in chosen[l][n]:
                if e < 0:
                    continue
                free = [b for b in range(B) if slot_LNB[l][n][b] < 0]
                b = min(free, key=lambda q: (gpu_load[q // r], q))
                slot_LNB[l][n][b] = e
                gpu_load[b // r] += step[l][n][e]
    slot_t = torch.tensor(slot_LNB, dtype=torch.int64)                                # [L, N, B]
    expert_MLGr = slot_t.view(1, L, G, r).expand(M, L, G, r)
    quota = remote_MLNE.gather(3, slot_t.clamp(min=0).unsqueeze(0).expand(M, L, N, B)) * (slot_t >= 0)
    return expert_MLGr.contiguous(), quota.view(M, L, G, r)
