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
import torch.distributed as dist

from .compat import all_gather_single
from .cputime import one_thread
from .moe.host_speed import measure_host_scale
from .moe.schedule_batch import rank_schedules, share_splits
from .planning import Planner, StepPlan, make_planner, native_plan, plan_digest
from .planning.base import layer_share
from .planning.evaluate import imbalance
from .planning.base import planner_digest
from .planning.pricing import relibra_config_for
from .replay.counts import checked_counts, count_micro_batches, count_pairs

__all__ = ["PlanDivergence", "ReplayBalancer", "StepReport", "count_loads", "relibra_config_for"]


class PlanDivergence(RuntimeError):
    """EP ranks computed different plans (or different count shapes) for the same step."""


@dataclass
class StepReport:
    """What the last :meth:`ReplayBalancer.plan_step` did.

    Attributes:
        planner_s: wall time of the planner on this rank (its share of the layers when
            planning is split over the EP ranks).
        fell_back: the planner failed somewhere; the step runs without replicas.
        migrated_experts: experts whose owner GPU changed, summed over layers.
        predicted_imbalance_ML: float64 ``[M, L]`` max/mean GPU tokens the plan predicts.
        static_imbalance_ML: float64 ``[M, L]`` the same for the previous placement without
            replicas (what the step would have cost without balancing).
        degraded_micro_batches: indices of this step's micro-batches in which some layer
            found routed ids that did not match the plan and ran degraded (on the current
            placement without replicas: correct, slower). Filled while the step runs.
        collectives: collectives ``plan_step`` issued on this rank (count gathers, pair
            all-reduce, plan agreement, failure flag, migration): ``step_collectives``.
        schedules_s: wall time ``plan_step`` spent building every micro-batch's layer
            schedules of this rank after planning (``moe.schedule_batch.rank_schedules``, and
            with split planning this rank's share of the token splits), already on the
            layers' device, so that ``install`` only hands them over.
    """

    planner_s: float = 0.0
    fell_back: bool = False
    migrated_experts: int = 0
    predicted_imbalance_ML: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    static_imbalance_ML: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    degraded_micro_batches: set[int] = field(default_factory=set)
    collectives: int = 0
    schedules_s: float = 0.0


def count_loads(routed_experts: Sequence[torch.Tensor], num_layers: int, num_experts: int,
                top_k: int | None = None) -> torch.Tensor:
    """Token-expert counts of this rank's micro-batches.

    Args:
        routed_experts: one int tensor ``[T_m, L, K]`` (or ``[..., L, K]``) per micro-batch.
        top_k: the layers' top-k, which ``K`` must equal (``None``: any).
    Returns:
        int64 ``[M, L, E]``.

    A thin wrapper over :func:`relibra_torch.replay.counts.count_micro_batches` (the one
    counting implementation), kept here as public API.
    """
    return count_micro_batches(routed_experts, num_layers, num_experts, top_k=top_k)


