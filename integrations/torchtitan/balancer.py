"""Per-step planning for a torchtitan model whose MoE layers are :class:`RelibraMoE`.

A thin adapter over relibra's planner hook (``relibra_torch.hook.ReplayBalancer``): it finds
the routed-expert engines of the model, builds the planner named in the layers' config
(``planner``, ``reorder``, ``planner_options``), takes replayed routing in torchtitan's
micro-batch layout and turns the hook's report into flat metrics for torchtitan's
``MetricsProcessor``.

Legend: M micro-batches, N MoE layers, B batch rows, S sequence length, K top-k.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from relibra_torch.hook import ReplayBalancer, StepReport
from relibra_torch.planning import ReLibraConfig, StepPlan

from .moe import RelibraMoE, relibra_moe_layers

__all__ = ["TitanBalancer", "planner_kwargs_for"]


def planner_kwargs_for(layer: RelibraMoE) -> dict:
    """``make_planner`` keyword arguments from a layer's ``planner``/``reorder``/``planner_options``."""
    options = dict(layer.planner_options or {})
    if layer.planner == "relibra":
        cfg = options.pop("config", None)
        if cfg is None:
            cfg = ReLibraConfig(reorder=layer.reorder, **options)
            options = {}
        elif not isinstance(cfg, ReLibraConfig):
            raise TypeError(f"planner_options['config'] must be a ReLibraConfig, got {type(cfg).__name__}")
        return {"config": cfg, **options}
    if not layer.reorder and layer.planner != "static":
        raise ValueError(f"reorder=False is only meaningful for the relibra planner; planner "
                         f"{layer.planner!r} chooses its own placement (use 'static' to keep it fixed)")
    return options


class TitanBalancer:
    """Plan each step from replayed routing and install each micro-batch's plan.

    Args:
        model: a torchtitan model (or model part) with :class:`RelibraMoE` layers, already
            parallelized (the EP mesh is read from the layers).
        planner_kwargs: override the keyword arguments derived from the layers' config.

    Every EP rank must call :meth:`plan_step` (a collective) with its own micro-batches'
    routing, then :meth:`install` before each micro-batch's forward.
    """

    def __init__(self, model: nn.Module, planner_kwargs: dict | None = None):
        self.moe_layers = relibra_moe_layers(model)
        if not self.moe_layers:
            raise ValueError("the model has no RelibraMoE layer; activate the override "
                             "integrations.torchtitan.override.relibra_moe")
        first = self.moe_layers[0]
        for i, layer in enumerate(self.moe_layers):
            if (layer.planner, layer.reorder, layer.planner_options) != (
                    first.planner, first.reorder, first.planner_options):
                raise ValueError(f"MoE layer {i} has planner options ({layer.planner!r}, reorder="
                                 f"{layer.reorder}, {layer.planner_options}) unlike layer 0's "
                                 f"({first.planner!r}, reorder={first.reorder}, {first.planner_options}); "
                                 "one planner plans all layers")
        kwargs = planner_kwargs_for(first) if planner_kwargs is None else planner_kwargs
        self.hook = ReplayBalancer([layer.routed_experts for layer in self.moe_layers],
                                   planner=first.planner, planner_kwargs=kwargs)
        self.num_micro_batches = 0

    @property
    def num_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def report(self) -> StepReport:
        return self.hook.report

    def plan_step(self, routing: Sequence[torch.Tensor], optimizer=None) -> StepPlan:
        """Plan the step from this rank's replayed ids, one ``[B, S, N, K]`` (or ``[T, N, K]``)
        tensor per micro-batch; move experts (and ``optimizer`` state) to the new placement."""
        routing = list(routing)
        for m, ids in enumerate(routing):
            if not isinstance(ids, torch.Tensor) or ids.dim() < 3 or ids.shape[-2] != self.num_layers:
                raise ValueError(f"routing[{m}] must be [B, S, N={self.num_layers}, K] (or [T, N, K]) "
                                 f"expert ids, got {getattr(ids, 'shape', type(ids).__name__)}")
        plan = self.hook.plan_step([ids.reshape(-1, *ids.shape[-2:]) for ids in routing], optimizer)
        self.num_micro_batches = len(routing)
        return plan

    def install(self, micro_batch: int) -> None:
        """Install micro-batch ``micro_batch``'s plan in every layer."""
        if not 0 <= micro_batch < self.num_micro_batches:
            raise ValueError(f"micro_batch={micro_batch} is outside the planned step's "
                             f"[0, {self.num_micro_batches})")
        self.hook.install(micro_batch)

    def clear(self) -> None:
        """Run the layers on their placement without replicas (e.g. for evaluation)."""
        self.hook.clear()
        self.num_micro_batches = 0

    def metrics(self, prefix: str = "relibra") -> dict[str, float]:
        """The last step's numbers, flat, for torchtitan's ``MetricsProcessor`` extra metrics.

        ``<prefix>/planner_ms``, ``<prefix>/migrated_experts``, ``<prefix>/fell_back``,
        ``<prefix>/degraded_micro_batches`` (micro-batches whose routing did not match the
        plan and ran on the current placement without replicas) and, per
        MoE layer ``n``, ``<prefix>/imbalance_before/layer_n`` (max/mean expert tokens over EP
        ranks on the previous placement without replicas, worst micro-batch) and
        ``<prefix>/imbalance_after/layer_n`` (the same under the plan), plus their means over
        layers.
        """
        r = self.hook.report
        out = {f"{prefix}/planner_ms": 1000.0 * r.planner_s,
               f"{prefix}/migrated_experts": float(r.migrated_experts),
               f"{prefix}/fell_back": float(r.fell_back),
               f"{prefix}/degraded_micro_batches": float(len(r.degraded_micro_batches))}
        for name, t in (("imbalance_before", r.static_imbalance_ML), ("imbalance_after", r.predicted_imbalance_ML)):
            if t.numel() == 0:
                continue
            worst_N = t.max(0).values
            for n, v in enumerate(worst_N.tolist()):
                out[f"{prefix}/{name}/layer_{n}"] = v
            out[f"{prefix}/{name}/mean"] = float(worst_N.mean())
        return out
