"""The Replicate-and-Quantize inference transform of a model's ``ReplayBalancedMoE`` layers.

:func:`replicate_and_quantize` decides, per layer (:mod:`.plan`), which experts get resident
replicas and which are stored as weight-only int8, then rebuilds every layer's expert
storage as a :class:`ResidentExperts` on each GPU and hooks it into the layer's engine:

* ``engine.resident``: the engine computes with this storage (int8 experts dequantized to
  the compute dtype right before the grouped GEMM, per forward) and replica slots use their
  resident copies, so no weights move at inference;
* ``engine.runtime_planner`` (with more than one GPU): every forward gathers the live
  counts and runs :func:`~.plan.live_layer_plan`, the even split by token order.

The layer's own expert parameters are emptied, so the memory really shrinks; the
transformed layer is for inference (no training, plans, reordering or expert checkpoints
afterwards). Every instance of an expert has the same representation, so a token's result
does not depend on which instance computes it, nor on the batch around it: a transformed
layer gives the same result on one process and on any EP layout.

Legend: E experts, G GPUs, El native experts per GPU, R replica slots, J = El + R, F
expert hidden dim, D dim, O/I output/input channels.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..moe import EXPERT_PARAMS, ReplayBalancedMoE
from ..planning.topology import Topology
from .calibrate import CalibrationStats, calibrate
from .plan import LayerDecision, decide_layer, live_layer_plan
from .quant import dequantize_int8, int8_bytes, quantize_int8

__all__ = ["ResidentExperts", "TransformReport", "expert_sizes", "replicate_and_quantize"]


def expert_sizes(layer: ReplayBalancedMoE, dtype: torch.dtype | None = None) -> tuple[int, int]:
    """``(full, int8)`` bytes of one expert instance of ``layer`` (w1 + w2 + w3)."""
    F, D = layer.hidden_dim, layer.dim
    dtype = dtype or next(iter(layer.expert_params().values())).dtype
    full = 3 * F * D * torch.empty(0, dtype=dtype).element_size()
    return full, 2 * int8_bytes((F, D)) + int8_bytes((D, F))


class ResidentExperts(nn.Module):
    """One GPU's expert storage after the transform: native rows and replica slots, each
    either full precision or int8 + per-output-channel fp32 scales (all buffers).

    Args:
        weights: full logical ``{name: [E, O, I]}`` expert weights.
        native_E: int64 ``[El]`` logical expert at each local row (physical order).
        replica_E: logical expert of every replica slot of this GPU (``-1``: empty).
        quantized_E: bool ``[E]``.
        dtype: the compute dtype the weights are handed out in.
    """

    def __init__(self, weights: dict[str, torch.Tensor], native_E: torch.Tensor, replica_E: list[int],
                 quantized_E: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype
        self.native_E = [int(e) for e in native_E]
        self.replica_E = [int(e) for e in replica_E]
        self.quantized = {int(e) for e in quantized_E.nonzero().flatten()}
        for part, experts in (("native", self.native_E), ("replica", self.replica_E)):
            full = [e for e in experts if e >= 0 and e not in self.quantized]
            quant = [e for e in experts if e >= 0 and e in self.quantized]
            for name in EXPERT_PARAMS:
                w = weights[name].detach()
                q, s = quantize_int8(w[quant]) if quant else (w.new_zeros(0, *w.shape[1:], dtype=torch.int8),
                                                               w.new_zeros(0, w.shape[1]))
                self.register_buffer(f"{part}_{name}_full", w[full].to(dtype).clone())
                self.register_buffer(f"{part}_{name}_q", q)
                self.register_buffer(f"{part}_{name}_scale", s.to(torch.float32))
            # row of every instance in its full or int8 stack
            setattr(self, f"_{part}_index", [(e in self.quantized, (quant if e in self.quantized else full).index(e))
                                             if e >= 0 else None for e in experts])

    def nbytes(self) -> int:
        """Bytes of the stored expert weights and scales on this GPU."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _rows(self, part: str, positions: list[int]) -> tuple[torch.Tensor, ...]:
        index = getattr(self, f"_{part}_index")
        out = []
        for name in EXPERT_PARAMS:
            full = getattr(self, f"{part}_{name}_full")
            q, s = getattr(self, f"{part}_{name}_q"), getattr(self, f"{part}_{name}_scale")
            deq = dequantize_int8(q, s, self.dtype) if len(q) else q.to(self.dtype)
            rows = [(deq if index[p][0] else full)[index[p][1]] for p in positions]
            out.append(torch.stack(rows) if rows else full[:0])
        return tuple(out)

    def native_weights(self) -> tuple[torch.Tensor, ...]:
        """``(w1, w2, w3)`` ``[El, ...]`` in the compute dtype, int8 rows dequantized."""
        return self._rows("native", list(range(len(self.native_E))))

    def replica_weights(self, slots: list[int], experts: list[int]) -> tuple[torch.Tensor, ...]:
        """``(w1, w2, w3)`` ``[len(slots), ...]`` of replica slots ``slots`` (``j >= El``)."""
        El = len(self.native_E)
        pos = [j - El for j in slots]
        held = [self.replica_E[p] if 0 <= p < len(self.replica_E) else None for p in pos]
        if held != list(experts):
            raise RuntimeError(f"the plan puts experts {list(experts)} in slots {list(slots)}, but those slots "
                               f"hold {held}: the runtime plan and the resident replicas disagree")
        return self._rows("replica", pos)


