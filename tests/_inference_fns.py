"""Rank side of the inference-transform tests (spawned gloo ranks import this module).

A case is a plain dict: experts ``E``, top-k ``K``, replica slots ``R``, ``budget`` (fraction
of the original expert memory or None), ``seed``, ``shared``, ``placement`` (a permutation
applied before loading, or None), per-rank calibration and evaluation token counts.

Legend: T tokens, D dim, F hidden, E experts, K top-k, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from relibra_torch.inference import replicate_and_quantize
from relibra_torch.moe import ReplayBalancedMoE

from _moe_cases import DIM, HIDDEN, get_mesh

N, GPN = 2, 2


def logical_state(case: dict) -> dict[str, torch.Tensor]:
    """Weights whose router prefers a few experts (so replicas pay), outputs O(1)."""
    gen = torch.Generator().manual_seed(case["seed"])
    E = case["E"]
    gate = torch.randn(E, DIM, generator=gen) * 0.3
    gate[: max(1, E // 4)] += torch.randn(DIM, generator=gen)  # hot experts share a direction
    sd = {"gate.weight": gate,
          "w1_EFD": torch.randn(E, HIDDEN, DIM, generator=gen) / DIM ** 0.5,
          "w2_EDF": torch.randn(E, DIM, HIDDEN, generator=gen) / HIDDEN ** 0.5,
          "w3_EFD": torch.randn(E, HIDDEN, DIM, generator=gen) / DIM ** 0.5}
    if case["shared"]:
        for n, shape in (("w1", (HIDDEN, DIM)), ("w2", (DIM, HIDDEN)), ("w3", (HIDDEN, DIM))):
            sd[f"shared_experts.{n}.weight"] = torch.randn(*shape, generator=gen) / shape[1] ** 0.5
    return sd


def tokens(case: dict, kind: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``kind`` (``calib`` / ``eval``) tokens ``[T, D]``, drawn around the
    hot direction so the routing is skewed."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + (0 if kind == "calib" else 500) + rank)
    T = case[f"{kind}_tokens"][rank]
    return torch.randn(T, DIM, generator=gen) + 0.5


def build(case: dict, mesh) -> ReplayBalancedMoE:
    m = ReplayBalancedMoE(DIM, HIDDEN, case["E"], case["K"], mesh=mesh, replica_slots=case["R"],
                          num_shared_experts=1 if case["shared"] else 0)
    if case["placement"] is not None:  # one process too: the decisions follow the placement
        m.apply_placement(case["placement"])
    m.load_state_dict(logical_state(case))
    return m


def run_transformed(case: dict, topology, budget_bytes) -> dict:
    """Calibrate on this rank's tokens (summed over ranks), transform, run this rank's eval tokens."""
    r = dist.get_rank()
    m = build(case, get_mesh(N, GPN))
    rep = replicate_and_quantize(m, lambda mod: mod(tokens(case, "calib", r)), topology=topology,
                                 budget_bytes=budget_bytes)
    with torch.no_grad():
        out = m(tokens(case, "eval", r))
    d = rep.layers[0][1]
    return {"out": out.numpy(), "ids": m.last_expert_ids_TK.numpy(), "slot_tokens": m.last_slot_tokens_J.numpy(),
            "fills": m.last_fills, "nbytes": m.resident_experts.nbytes(), "slot_expert": d.slot_expert_GJ.numpy(),
            "quantized": d.quantized_E.numpy(), "expert_bytes": d.expert_bytes,
            "load": rep.calibration.load_LE.numpy(), "forward_load": rep.calibration.forward_load_LFE.numpy(),
            "importance": rep.calibration.importance_LE.numpy()}
