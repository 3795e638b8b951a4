"""Per-expert load and importance of every MoE layer, measured on a calibration set.

Load is how many token-expert pairs an expert gets. Importance is what it contributes to
the layer's output: the sum over its tokens of ``|| gate * expert(x) ||_2`` (the gate-weighted
output norm). R&Q's finding is that the two differ: an expert picked often may contribute
little (small gates or small outputs), so quantization follows importance, not selection
count.

The calibration set is whatever ``run(model)`` pushes through the model: live routing
(prompts, generation) or a routing replay (the model called with ``routed_experts``), in one
process or on every EP rank (then the counts and importances are summed over the ranks).

Legend: L MoE layers, E experts, T tokens, K top-k, D dim, F expert hidden dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..moe import ReplayBalancedMoE, moe_layers

__all__ = ["CalibrationStats", "calibrate", "expert_importance"]


@dataclass(frozen=True)
class CalibrationStats:
    """Attributes: ``names`` of the layers (module order); ``load_LE`` int64 token-expert
    pairs; ``importance_LE`` float64 summed gate-weighted output norms; ``tokens`` seen per
    layer (all ranks); ``forward_load_LFE`` int64 the loads of every calibration forward
    (``F`` forwards; every rank's summed)."""

    names: tuple[str, ...]
    load_LE: torch.Tensor
    importance_LE: torch.Tensor
    tokens: int
    forward_load_LFE: torch.Tensor | None = None


def expert_importance(x_TD: torch.Tensor, ids_TK: torch.Tensor, gates_TK: torch.Tensor,
                      w1_EFD: torch.Tensor, w2_EDF: torch.Tensor, w3_EFD: torch.Tensor) -> torch.Tensor:
    """float64 ``[E]``: ``sum_t || gate_tk * expert_e(x_t) ||_2`` over the pairs routed to ``e``
    (logical-order full weights; pad ids ``-1`` count nowhere)."""
    E = w1_EFD.shape[0]
    out = torch.zeros(E, dtype=torch.float64)
    x = x_TD.float()
    for e in range(E):
        t, k = (ids_TK == e).nonzero(as_tuple=True)
        if t.numel() == 0:
            continue
        xe = x[t]
        h = F.silu(xe @ w1_EFD[e].float().T) * (xe @ w3_EFD[e].float().T)
        y = (h @ w2_EDF[e].float().T) * gates_TK[t, k].float().unsqueeze(1)
        out[e] = y.norm(dim=1).double().sum().cpu()
    return out


@torch.no_grad()
def calibrate(model: nn.Module, run: Callable[[nn.Module], Any]) -> CalibrationStats:
    """Measure every ``ReplayBalancedMoE`` layer of ``model`` while ``run(model)`` runs.

    With a mesh, call it on every EP rank (it gathers each layer's logical expert weights
    once, and sums the statistics over the EP group at the end).
    """
    layers = [(n, m) for n, m in moe_layers(model) if isinstance(m, ReplayBalancedMoE)]
    if not layers:
        raise ValueError("the model has no ReplayBalancedMoE layer to calibrate")
    E = layers[0][1].num_experts
    if any(m.num_experts != E for _, m in layers):
        raise ValueError("calibrate needs the same expert count in every MoE layer")
    weights = [m.logical_expert_weights() for _, m in layers]
    load_LE = torch.zeros(len(layers), E, dtype=torch.int64)
    imp_LE = torch.zeros(len(layers), E, dtype=torch.float64)
    tokens = torch.zeros(len(layers), dtype=torch.int64)
    forwards: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for i, (_, layer) in enumerate(layers):
        def hook(module, args, kwargs, output, i=i):
            x = args[0]
            routed = kwargs.get("routed_experts", args[1] if len(args) > 1 else None)
            x_TD = x.reshape(-1, module.dim)
            ids_TK, gates_TK = module._route(x, x_TD, routed)  # the layer's own routing rule
            flat = ids_TK.reshape(-1)
            forwards[i].append(torch.bincount(flat[flat >= 0], minlength=E).cpu())
            load_LE[i] += forwards[i][-1]
            w = {n: v.to(x_TD.device) for n, v in weights[i].items()}
            imp_LE[i] += expert_importance(x_TD, ids_TK, gates_TK, w["w1_EFD"], w["w2_EDF"], w["w3_EFD"])
            tokens[i] += x_TD.shape[0]
        handles.append(layer.register_forward_hook(hook, with_kwargs=True))
    try:
        run(model)
    finally:
        for h in handles:
            h.remove()
    if len({len(f) for f in forwards}) != 1:
        raise ValueError("every MoE layer must run in every calibration forward (the layers ran "
                         f"{[len(f) for f in forwards]} times)")
    forward_LFE = torch.stack([torch.stack(f) if f else torch.zeros(0, E, dtype=torch.int64) for f in forwards])
    group = layers[0][1].engine.ep.group
    if group is not None:  # every rank runs the same forwards (they are collective)
        device = layers[0][1].placement_E.device
        for t in (load_LE, imp_LE, tokens, forward_LFE):
            buf = t.to(device)
            dist.all_reduce(buf, group=group)
            t.copy_(buf.cpu())
    return CalibrationStats(tuple(n for n, _ in layers), load_LE, imp_LE, int(tokens[0]), forward_LFE)