class ReplayBalancer:
    """Plans and installs balanced expert execution for every ``ReplayBalancedMoE`` of a model.

    Args:
        model: a module containing ``ReplayBalancedMoE`` layers (found in ``modules()`` order,
            which is the layer order of the replayed ids' ``L`` dimension), or a list of them.
        planner: a planner name (``static``, ``eplb``, ``eplb-oracle``, ``relibra``) or a
            :class:`~relibra_torch.planning.Planner` built for the layers' topology.
        planner_kwargs: extra arguments for :func:`~relibra_torch.planning.make_planner`.
        hardware: hardware preset (``relibra_torch.planning.pricing``) whose bandwidths and
            throughput price the relibra planner's objective when ``planner_kwargs`` has no
            ``config``: migrations and replica fills are then charged for the layers' real
            expert size, so small models move and replicate freely and large ones only when
            it pays. On CUDA layers that config has the simulator's planning floors
            (``planning.worth``: a layer where no plan can repay the search's host time keeps
            its placement); on CPU layers it plans every layer.
        split_planning: with an EP group and a planner that plans layers independently
            (``Planner.splits_layers``: static, relibra, the EPLB planners), each EP rank
            plans every ``G``-th layer and the ranks all-gather the parts (planning time
            divided by ``G``). The
            ranks first agree on a digest of the planner's inputs (gathered loads, planner
            state and config), since the assembled plan is then identical by construction.
            ``False``: every rank plans the whole step and the ranks compare plan digests.
    """

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module], planner: str | Planner = "relibra",
                 planner_kwargs: dict | None = None, hardware: str = "h200", split_planning: bool = True):
        from .moe import EngineHost, moe_layers  # the layer imports ops; keep this module light

        if isinstance(model, (list, tuple)):
            self.layers = [m for m in model if isinstance(m, EngineHost)]
        else:
            self.layers = [layer for _, layer in moe_layers(model)]
        if not self.layers:
            raise ValueError("model contains no relibra MoE layer (ReplayBalancedMoE or torchtitan "
                             "RelibraMoE); swap its MoE layers first")
        self.topology = self.layers[0].topology
        for i, layer in enumerate(self.layers):
            if layer.topology != self.topology:
                raise ValueError(f"MoE layer {i} has topology {layer.topology}, layer 0 has "
                                 f"{self.topology}; all layers must share one EP layout")
        self.ep = self.layers[0].engine.ep  # the EP group the layers exchange over
        self._collectives = 0  # host_scales' all-gather below counts here; the count restarts with the steps
        if isinstance(planner, str):
            kwargs = dict(planner_kwargs or {})
            if planner == "relibra" and "config" not in kwargs:
                # the guard (planning.worth) keeps host planning off a GPU step it cannot
                # shorten; a CPU run (gloo, toy models) has no GPU step: plan every layer
                on_gpu = any(p.device.type == "cuda" for p in self.layers[0].parameters())
                # the light plan's price keeps replica buffers (one fill per residency)
                refetch = {"light_share": 0.0} if self.layers[0].engine.refetch_replicas else {}
                kwargs["config"] = relibra_config_for(self.layers[0], hardware, **(
                    {**refetch, **self.host_scales()} if on_gpu else {"plan_floor_s": 0.0, "plan_floor_nodes_s": 0.0}))
            planner = make_planner(planner, self.topology, **kwargs)
        elif planner.topology != self.topology:
            raise ValueError(f"planner topology {planner.topology} differs from the layers' {self.topology}")
        self.planner = planner
        self.split_planning = bool(split_planning)
        self.planner.placement_LE = torch.stack([layer.placement_cpu for layer in self.layers])
        self.plan: StepPlan | None = None
        self.loads_MLSE: torch.Tensor | None = None
        self._schedules: list = []  # [M][L] (layer plan, this rank's schedule) of the step
        self.report = StepReport()
        self._collectives = 0
        self._warned_optimizer = False
        top_k = {getattr(layer, "top_k", None) for layer in self.layers} - {None}
        if len(top_k) > 1:
            raise ValueError(f"the MoE layers route to different top_k {sorted(top_k)}; one balancer plans "
                             "layers of one top_k (one replayed [T, L, K] tensor per micro-batch)")
        self.top_k = top_k.pop() if top_k else None

    def host_scales(self) -> dict[str, float]:
        """``host_scale`` and ``host_scale_nodes`` for relibra's guard on GPU layers: each EP
        rank's host measured (``moe.host_speed``, once per process), the slowest rank's (the
        largest) on every rank: split planning waits for it, and the ranks must hold one
        config (their planner digests must agree). One all-gather."""
        scales = self._all_gather(torch.tensor(measure_host_scale(), dtype=torch.float64)).amax(0)
        return {"host_scale": float(scales[0]), "host_scale_nodes": float(scales[1])}

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    # -- collectives (every rank calls each of them, in the same order, with fixed sizes) --
    def _collective_device(self) -> torch.device:
        """Where the EP group exchanges: the GPU for NCCL, the CPU for gloo."""
        if dist.get_backend(self.ep.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[S, *t.shape]`` on the CPU: every rank's ``t`` (NCCL groups exchange on the GPU)."""
        if self.ep.group is None:
            return t.unsqueeze(0)
        self._collectives += 1
        device = self._collective_device()
        # a flat output (what gloo wants): [S * numel], viewed back as [S, *shape]
        out = torch.empty(self.ep.size * t.numel(), dtype=t.dtype, device=device)
        all_gather_single(out, t.contiguous().view(-1).to(device), group=self.ep.group)
        return out.cpu().view(self.ep.size, *t.shape)

    def _check_agreement(self, digest: int, what: str) -> None:
        digests = self._all_gather(torch.tensor([digest], dtype=torch.int64)).flatten()
        if not (digests == digests[0]).all():
            raise PlanDivergence(
                f"EP ranks have different {what} (digest per rank: {[hex(int(d)) for d in digests]}); "
                "the planner must be deterministic and every rank must use the same planner, config "
                "and relibra_torch version")

    def _gather_pairs(self, routed_experts) -> torch.Tensor | None:
        """The step's co-activation counts ``[L, E, E]`` summed over micro-batches and EP ranks
        (one all-reduce), for planners that price them (hierarchical dispatch); else None.

        Decided by the planner alone, so every rank joins the all-reduce; a rank that passed
        ``counts_MLE`` instead of routed ids has no pairs to add and contributes zeros.
        """
        if not getattr(self.planner, "uses_coactivation", False):
            return None
        E = self.topology.num_experts
        pairs_LEE = torch.zeros(self.num_layers, E, E, dtype=torch.int64)
        for ids in routed_experts or ():
            pairs_LEE += count_pairs(ids, E).cpu()
        if self.ep.group is not None:
            pairs_LEE = pairs_LEE.to(self._collective_device())
            dist.all_reduce(pairs_LEE, group=self.ep.group)
            self._collectives += 1
            pairs_LEE = pairs_LEE.cpu()
        return pairs_LEE

    def _plan_share(self, loads_MLSE: torch.Tensor, pairs_LEE: torch.Tensor | None = None
                    ) -> tuple[StepPlan | None, tuple[torch.Tensor, torch.Tensor] | None, float, int]:
        """This rank's share of the layers (every G-th from its rank), its token splits
        ``[M, L', S, G, J]`` with its native layers ``[L']`` (``share_splits``), this rank's
        seconds in those splits, and
        whether it failed (then ``None``s). A share of the wrong size or splits that raise
        count as a planner failure: raised here, on this rank only, they would leave the
        other ranks waiting in the all-gather."""
        mine = layer_share(self.ep.rank, self.ep.size, self.num_layers)
        if not mine:
            return None, None, 0.0, 0
        try:
            part = (self.planner.plan_layers(loads_MLSE, mine, pairs_LEE) if pairs_LEE is not None
                    else self.planner.plan_layers(loads_MLSE, mine))
            if part.num_layers != len(mine) or part.num_micro_batches != loads_MLSE.shape[0]:
                raise ValueError(f"plan_layers returned {part.num_layers} layers for a share of {len(mine)} "
                                 f"({part.num_micro_batches} micro-batches for {loads_MLSE.shape[0]})")
            t0 = time.perf_counter()
            split = share_splits(part, loads_MLSE[:, mine])
            part = self.planner.finish(part, loads_MLSE[:, mine], split[0], self.num_layers)  # relibra: relays
            return part, split, time.perf_counter() - t0, 0
        except Exception as exc:  # noqa: BLE001 - any planner failure degrades, never breaks
            warnings.warn(f"planner {self.planner.name!r} failed ({type(exc).__name__}: {exc}); "
                          "this step runs on the previous placement without replicas", RuntimeWarning)
            return None, None, 0.0, 1

    def _gather_plan(self, part: StepPlan | None, split: tuple[torch.Tensor, torch.Tensor] | None,
                     loads_MLSE: torch.Tensor, previous_LE: torch.Tensor
                     ) -> tuple[StepPlan, torch.Tensor, torch.Tensor]:
        """Assemble the step plan, its token splits ``[M, L, S, G, J]`` and its native layers
        ``[L]`` from every rank's share, splits and native mask (``share_splits``; one
        all-gather of a fixed size): a rank splits its own layers' tokens (rows are
        independent), so no rank splits the whole step."""
        M, L, _, E = loads_MLSE.shape
        G, J = self.topology.num_gpus, self.topology.slots_per_gpu
        S = self.ep.size
        P = -(-L // S)  # layers per rank, padded
        place = torch.zeros(P, E, dtype=torch.int64)
        se = torch.full((M, P, G, J), -1, dtype=torch.int64)
        st = torch.zeros(M, P, G, J, dtype=torch.int64)
        sp = torch.zeros(M, P, G, G, J, dtype=torch.int64)
        nat = torch.zeros(P, dtype=torch.int64)
        g = self.topology.gpus_per_node
        rel = torch.zeros(M, P, G, g, dtype=torch.int64)  # relays (planning.relay)
        if part is not None:
            n = part.num_layers
            place[:n], se[:, :n], st[:, :n] = part.placement_LE, part.slot_expert_MLGJ, part.slot_tokens_MLGJ
            sp[:, :n], nat[:n], rel[:, :n] = *split, part.relays()
        flat = self._all_gather(torch.cat([place.view(-1), se.view(-1), st.view(-1), sp.view(-1), nat, rel.view(-1)]))
        sizes = [P * E, M * P * G * J, M * P * G * J, M * P * G * G * J, P, M * P * G * g]
        place_S, se_S, st_S, sp_S, nat_S, rel_S = flat.split(sizes, dim=1)
        layer_r, layer_k = torch.arange(L) % S, torch.arange(L) // S
        pick = (lambda t, *shape: t.reshape(S, M, P, *shape)[layer_r, :, layer_k].transpose(0, 1).contiguous())
        relay = pick(rel_S, G, g)
        plan = StepPlan(self.topology, place_S.reshape(S, P, E)[layer_r, layer_k].clone(), pick(se_S, G, J),
                        pick(st_S, G, J), self.planner.name, previous_LE.clone(), relay if relay.any() else None)
        return plan, pick(sp_S, G, G, J), nat_S.reshape(S, P)[layer_r, layer_k].to(torch.bool)

    def _gather_loads(self, counts_MLE: torch.Tensor | None, error: Exception | None = None) -> torch.Tensor:
        """``[M, L, S, E]`` every rank's counts. The first exchange carries each rank's shape
        and whether its replay was refused (``error``), so a bad replay on one rank raises on
        every rank instead of leaving the others waiting in the second."""
        shape = (0, 0, 0) if counts_MLE is None else tuple(counts_MLE.shape)
        shapes = self._all_gather(torch.tensor([*shape, error is not None], dtype=torch.int64))
        bad = shapes[:, 3].nonzero().flatten().tolist()
        if bad:
            if error is not None:
                raise error
            raise ValueError(f"the replay of EP rank(s) {bad} was refused (the error on those ranks says why); "
                             "no rank planned this step")
        shapes = shapes[:, :3]
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
                optimizer already holds state (experts that move without it warn, once).
            counts_MLE: alternatively, this rank's counts ``[M, L, E]`` directly (whole,
                finite, non-negative).

        A replay refused on any rank (ids out of range, another top-k, bad counts) raises on
        every rank: that rank's error, and on the others a ``ValueError`` naming it.

        Returns:
            the step plan (the same on every rank).
        """
        E = self.topology.num_experts
        if (routed_experts is None) == (counts_MLE is None):
            raise ValueError("pass exactly one of routed_experts (list of [T, L, K]) or counts_MLE")
        self._collectives = 0
        migration_before = sum(layer.engine.migration_collectives for layer in self.layers)
        for layer in self.layers:  # a new step: counters restart (see transfer_counts)
            layer.engine.transfer_counts.reset()
        error = None
        try:  # refused here, the replay is refused on every rank together (_gather_loads)
            counts_MLE = (count_loads(routed_experts, self.num_layers, E, self.top_k) if counts_MLE is None
                          else checked_counts(counts_MLE, self.num_layers, E))
        except (ValueError, TypeError) as exc:
            counts_MLE, error = None, exc
        loads_MLSE = self._gather_loads(counts_MLE, error)
        pairs_LEE = self._gather_pairs(routed_experts)
        previous_LE = self.planner.previous_placement(self.num_layers).clone()

        split = (self.split_planning and self.ep.group is not None and self.ep.size > 1
                 and getattr(self.planner, "splits_layers", False))
        if split:  # agree on the planner (the counts are gathered): the assembled plan is then the same everywhere
            self._check_agreement(planner_digest(self.planner, self.topology),
                                  "planner inputs (planner state or config)")
        t0 = time.perf_counter()
        failed, part, plan, split_MLSGJ, native_L, split_s = 0, None, None, None, None, 0.0
        with one_thread():  # small tensors: one thread, as the guard and the simulator price it
            if split:
                part, part_split, split_s, failed = self._plan_share(loads_MLSE, pairs_LEE)
            else:
                try:
                    plan = self.planner.finish(self.planner.plan(loads_MLSE, pairs_LEE) if pairs_LEE is not None
                                               else self.planner.plan(loads_MLSE), loads_MLSE)
                except Exception as exc:  # noqa: BLE001 - any planner failure degrades, never breaks
                    warnings.warn(f"planner {self.planner.name!r} failed ({type(exc).__name__}: {exc}); "
                                  "this step runs on the previous placement without replicas", RuntimeWarning)
                    failed = 1
        planner_s = time.perf_counter() - t0 - split_s  # the share's splits count as install work
        # Every rank learns whether any rank failed, so they all fall back together.
        if int(self._all_gather(torch.tensor([failed])).max()):
            if not failed:
                warnings.warn("the planner failed on another EP rank; this step runs on the previous "
                              "placement without replicas", RuntimeWarning)
            plan = native_plan(loads_MLSE, self.topology, previous_LE, "fallback", previous_LE)
        elif split:
            plan, split_MLSGJ, native_L = self._gather_plan(part, part_split, loads_MLSE, previous_LE)
        if not split:
            self._check_agreement(int(plan_digest(plan), 16) & ((1 << 62) - 1), "step plans")

        # the install work of every micro-batch, here rather than before each forward; before
        # any state changes, so that a plan it refuses (validate_plan, the same on every rank)
        # leaves the previous step's plan, schedules, placement and planner state in force
        t0 = time.perf_counter()
        # a layer with check_plan=False exchanges no counts at run time: its schedules are built here
        unchecked_L = torch.tensor([not layer.engine.check_plan for layer in self.layers], dtype=torch.bool)
        with one_thread():
            schedules = rank_schedules(plan, loads_MLSE, self.ep.rank, split_MLSGJ, self.layers[0].placement_E.device,
                                       unchecked_L, native_L)
        schedules_s = split_s + time.perf_counter() - t0

        moved = 0
        for l, layer in enumerate(self.layers):
            moved += layer.apply_placement(plan.placement_LE[l], optimizer)
        if moved and optimizer is None and not self._warned_optimizer:
            self._warned_optimizer = True
            warnings.warn(f"plan_step moved {moved} experts without an optimizer: an optimizer that holds "
                          "these layers' state (Adam's moments) still holds it in the old rows, so moved "
                          "experts train with another expert's state; pass plan_step(ids, optimizer)",
                          UserWarning, stacklevel=2)
        self.planner.commit(plan, loads_MLSE)
        static = native_plan(loads_MLSE, self.topology, previous_LE, "previous")
        migration = sum(layer.engine.migration_collectives for layer in self.layers) - migration_before
        self.report = StepReport(planner_s=planner_s, fell_back=plan.planner == "fallback",
                                 migrated_experts=moved, collectives=self._collectives + migration,
                                 predicted_imbalance_ML=imbalance(plan.slot_tokens_MLGJ.sum(-1)),
                                 static_imbalance_ML=imbalance(static.slot_tokens_MLGJ.sum(-1)))
        # The layers record degraded micro-batches straight into this step's report.
        for layer in self.layers:
            layer.engine.degraded_micro_batches = self.report.degraded_micro_batches
        self.plan, self.loads_MLSE, self._schedules = plan, loads_MLSE, schedules
        self.report.schedules_s = schedules_s
        return plan

    def install(self, micro_batch: int) -> None:
        """Install micro-batch ``micro_batch``'s plan in every layer (call before its forward)."""
        if self.plan is None or self.loads_MLSE is None:
            raise RuntimeError("install() before plan_step(): plan the step first")
        M = self.plan.num_micro_batches
        if not 0 <= micro_batch < M:
            raise ValueError(f"micro_batch={micro_batch} is outside the plan's [0, {M})")
        for layer, (layer_plan, schedule) in zip(self.layers, self._schedules[micro_batch]):
            layer.set_plan(layer_plan, schedule)

    def transfer_counts(self) -> dict[str, torch.Tensor]:
        """What this GPU sent in the current step, so far: int64 ``[M, L]`` per key of
        ``relibra_torch.moe.counters.COUNT_KEYS`` (forward and backward of each micro-batch
        and layer) plus ``step_collectives`` (int64 scalar: ``plan_step``'s collectives).

        Local (no collective): gather the GPUs' counts yourself, or use
        ``relibra_torch.testing.run_plan_transfers``.
        """
        from .moe.counters import stack_counts
        M = 0 if self.plan is None else self.plan.num_micro_batches
        return {**stack_counts(self.layers, M),
                "step_collectives": torch.tensor(self.report.collectives, dtype=torch.int64)}

    def clear(self) -> None:
        """Remove installed plans (layers then run on their placement without replicas)."""
        for layer in self.layers:
            layer.set_plan(None)