@dataclass
class TransformReport:
    """Attributes: ``topology`` the decisions were made for; ``layers`` ``(name, LayerDecision)``;
    ``calibration`` the measured stats."""

    topology: Topology
    layers: list[tuple[str, LayerDecision]]
    calibration: CalibrationStats

    @property
    def expert_bytes(self) -> int:
        return sum(d.expert_bytes for _, d in self.layers)

    @property
    def original_bytes(self) -> int:
        return sum(d.original_bytes for _, d in self.layers)


@torch.no_grad()
def replicate_and_quantize(model: nn.Module, calibration: CalibrationStats | Callable[[nn.Module], Any], *,
                           topology: Topology | None = None, budget_bytes: int | None = None) -> TransformReport:
    """Transform every ``ReplayBalancedMoE`` layer of ``model`` in place (on every EP rank).

    Args:
        calibration: stats from :func:`~.calibrate.calibrate`, or the ``run(model)`` to
            calibrate with.
        topology: the EP layout (and replica slots ``R``) to decide for; default each
            layer's own. A one-process model may be given the target layout: it then
            stores the same experts quantized (its results are those of that layout; its
            placement, physical slot ``p`` on GPU ``p // El``, stands for the layout's).
        budget_bytes: expert memory per layer over all GPUs; default the original (every
            expert once, full precision).
    """
    stats = calibration if isinstance(calibration, CalibrationStats) else calibrate(model, calibration)
    layers = dict((n, m) for n, m in model.named_modules() if isinstance(m, ReplayBalancedMoE))
    if tuple(layers) != stats.names:
        raise ValueError(f"the calibration is of layers {list(stats.names)}, the model has {list(layers)}")
    decisions = []
    for i, (name, layer) in enumerate(layers.items()):
        own = layer.topology
        topo = topology or own
        if topo.num_experts != layer.num_experts:
            raise ValueError(f"topology has {topo.num_experts} experts but layer {name} has {layer.num_experts}")
        if own.num_gpus > 1 and (topo.num_nodes, topo.gpus_per_node) != (own.num_nodes, own.gpus_per_node):
            raise ValueError(f"topology {topo} is not layer {name}'s EP layout {own}; allowed: the layer's own, "
                             f"or any for a one-process layer")
        if own.num_gpus > 1 and topo.replica_slots > own.replica_slots:
            raise ValueError(f"topology has {topo.replica_slots} replica slots but layer {name} was built with "
                             f"{own.replica_slots} (MoEConfig.replica_slots); allowed: at most that")
        placement = layer.placement_cpu  # physical slot p is GPU p // El of any layout
        full, q = expert_sizes(layer)
        load = stats.load_LE[i] if stats.forward_load_LFE is None else stats.forward_load_LFE[i]
        d = decide_layer(load, stats.importance_LE[i], topo, placement, full, q, budget_bytes)
        decisions.append((name, d))
        weights = layer.logical_expert_weights()  # collective with a mesh
        dtype = weights["w1_EFD"].dtype
        replicas = d.slot_expert_GJ[layer.ep_rank, topo.experts_per_gpu:].tolist() if own.num_gpus > 1 else []
        replicas += [-1] * (own.replica_slots - len(replicas))
        store = ResidentExperts(weights, layer.native_experts(), replicas[: own.replica_slots], d.quantized_E, dtype)
        layer.resident_experts = store.to(layer.placement_E.device)
        for pname in EXPERT_PARAMS:  # free the full-precision experts
            setattr(layer, pname, nn.Parameter(torch.empty(0, dtype=dtype, device=layer.placement_E.device),
                                               requires_grad=False))
        layer.engine.set_plan(None, layer.placement_E.device)
        layer.engine.resident = layer.resident_experts
        if own.num_gpus > 1:
            se = d.slot_expert_GJ
            if own.replica_slots > topo.replica_slots:  # pad to the layer's slot count
                pad = torch.full((own.num_gpus, own.replica_slots - topo.replica_slots), -1, dtype=torch.int64)
                se = torch.cat([se, pad], 1)
            layer.engine.runtime_planner = functools.partial(live_layer_plan, own, layer.placement_cpu, se)
        layer.eval()
    return TransformReport(topology or next(iter(layers.values())).topology, decisions, stats)
