"""The planner hook: read the step's replayed routing, plan, migrate, install per micro-batch.

A training loop calls :meth:`ReplayBalancer.plan_step` once per optimizer step with this
rank's replayed routing for all of its micro-batches, then :meth:`ReplayBalancer.install`
before each micro-batch's forward::

    balancer = ReplayBalancer(model, planner="relibra")
    for step in range(num_steps):
        balancer.plan_step([ids_TLK for each micro-batch], optimizer)   # all EP ranks
        for m, batch in enumerate(micro_batches):
            balancer.install(m)
            loss = model(batch.tokens, routed_experts=batch.ids_TLK)...
            loss.backward()
        optimizer.step()

``plan_step`` counts tokens per (micro-batch, layer, expert), all-gathers the counts over
the EP group (``loads[M, L, S, E]``), runs the same deterministic planner on every rank,
checks with a digest exchange that every rank got the same plan (a clear error, never a
hang: every rank takes part in the same fixed-size collectives), and moves experts and
their optimizer state when the placement changes. If the planner raises on any rank, every
rank runs the step on the previous placement without replicas and warns: slower, never
wrong.

Legend: M micro-batches, L MoE layers, S source ranks (= G EP ranks), E experts,
T tokens of one micro-batch on this rank, K top-k.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .compat import all_gather_single
from .distributed.schedule import layer_plans
from .planning import Planner, ReLibraConfig, StepPlan, make_planner, native_plan, plan_digest
from .planning.evaluate import imbalance

__all__ = ["PlanDivergence", "ReplayBalancer", "StepReport", "count_loads", "relibra_config_for"]


class PlanDivergence(RuntimeError):
    """EP ranks computed different plans (or different count shapes) for the same step."""


@dataclass
class StepReport:
    """What the last :meth:`ReplayBalancer.plan_step` did.

    Attributes:
        planner_s: wall time of the planner on this rank.
        fell_back: the planner failed somewhere; the step runs without replicas.
        migrated_experts: experts whose owner GPU changed, summed over layers.
        predicted_imbalance_ML: float64 ``[M, L]`` max/mean GPU tokens the plan predicts.
        static_imbalance_ML: float64 ``[M, L]`` the same for the previous placement without
            replicas (what the step would have cost without balancing).
    """

    planner_s: float = 0.0
    fell_back: bool = False
    migrated_experts: int = 0
    predicted_imbalance_ML: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    static_imbalance_ML: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))


def count_loads(routed_experts: Sequence[torch.Tensor], num_layers: int, num_experts: int) -> torch.Tensor:
    """Token-expert counts of this rank's micro-batches.

    Args:
        routed_experts: one int tensor ``[T_m, L, K]`` (or ``[..., L, K]``) per micro-batch.
    Returns:
        int64 ``[M, L, E]``.
    """
    out = torch.zeros(len(routed_experts), num_layers, num_experts, dtype=torch.int64)
    for m, ids in enumerate(routed_experts):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int16, torch.int32, torch.int64):
            raise TypeError(f"routed_experts[{m}] must be an integer tensor [T, L, K], got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() < 2 or ids.shape[-2] != num_layers:
            raise ValueError(f"routed_experts[{m}] has shape {tuple(ids.shape)}, expected [T, {num_layers}, K] "
                             f"(one row of top-k ids per MoE layer)")
        flat_LX = ids.reshape(-1, num_layers, ids.shape[-1]).transpose(0, 1).reshape(num_layers, -1).long()
        if flat_LX.numel() and (flat_LX.min() < 0 or flat_LX.max() >= num_experts):
            raise ValueError(f"routed_experts[{m}] has expert ids outside [0, {num_experts - 1}]")
        out[m].scatter_add_(1, flat_LX.to(out.device), torch.ones_like(flat_LX))
    return out


class ReplayBalancer:
    """Plans and installs balanced expert execution for every ``ReplayBalancedMoE`` of a model.

    Args:
        model: a module containing ``ReplayBalancedMoE`` layers (found in ``modules()`` order,
            which is the layer order of the replayed ids' ``L`` dimension), or a list of them.
        planner: a planner name (``static``, ``eplb``, ``eplb-oracle``, ``relibra``) or a
            :class:`~relibra_torch.planning.Planner` built for the layers' topology.
        planner_kwargs: extra arguments for :func:`~relibra_torch.planning.make_planner`.
        hardware: hardware preset (``relibra_torch.sim.presets``) whose bandwidths and
            throughput price the relibra planner's objective when ``planner_kwargs`` has no
            ``config``: migrations and replica fills are then charged for the layers' real
            expert size, so small models move and replicate freely and large ones only when
            it pays.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], planner: str | Planner = "relibra",
                 planner_kwargs: dict | None = None, hardware: str = "h200"):
        from .moe import ReplayBalancedMoE, moe_layers  # the layer imports ops; keep this module light

        if isinstance(model, (list, tuple)):
            self.layers = [m for m in model if isinstance(m, ReplayBalancedMoE)]
        else:
            self.layers = [layer for _, layer in moe_layers(model)]
        if not self.layers:
            raise ValueError("model contains no ReplayBalancedMoE layer; swap its MoE layers first")
        self.topology = self.layers[0].topology
        for i, layer in enumerate(self.layers):
            if layer.topology != self.topology:
                raise ValueError(f"MoE layer {i} has topology {layer.topology}, layer 0 has "
                                 f"{self.topology}; all layers must share one EP layout")
        self.ep = self.layers[0]._ep  # the EP group the layers exchange over
        if isinstance(planner, str):
            kwargs = dict(planner_kwargs or {})
            if planner == "relibra" and "config" not in kwargs:
                kwargs["config"] = relibra_config_for(self.layers[0], hardware)
            planner = make_planner(planner, self.topology, **kwargs)
        elif planner.topology != self.topology:
            raise ValueError(f"planner topology {planner.topology} differs from the layers' {self.topology}")
        self.planner = planner
        self.planner.placement_LE = torch.stack([layer.placement_E.cpu() for layer in self.layers])
        self.plan: StepPlan | None = None
        self.loads_MLSE: torch.Tensor | None = None
        self.report = StepReport()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # -- collectives (every rank calls each of them, in the same order, with fixed sizes) --
    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.ep.group is None:
            return t.unsqueeze(0)
        # gloo wants a flat output: [S * numel], viewed back as [S, *shape]
        out = torch.empty(self.ep.size * t.numel(), dtype=t.dtype)
        all_gather_single(out, t.contiguous().view(-1), group=self.ep.group)
        return out.view(self.ep.size, *t.shape)

    def _gather_loads(self, counts_MLE: torch.Tensor) -> torch.Tensor:
        shapes = self._all_gather(torch.tensor(counts_MLE.shape, dtype=torch.int64))
        if not (shapes == shapes[0]).all():
            raise PlanDivergence(
                "EP ranks passed different numbers of micro-batches, layers or experts "
                f"(per rank [M, L, E]: {shapes.tolist()}); every rank must pass the routing of "
                "the same number of micro-batches")
        counts_SMLE = self._all_gather(counts_MLE)
        return counts_SMLE.permute(1, 2, 0, 3).contiguous()

    def plan_step(self, routed_experts: Sequence[torch.Tensor] | None = None,
                  optimizer: torch.optim.Optimizer | None = None, *,
                  counts_MLE: torch.Tensor | None = None) -> StepPlan:
        """Plan the coming optimizer step and apply its placement.

        Args:
            routed_experts: this rank's replayed expert ids, one ``[T_m, L, K]`` tensor per
                micro-batch (``T_m`` may differ between micro-batches and ranks).
            optimizer: its state for moved experts moves with them (Adam/AdamW
                ``exp_avg``, ``exp_avg_sq``); required when the placement may change and the
                optimizer already holds state.
            counts_MLE: alternatively, this rank's counts ``[M, L, E]`` directly.

        Returns:
            the step plan (the same on every rank).
        """
        E = self.topology.num_experts
        if (routed_experts is None) == (counts_MLE is None):
            raise ValueError("pass exactly one of routed_experts (list of [T, L, K]) or counts_MLE")
        if counts_MLE is None:
            counts_MLE = count_loads(routed_experts, self.num_layers, E)
        elif tuple(counts_MLE.shape[1:]) != (self.num_layers, E):
            raise ValueError(f"counts_MLE has shape {tuple(counts_MLE.shape)}, expected [M, {self.num_layers}, {E}]")
        loads_MLSE = self._gather_loads(counts_MLE.to(torch.int64))
        previous_LE = self.planner.previous_placement(self.num_layers).clone()

        t0 = time.perf_counter()
        failed = 0
        try:
            plan = self.planner.plan(loads_MLSE)
        except Exception as exc:  # noqa: BLE001 - any planner failure degrades, never breaks
            warnings.warn(f"planner {self.planner.name!r} failed ({type(exc).__name__}: {exc}); "
                          "this step runs on the previous placement without replicas", RuntimeWarning)
            failed = 1
        planner_s = time.perf_counter() - t0
        # Every rank learns whether any rank failed, so they all fall back together.
        if int(self._all_gather(torch.tensor([failed])).max()):
            if not failed:
                warnings.warn("the planner failed on another EP rank; this step runs on the previous "
                              "placement without replicas", RuntimeWarning)
            plan = native_plan(loads_MLSE, self.topology, previous_LE, "fallback", previous_LE)

        digest = int(plan_digest(plan), 16) & ((1 << 62) - 1)
        digests = self._all_gather(torch.tensor([digest], dtype=torch.int64)).flatten()
        if not (digests == digests[0]).all():
            raise PlanDivergence(
                f"EP ranks computed different step plans (digest per rank: {[hex(int(d)) for d in digests]}); "
                "the planner must be deterministic and every rank must use the same planner, config "
                "and relibra_torch version")

        moved = 0
        for l, layer in enumerate(self.layers):
            moved += layer.apply_placement(plan.placement_LE[l], optimizer)
        self.planner.commit(plan, loads_MLSE)
        static = native_plan(loads_MLSE, self.topology, previous_LE, "previous")
        self.report = StepReport(planner_s=planner_s, fell_back=plan.planner == "fallback",
                                 migrated_experts=moved,
                                 predicted_imbalance_ML=imbalance(plan.slot_tokens_MLGJ.sum(-1)),
                                 static_imbalance_ML=imbalance(static.slot_tokens_MLGJ.sum(-1)))
        self.plan, self.loads_MLSE = plan, loads_MLSE
        return plan

    def install(self, micro_batch: int) -> None:
        """Install micro-batch ``micro_batch``'s plan in every layer (call before its forward)."""
        if self.plan is None or self.loads_MLSE is None:
            raise RuntimeError("install() before plan_step(): plan the step first")
        for layer, layer_plan in zip(self.layers, layer_plans(self.plan, self.loads_MLSE, micro_batch)):
            layer.set_plan(layer_plan)

    def clear(self) -> None:
        """Remove installed plans (layers then run on their placement without replicas)."""
        for layer in self.layers:
            layer.set_plan(None)


def relibra_config_for(layer, hardware: str = "h200") -> ReLibraConfig:
    """:class:`ReLibraConfig` priced for ``layer``'s expert shape on a hardware preset."""
    from .sim.cost import expert_cost_model
    cost = expert_cost_model(layer.dim, layer.hidden_dim, layer.num_experts, layer.top_k, hardware)
    return ReLibraConfig.from_weights(cost.reorder_weights())
