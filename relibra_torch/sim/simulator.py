"""Run balancing systems on the same loads and compare their step times.

Legend (shape suffixes): X steps, M micro-batches, L MoE layers, S source ranks, E experts, G GPUs.

For each system the simulator walks the steps in order: ``plan = planner.plan(loads)`` then
``planner.finish`` (timed: one thread's CPU), ``evaluate``, the cost model, then ``planner.commit``
so that history-based planners (EPLB) learn and the next step's migration is counted from the
placement in force. The first ``warmup_steps`` steps are left out of the figures (no history yet).

Host work ahead of the step (the planner, and for relibra, whose layer derives every exchange
size on the host, the layer schedules of every micro-batch; baselines' engines pick replicas per
token on the GPU) is one thread's CPU time (:func:`one_thread_cpu`). A planner that plans layers
apart runs as the training hook runs it (``planning.split``): the slowest EP rank's share plus
three small collectives counts. It is charged where it exceeds the overlap window
(``planning.overlap_s``; default: static's forward pass over the step, during which RL pipelines
compute old log-probs with the same replay). Static has no host work; systems that plan at run
time (a ``plan_latency_s`` attribute: the online systems) are charged that latency per layer and
micro-batch instead.

"static", "uniform" and "bound" are always computed (the speedup, "of uniform" and "of
bound" figures are relative to them). ``bound`` is a lower bound no plan can beat
(:mod:`relibra_torch.sim.bound`); ``uniform``, uniform routing on balanced GPUs, a plan can beat.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..checks import check_int
from ..cputime import one_thread_cpu
from ..planning.base import Planner, StaticPlanner, join_layer_shares, layer_share, planner_digest
from ..planning.evaluate import evaluate
from ..planning.plan import StepPlan, plan_digest, validate_plan
from ..planning.topology import Topology
from ..replay.counts import count_pairs
from .baselines import BaselineOptions, with_host_scale
from .bound import REFERENCES, balanced_at_own_bytes_s, bound_step_cost
from .cost import CostModel, CostOptions, StepCost
from .dispatch import ESTIMATE_NOTE, EXACT_NOTE, hierarchical_metrics
from .memory import MemoryBreakdown, MemoryOptions, ideal_memory, plan_memory
from .memory_fit import TraceShape, refusal
from .presets import HardwareSpec, ModelSpec
from .workload import Workload, measured_micro_batches

__all__ = ["REFERENCES", "SYSTEMS", "SimConfig", "SystemResult", "SimResult", "simulate", "default_planner_factory",
           "parse_systems"]

SYSTEMS = ("static", "eplb", "eplb-oracle", "eplb-instance", "eplb-oracle-instance", "online-node",
           "online-global", "online-global-planned", "eplb-node-demand", "relibra", *REFERENCES)

PlannerFactory = Callable[[str, Topology, CostModel], Planner]


def parse_systems(text: str) -> tuple[str, ...]:
    """``"static,relibra"`` -> the systems to run, in the canonical order, static, uniform and bound added."""
    names = [s.strip().lower() for s in str(text).split(",") if s.strip()]
    if not names:
        raise ValueError(f"--systems is empty; allowed: {','.join(SYSTEMS)}")
    bad = [n for n in names if n not in SYSTEMS]
    if bad:
        raise ValueError(f"--systems has unknown {','.join(bad)}; allowed: {','.join(SYSTEMS)}")
    wanted = set(names) | {"static", *REFERENCES}
    return tuple(s for s in SYSTEMS if s in wanted)


def default_planner_factory(name: str, topology: Topology, cost: CostModel,
                            options: BaselineOptions | None = None) -> Planner:
    """The project's planner ``name``; the ReLibra planner gets the cost model's weights, the
    baselines their ``options`` (defaults: :class:`BaselineOptions`)."""
    if name == "static":
        return StaticPlanner(topology)
    from ..planning import ReLibraConfig, make_planner
    if name == "relibra":
        # hierarchical dispatch: relibra prices co-activation (where the source has per-token ids)
        options = with_host_scale(options or BaselineOptions())
        fields = {**options.relibra_fields(), "dense_fwd_s_per_token": cost.dense_fwd_s_per_token()}
        if options.planning_overlap_s is not None:  # a fixed window: the guard's estimate does not apply
            fields.update(plan_floor_s=0.0, plan_floor_nodes_s=0.0)
        if cost.options.refetch_replicas:  # the light plan's price keeps replica buffers
            fields.update(light_share=0.0)
        return make_planner(name, topology, config=ReLibraConfig.from_weights(
            cost.reorder_weights(), dispatch=cost.options.dispatch, top_k=cost.model.top_k, **fields))
    kwargs = (options or BaselineOptions()).planner_kwargs(name)
    if name == "eplb-node-demand":
        # relibra's prices for its step-long traffic replicas (the same rule, the same costs)
        w = cost.reorder_weights()
        kwargs.update(cross_node_s_per_token=w.cross_node_s_per_token,
                      cross_replica_fill_s_per_expert=w.cross_replica_fill_s_per_expert)
    if name.startswith("eplb") and kwargs.get("num_groups", 1) == 1:
        # EPLB's hierarchical policy packs the model's expert groups (n_group), unless the
        # [eplb] section sets num_groups itself
        kwargs["num_groups"] = cost.model.num_expert_groups
    return make_planner(name, topology, **kwargs)


@dataclass
class SimConfig:
    """What to simulate (the workload is passed separately)."""

    model: ModelSpec
    hardware: HardwareSpec
    topology: Topology
    systems: tuple[str, ...] = SYSTEMS
    cost_options: CostOptions = field(default_factory=CostOptions)
    warmup_steps: int = 0
    validate: bool = True
    baseline_options: BaselineOptions = field(default_factory=BaselineOptions)
    # the memory model's recipe; with memory_check, a plan whose busiest GPU needs more
    # than the capacity raises ValueError (the CLI sets it unless --ignore-memory)
    memory: MemoryOptions = field(default_factory=MemoryOptions)
    memory_check: bool = False
    memory_world: int | None = None  # GPUs of the dense part's data-parallel group (None: the EP size)
    memory_trace: TraceShape | None = None  # what sets the activations (a refusal's advice)

    def __post_init__(self) -> None:
        if self.topology.num_experts != self.model.num_experts:
            raise ValueError(f"the topology has {self.topology.num_experts} experts but --model "
                             f"{self.model.name} has {self.model.num_experts}")
        check_int("--warmup-steps", self.warmup_steps, 0)


@dataclass
class SystemResult:
    """One system's results over the measured steps.

    Attributes:
        name: the system.
        imbalance_XML: float64 ``[X, M, L]`` per measured step, micro-batch and layer.
        costs: one :class:`StepCost` per measured step.
        planner_s: one thread's CPU seconds of ``plan()`` per measured step (empty for the references).
        host_s: CPU seconds of the step's host work ahead of it (``plan()`` plus the token
            split of every micro-batch; 0 for run-time planners), per measured step.
        window_s: the overlap window it hides behind, per measured step.
        charged_s: ``max(0, host_s - window_s)``, added to the step time, per measured step.
        balanced_s: per measured step, :func:`~relibra_torch.sim.bound.balanced_at_own_bytes_s`
            (the step time itself for the references).
        active_XM: bool ``[X, M]``, the micro-batch holds tokens on some rank; None: all do.
            An empty micro-batch has no load to balance (its imbalance is 1.0 by
            definition), so the imbalance figures leave it out.
    """

    name: str
    imbalance_XML: torch.Tensor
    costs: list[StepCost]
    planner_s: list[float]
    memory: list[MemoryBreakdown] = field(default_factory=list)  # per measured step, busiest GPU
    host_s: list[float] = field(default_factory=list)
    window_s: list[float] = field(default_factory=list)
    charged_s: list[float] = field(default_factory=list)
    balanced_s: list[float] = field(default_factory=list)
    active_XM: torch.Tensor | None = None

    def mean(self, attr: str) -> float:
        return sum(float(getattr(c, attr)) for c in self.costs) / len(self.costs)

    def figures(self) -> dict:
        """The per-system figures (means per step over the measured steps)."""
        imb = self.imbalance_XML.flatten()
        if self.active_XM is not None and bool(self.active_XM.any()):
            imb = self.imbalance_XML[self.active_XM].flatten()
        return {
            "imbalance_mean": float(imb.mean()),
            "imbalance_p50": float(imb.quantile(0.5)),
            "imbalance_p99": float(imb.quantile(0.99)),
            "imbalance_max": float(imb.max()),
            "moe_layer_time_s": self.mean("moe_s"),
            "expert_compute_s": sum(float(c.expert_s_ML.sum()) for c in self.costs) / len(self.costs),
            "all_to_all_s": sum(float(c.all_to_all_s_ML.sum()) for c in self.costs) / len(self.costs),
            "replica_transfer_s": sum(float(c.replica_s_ML.sum()) for c in self.costs) / len(self.costs),
            "replica_exposed_s": sum(float(c.replica_exposed_s_ML.sum()) for c in self.costs) / len(self.costs),
            "collective_latency_s": sum(float(c.latency_s_ML.sum()) for c in self.costs
                                        if c.latency_s_ML is not None) / len(self.costs),
            "planning_exposed_s": sum(float(c.planning_exposed_s_ML.sum()) for c in self.costs
                                      if c.planning_exposed_s_ML is not None) / len(self.costs),
            "attention_dense_s": self.mean("attention_dense_s"),
            "migration_s": self.mean("migration_s"),
            "step_time_s": self.mean("step_s"),
            "cross_node_bytes": self.mean("cross_node_bytes"),
            "cross_node_recv_imbalance": self.mean("cross_node_recv_imbalance"),
            "intra_node_bytes": self.mean("intra_node_bytes"),
            "replica_bytes": self.mean("replica_bytes"),
            "migrated_experts": self.mean("migrated_experts"),
            "migrated_bytes": self.mean("migrated_bytes"),
            "planner_s": sum(self.planner_s) / len(self.planner_s) if self.planner_s else 0.0,
            "host_cpu_s": sum(self.host_s) / len(self.host_s) if self.host_s else 0.0,
            "overlap_window_s": sum(self.window_s) / len(self.window_s) if self.window_s else 0.0,
            "planning_charged_s": sum(self.charged_s) / len(self.charged_s) if self.charged_s else 0.0,
            "balanced_at_own_bytes_s": (sum(self.balanced_s) / len(self.balanced_s) if self.balanced_s
                                        else self.mean("step_s")),
            **self.memory_figures(),
        }

    def memory_figures(self) -> dict:
        """``memory_peak_bytes`` (the busiest GPU's peak over the measured steps) and
        ``memory`` (that step's breakdown, bytes; see :class:`MemoryBreakdown`)."""
        if not self.memory:
            return {"memory_peak_bytes": None, "memory": None}
        worst = max(self.memory, key=lambda b: b.peak)
        return {"memory_peak_bytes": worst.peak, "memory": worst.as_dict()}


@dataclass
class SimResult:
    """All systems' results plus the configuration that produced them."""

    config: SimConfig
    workload: Workload
    systems: dict[str, SystemResult]

    def figures(self) -> dict[str, dict]:
        """Per-system figures with the ratios: ``speedup_vs_static``, ``speedup_vs_eplb_oracle``
        (when that system ran), ``fraction_of_bound`` (bound step time / the system's, at most
        1) and ``fraction_of_uniform`` (uniform-routing reference / the system's; was
        ``fraction_of_ideal``)."""
        out = {name: r.figures() for name, r in self.systems.items()}
        static = out["static"]["step_time_s"]
        uniform = out["uniform"]["step_time_s"]
        bound = out["bound"]["step_time_s"]
        oracle = out.get("eplb-oracle", {}).get("step_time_s")
        for fig in out.values():
            fig["speedup_vs_static"] = static / fig["step_time_s"]
            fig["speedup_vs_eplb_oracle"] = oracle / fig["step_time_s"] if oracle else None
            fig["fraction_of_bound"] = bound / fig["step_time_s"]
            fig["fraction_of_uniform"] = uniform / fig["step_time_s"]
        return out


def simulate(workload: Workload, config: SimConfig,
             planner_factory: PlannerFactory = default_planner_factory,
             progress: Callable[[str, int, int], None] | None = None) -> SimResult:
    """Run every system of ``config`` on ``workload``.

    Args:
        workload: loads ``[X, M, L, S, E]`` and token counts.
        config: model, hardware, topology, systems, cost options, warm-up steps.
        planner_factory: ``(name, topology, cost_model) -> Planner`` for every system but the
            references (uniform, bound).
        progress: called as ``progress(system, steps_done, steps_total)`` after each step.
    Returns:
        :class:`SimResult`.
    """
    X = workload.num_steps
    if config.warmup_steps >= X:
        raise ValueError(f"--warmup-steps={config.warmup_steps} leaves no measured step out of "
                         f"--steps={X}; allowed: 0..{X - 1}")
    topo = config.topology
    if workload.loads_XMLSE.shape[3] != topo.num_gpus or workload.loads_XMLSE.shape[4] != topo.num_experts:
        raise ValueError(f"the workload's loads {tuple(workload.loads_XMLSE.shape)} do not fit "
                         f"{topo.num_gpus} GPUs x {topo.num_experts} experts")
    cost = CostModel(config.model, config.hardware, config.cost_options)
    config = replace(config, baseline_options=with_host_scale(config.baseline_options, config.systems))
    if planner_factory is default_planner_factory:
        def planner_factory(name, topology, cost_model):
            return default_planner_factory(name, topology, cost_model, config.baseline_options)
    if cost.options.dispatch == "hierarchical":  # say how remote nodes per token were counted
        workload.notes["dispatch"] = EXACT_NOTE if workload.routing is not None else ESTIMATE_NOTE
    active_XM = measured_micro_batches(workload, config.warmup_steps)  # refuses tokenless measured steps
    results: dict[str, SystemResult] = {}
    # the ratios need static and the references: always run them (references last)
    systems = [n for n in config.systems if n not in REFERENCES]
    systems = (["static"] if "static" not in systems else []) + systems + list(REFERENCES)
    # the overlap window of every system: static's forward pass of the step (the old
    # log-probabilities are computed before the plan being made exists; static runs first)
    window_X: dict[int, float] = {}
    for name in systems:
        imb, costs, planner_s, balanced, memory = [], [], [], [], []
        host: dict[str, list[float]] = {"host_s": [], "window_s": [], "charged_s": []}
        planner = None if name in REFERENCES else planner_factory(name, topo, cost)
        if getattr(planner, "host_token_splits", False):  # the layer's host code, imported untimed: with
            from ..moe import schedule_batch  # noqa: F401  # no warm-up step its ~2 s of CPU was step 1's host work
        for x in range(X):
            loads_MLSE = workload.loads_XMLSE[x]
            tokens_MS, pairs_MS = workload.tokens_XMS[x], workload.attn_pairs_XMS[x]
            measured = x >= config.warmup_steps
            if planner is None:
                if measured:
                    if name == "bound":
                        costs.append(bound_step_cost(cost, loads_MLSE, topo, tokens_MS, pairs_MS))
                    else:
                        costs.append(cost.uniform_step_cost(loads_MLSE, topo.num_nodes, topo.gpus_per_node,
                                                            tokens_MS, pairs_MS))
                    imb.append(torch.ones(loads_MLSE.shape[:2], dtype=torch.float64))
                    memory.append(ideal_memory(config.model, config.memory, loads_MLSE, tokens_MS, config.memory_world))
            else:
                pairs_LEE = None
                if getattr(planner, "uses_coactivation", False) and workload.routing is not None:
                    r = workload.routing  # the step's exact pair counts, as replay gives them
                    pairs_LEE = count_pairs(r.routed_experts_TLK[r.token_index[x]], topo.num_experts)
                if x == 0 and config.warmup_steps == 0:  # no warm-up step: one untimed plan on a copy
                    _warm_up(planner, loads_MLSE, pairs_LEE, config)
                plan, secs, splits = plan_as_run(planner, loads_MLSE, pairs_LEE, config)
                if config.validate:
                    validate_plan(plan, loads_MLSE)
                if measured:  # a warm-up step only advances the planner's state
                    metrics = evaluate(plan, loads_MLSE)
                    if cost.options.dispatch == "hierarchical":
                        metrics = hierarchical_metrics(plan, metrics, loads_MLSE, tokens_MS,
                                                       config.model.top_k, workload.routing, x)
                    costs.append(cost.step_cost(plan, metrics, tokens_MS, pairs_MS,
                                                getattr(planner, "plan_latency_s", 0.0)))
                    imb.append(metrics.imbalance_ML)
                    planner_s.append(secs)
                    balanced.append(balanced_at_own_bytes_s(cost, metrics, tokens_MS, pairs_MS, topo))
                    memory.append(plan_memory(config.model, config.memory, plan, metrics.gpu_load_MLG, tokens_MS,
                                              config.memory_world))
                    _check_memory(config, name, x, memory[-1])
                    if name == "static":
                        window_X[x] = forward_s(costs[-1])
                    _charge_host_work(host, plan, loads_MLSE, secs, costs[-1], window_X[x], config.baseline_options,
                                      run_time=hasattr(planner, "plan_latency_s"),
                                      host_splits=getattr(planner, "host_token_splits", False), splits=splits)
                planner.commit(plan, loads_MLSE)
            if progress is not None:
                progress(name, x + 1, X)
        results[name] = SystemResult(name, torch.stack(imb), costs, planner_s, balanced_s=balanced,
                                     active_XM=active_XM, memory=memory, **host)
    return SimResult(config, workload, results)


def _warm_up(planner: Planner, loads_MLSE: torch.Tensor, pairs_LEE: torch.Tensor | None, config: SimConfig) -> None:
    """Plan the first step once, untimed, on a copy of ``planner`` (its state untouched), and
    build its schedules where the layer would: the first call of the host code in a process
    costs 1-2 ms more than every later one (the hook's steady state), which a run without a
    warm-up step would otherwise charge as a step's host work."""
    plan, _, splits = plan_as_run(copy.deepcopy(planner), loads_MLSE, pairs_LEE, config)
    if getattr(planner, "host_token_splits", False):
        _rank0_schedules(plan, loads_MLSE, splits)


def _rank0_schedules(plan: StepPlan, loads_MLSE: torch.Tensor, splits: tuple[torch.Tensor, torch.Tensor] | None):
    """Rank 0's schedules of every micro-batch, as ``ReplayBalancer.plan_step`` builds them after
    planning (``splits``: the ranks' token splits and native layers, or ``None``)."""
    from ..moe.schedule_batch import rank_schedules  # the layer's host code
    split_MLSGJ, native_L = splits if splits is not None else (None, None)
    rank_schedules(plan, loads_MLSE, 0, split_MLSGJ, native_L=native_L)


def plan_as_run(planner: Planner, loads_MLSE: torch.Tensor, pairs_LEE: torch.Tensor | None,
                config: SimConfig) -> tuple[StepPlan, float, tuple[torch.Tensor, torch.Tensor] | None]:
    """The step's plan, its host seconds and, where the ranks split the tokens too, the joined
    ``share_splits`` (``[M, L, S, G, J]``, native ``[L]``; else ``None``), as the hook runs it.
    With split planning (``planning.split``, the hook's default) and a planner that plans layers
    independently, each of the ``G`` EP ranks plans its share (:func:`~relibra_torch.planning.base.layer_share`),
    the ranks agree on the planner's state (a sha256), then all-gather the parts and whether any
    failed: three collectives. The host work is the digest and the slowest rank's share (one thread's
    CPU; for relibra with its share's token splits and ``Planner.finish``) plus those collectives
    (latency, and the gathered int64 bytes over the slowest link). Otherwise one thread plans the
    whole step, then hashes the plan for the ranks to compare (two collectives). Static: no hook."""
    splits = getattr(planner, "host_token_splits", False)

    def run(layers=None):  # planner.finish once the splits are known: with splits, after them (below)
        args = (loads_MLSE,) if layers is None else (loads_MLSE, layers)
        args += () if pairs_LEE is None else (pairs_LEE,)
        if layers is None:
            return planner.finish(planner.plan(*args), loads_MLSE)
        part = planner.plan_layers(*args)
        return part if splits else planner.finish(part, loads_MLSE[:, layers], None, L)

    topo, L = config.topology, loads_MLSE.shape[1]
    ranks = topo.num_gpus
    if isinstance(planner, StaticPlanner):  # a static run has no hook: no planning, no collective
        return run(), 0.0, None
    hw = config.hardware
    latency_us, gbps = ((hw.inter_node_latency_us, hw.inter_node_gbps) if topo.num_nodes > 1
                        else (hw.nvlink_latency_us, hw.nvlink_gbps))
    if not (config.baseline_options.planning_split and getattr(planner, "splits_layers", False)
            and ranks > 1 and L > 1):
        plan, secs = one_thread_cpu(run)
        if ranks == 1:
            return plan, secs, None
        # the hook's whole-step path: a digest of the plan, its agreement and the failure flag
        return plan, secs + one_thread_cpu(lambda: plan_digest(plan))[1] + 2 * latency_us * 1e-6, None

    # the hook hashes the planner's state before the ranks agree on it
    digest_s = one_thread_cpu(lambda: planner_digest(planner, topo))[1]
    M, J = loads_MLSE.shape[0], topo.slots_per_gpu
    split_MLSGJ = torch.empty(M, L, ranks, ranks, J, dtype=torch.int64) if splits else None
    native_L = torch.zeros(L, dtype=torch.bool) if splits else None
    parts, secs = [], []
    for r in range(min(ranks, L)):
        share = layer_share(r, ranks, L)
        part, s = one_thread_cpu(lambda: run(share))
        if splits:  # the rank splits its own layers' tokens for the schedules, then finishes (relays)
            (split_MLSGJ[:, share], native_L[share], part), t = one_thread_cpu(
                lambda: _split_then_finish(planner, part, loads_MLSE[:, share], L))
            s += t
        parts.append(part)
        secs.append(s)
    plan = join_layer_shares(parts, ranks, planner.previous_placement(L), planner.name)
    per_rank_layers = -(-L // ranks)  # the hook pads every rank's part to this many layers
    gathered = ranks * 8 * per_rank_layers * (topo.num_experts + 2 * M * ranks * J + M * ranks * topo.gpus_per_node
                                              + splits * (M * ranks * ranks * J + 1))
    gather_s = 3 * latency_us * 1e-6 + gathered * (ranks - 1) / ranks / (gbps * 1e9)
    return plan, digest_s + max(secs) + gather_s, (split_MLSGJ, native_L) if splits else None


def _split_then_finish(planner: Planner, part: StepPlan, loads_MLSE: torch.Tensor, total_layers: int):
    """``(split, native_L, part)``: a share's ``share_splits``, then ``Planner.finish`` from them (the hook's order)."""
    from ..moe.schedule_batch import share_splits  # the hook's code (imports the layer on first use)
    split_MLSGJ, native_L = share_splits(part, loads_MLSE)
    return split_MLSGJ, native_L, planner.finish(part, loads_MLSE, split_MLSGJ, total_layers)


def _check_memory(config: SimConfig, name: str, step: int, b: MemoryBreakdown) -> None:
    """Refuse (``ValueError``) a plan whose busiest GPU does not fit, when asked to, with the fixes (memory_fit.refusal)."""
    topo = config.topology
    msg = config.memory_check and refusal(
        b, config.model, topo, config.hardware, config.memory,
        f"{name}'s plan of step {step} ({config.model.name} on {topo.num_nodes} x {topo.gpus_per_node} "
        f"{config.hardware.name}, R={topo.replica_slots})", config.memory_trace)
    if msg:
        raise ValueError(msg)


def forward_s(c: StepCost) -> float:
    """The cost model's forward pass of a step: a third of expert and dense compute (backward
    is twice forward), half of the all-to-all (dispatch and combine, forward only) and half
    of the layer's collectives' fixed latency (the forward's dispatch and combine pay theirs;
    on micro-batches of a few tokens per GPU that latency is most of the pass)."""
    latency_s = float(c.latency_s_ML.sum()) if c.latency_s_ML is not None else 0.0
    return (float(c.expert_s_ML.sum()) / 3 + float(c.all_to_all_s_ML.sum()) / 2 + c.attention_dense_s / 3
            + latency_s / 2)


def _charge_host_work(host: dict[str, list[float]], plan, loads_MLSE: torch.Tensor, planner_s: float,
                      c: StepCost, forward_window_s: float, options: BaselineOptions, run_time: bool,
                      host_splits: bool, splits: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Add the host work that does not fit the overlap window to the step (see the module
    docstring); record host CPU, window and charge in ``host``. ``host_splits``: the system's
    layer derives every exchange size on the host: relibra's hook builds every micro-batch's
    layer plans (``token_split``, residencies) and one rank's schedules after planning
    (``moe.schedule_batch.rank_schedules``, timed here on rank 0's); the baselines' engines pick a
    replica per token on the GPU, static has none. ``splits``: the token splits and native layers the
    ranks made with their planning shares (``plan_as_run``), not charged again."""
    window = forward_window_s if options.planning_overlap_s is None else options.planning_overlap_s
    if run_time:  # planned on the critical path, per layer: the cost model charged its latency
        work = 0.0
    elif not host_splits:
        work = planner_s
    else:  # what ReplayBalancer.plan_step does after planning: every micro-batch's schedules
        work = planner_s + one_thread_cpu(lambda: _rank0_schedules(plan, loads_MLSE, splits))[1]
    charged = max(0.0, work - window)
    c.step_s += charged
    host["host_s"].append(work)
    host["window_s"].append(window)
    host["charged_s"].append(charged)
