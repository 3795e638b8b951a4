"""The ReLibra planner: expert reordering per step, replication per micro-batch.

Reordering (once per step and layer) chooses each expert's node, then its GPU inside the
node. It minimises, summed over the step's micro-batches,

    node_weight * max_n node_load[m, n]  +  cross_weight * cross_node_tokens[m]

plus ``migration_s_per_expert / g`` per expert that changes node, ``4 / N`` of that beyond 4 nodes
(``reorder_greedy.move_price_s``: a node's moves run over its ``g`` GPUs' links side by side, and
moves between different node pairs side by side too), so it moves only what pays. The busiest node sets
the time because replication inside the node spreads its load over its ``g`` GPUs (without
replica slots, ``R = 0``, experts then swap GPUs inside their node: ``planning.gpu_pack``). Search:
two starts (the previous placement, and a greedy assignment of experts in decreasing load
to the node with the smallest objective increase), the better one refined by steepest-
descent swaps between nodes over a deterministic candidate set, all layers at once. A
second swap search (:mod:`relibra_torch.planning.reorder_traffic`) then prices what the
all-to-all pays: each node's cross-node send and receive per micro-batch, net of the traffic
replicas it will get, busiest node first, so that experts sit near their heaviest senders
where no replica keeps those tokens home (on the six trace x dispatch tables of
docs/results.md it cuts relibra's step by 0.4-2.0%).

Replication, per micro-batch: cross-node *traffic replicas* (``R // 2`` slots per GPU,
:mod:`relibra_torch.planning.traffic`), then balancing copies inside each node
(:mod:`relibra_torch.planning.balance`), weighed per layer (:mod:`relibra_torch.planning.plain`);
a layer whose move buys nothing once replicated keeps its placement (``no_worse_than_keeping``).

Under hierarchical dispatch relays then spread each node's inter-node rows over its GPUs
(:mod:`relibra_torch.planning.relay`; :meth:`ReLibraPlanner.finish`, once the token splits are known). Integer counts up to float64 objectives, so the same loads give
the same plan on every rank (``fill_spread``, ``relay`` and ``choose`` use the estimate's exp/log1p: one build).

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, G GPUs,
g GPUs per node, El native experts per GPU, R replica slots per GPU, J = El + R,
B batched problems (M * L * N), C swap candidates per node, W candidate swap pairs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int, check_number
from .base import Planner, check_loads, check_previous_placement, native_plan
from .plan import StepPlan
from .topology import Topology
from .balance import replicate
from .reorder_load import load_first_objective, load_term, swap_search
from .reorder_traffic import colocated_pairs, traffic_swap_search
from .choose import cheapest_plan, chosen_plan
from .plain import no_worse_than_keeping, plain_plan as _plain_plan
from .fastpath import assign_gpus as _assign_gpus, fast_plan
from .gpu_pack import pack_gpus
from .polish import polish_placement
from .reorder_greedy import greedy_nodes
from .relay_choice import add_relays
from .step_window import StepWindow
from .host_time import plan_floor_s
from .worth import any_planned, guarded_plan

__all__ = ["ReLibraConfig", "ReLibraPlanner", "relibra_plan", "reorder", "replicate"]


@dataclass(frozen=True)
class ReLibraConfig:
    """Weights of the reordering objective, in seconds, and search limits.

    The defaults are Qwen3-30B-A3B on H200 (see ``relibra_torch.sim.presets``); the
    simulator passes the weights of the model and hardware it simulates.

    Attributes:
        compute_s_per_token: expert compute (fwd + bwd) of one token-expert pair on one GPU.
        cross_node_s_per_token: moving one token-expert pair across nodes (dispatch +
            combine, fwd + bwd) at one GPU's inter-node bandwidth.
        migration_s_per_expert: moving one expert (weights + optimizer state) across nodes.
        intra_migration_s_per_expert: moving one expert to another GPU of its node.
        replica_fill_s_per_expert: filling one replica slot (weights in, gradients back over
            NVLink). A replica is made only when the tokens it takes off the busiest GPU
            save at least this much (``compute + cross-node`` seconds per token), so tiny
            micro-batches are not slowed down by copies that cost more than they save.
            Default 0 (fills free): the simulator and :class:`~relibra_torch.hook.ReplayBalancer`
            price it from the expert size (about 4.2e-5 s for Qwen3-30B-A3B on H200).
        cross_replica_fill_s_per_expert: the same for a replica whose owner is on another
            node (inter-node link). Default 0 (free), priced like the intra-node fill.
        cross_node_replicas: per micro-batch, replicate each node's most-requested remote
            experts onto the node (``R // 2`` slots per GPU) so that their tokens
            stay inside it, when the saved inter-node traffic pays for the fill
            (:mod:`relibra_torch.planning.traffic`); reordering's traffic search models
            them. ``False`` keeps every replica inside its owner's node (the original
            ReLibra rule).
        dispatch: the all-to-all the cluster runs. ``"hierarchical"`` (DeepEP-style: a token
            crosses to each remote node once) makes reordering value co-activation: every
            pair of experts a token chooses together that sits on one node saves that
            token a crossing (``cross_node_s_per_token / g`` for the share ``(N-1)/N`` of
            tokens from other nodes). It needs the step's pair counts
            (:func:`relibra_torch.replay.counts.count_pairs`, which only replay gives);
            without them, or with ``"flat"``, placement ignores co-activation.
        reorder: choose a new placement each step (False: keep the previous one).
        traffic_search: after the load-first swap search, run the traffic swap search of
            reordering (each node's cross-node send and receive net of its traffic replicas).
        two_hop: a further copy of a cross-node replica on its node fills from that first copy
            over NVLink (``planning.two_hop``, which the layer and the simulator execute for
            any plan): balancing prices it as an NVLink fill (``replica_fill_s_per_expert``)
            and leaves the first copy a token so that its residency covers the copies.
            ``False``: priced as a fill from the owner's node.
        balance: balancing replication per micro-batch (copies of the busiest GPU's experts
            onto less loaded GPUs of its node). ``reorder``, ``traffic_search``,
            ``cross_node_replicas``, ``balance`` and ``choose`` switch relibra's mechanisms one
            by one (``relibra simulate --set relibra.balance=false``) for ablations.
        choose: price the plans relibra's mechanisms can make (the simulator's step cost,
            :mod:`relibra_torch.planning.price`) and keep the cheapest per layer and per step
            (:mod:`relibra_torch.planning.choose`, which also prices the plain plan). Off by
            default: ~1 ms of CPU per (micro-batch, layer) row and candidate at EP 32, more
            than the forward pass hides at ~1,000 tokens per GPU (docs/architecture.md).
        spread_fills: hierarchical: step-long traffic sets capped per owner GPU if cheaper (``fill_spread``).
        relay: hierarchical: per (micro-batch, layer), GPUs hand tokens to GPUs of their node that send
            fewer inter-node rows, where the priced all-to-all pays for it (``planning.relay``).
        intra_node_s_per_token: moving one token-expert pair to another GPU of the node
            (NVLink, dispatch + combine, fwd + bwd); prices the all-to-all of candidates.
        dense_fwd_s_per_token: forward seconds per token on one rank of everything but the
            routed experts (attention projections, router, shared experts, dense layers, LM
            head; attention's context term left out), so that the guard's step window counts
            it (``step_window``; 0: left out, a looser window). The simulator sets it.
        top_k: experts per token (0: unknown), so that hierarchical dispatch is priced in
            tokens per remote node rather than pairs.
        fill_weight_share, inter_node_latency_s, nvlink_latency_s: the weights' share of a
            replica residency's bytes (the rest is its fp32 gradient), and one collective's
            fixed latency across nodes / inside one (``ReorderWeights``); ``choose`` prices them,
            and the first balancing copy of a layer and micro-batch adds two latencies (the
            fill, the gradient return; :meth:`fill_latency_s`).
        plan_floor_s, plan_floor_nodes_s, plan_layer_s, plan_layer_nodes_s: the full search's
            CPU time on an EP rank's share of layers, fixed part and per layer, on one node and
            across nodes; layers where it cannot pay keep their placement (``worth``; a fixed
            part of 0 turns the guard off).
        plan_schedule_s: host time every rank spends on one layer's schedules when it has
            copies (at 8 micro-batches), out of the window the guard shares among planning.
        light_share: the light plan's fixed host time as a share of the full search's
            (``light``; per layer ``host_time.light_floor_s``): layers the guard keeps whose gain
            bound and window reach it get a step-long set on the kept placement where it pays (0: off).
        host_scale, host_scale_nodes: this host's planning time over that of the machine the
            host-time fields above were fitted on (``planning.pricing``), on one node and
            across nodes (two fits): the guard multiplies every one of them, and the light
            plan's per-layer parts, by the topology's. 1: that machine;
            ``moe.host_speed.measure_host_scale`` measures both (the simulator and the hook do).
        max_swap_rounds: bound on local-search rounds (both node searches, and ``gpu_pack``'s).
        swap_candidates: experts per node considered for swaps each round (the busiest
            node's heaviest against every other node's lightest, and vice versa).
    """

    compute_s_per_token: float = 5.7e-8
    cross_node_s_per_token: float = 3.3e-7
    migration_s_per_expert: float = 1.3e-3
    intra_migration_s_per_expert: float = 1.5e-4
    replica_fill_s_per_expert: float = 0.0
    cross_replica_fill_s_per_expert: float = 0.0
    cross_node_replicas: bool = True
    two_hop: bool = True
    dispatch: str = "flat"
    reorder: bool = True
    traffic_search: bool = True
    balance: bool = True
    choose: bool = False
    spread_fills: bool = True
    relay: bool = True
    intra_node_s_per_token: float = 4.1e-8
    dense_fwd_s_per_token: float = 0.0
    top_k: int = 0
    fill_weight_share: float = 1.0 / 3.0
    inter_node_latency_s: float = 0.0
    nvlink_latency_s: float = 0.0
    plan_floor_s: float = 0.0
    plan_floor_nodes_s: float = 0.0
    plan_layer_s: float = 0.0
    plan_layer_nodes_s: float = 0.0
    light_share: float = 0.0
    plan_schedule_s: float = 0.0
    host_scale: float = 1.0
    host_scale_nodes: float = 1.0
    max_swap_rounds: int = 64
    swap_candidates: int = 8

    @classmethod
    def from_weights(cls, weights, **overrides) -> "ReLibraConfig":
        """A config whose cost weights are the same-named fields of ``weights`` (a dataclass
        such as :meth:`relibra_torch.sim.cost.CostModel.reorder_weights`'s result, or a dict);
        ``overrides`` win."""
        items = weights if isinstance(weights, dict) else dataclasses.asdict(weights)
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in items.items() if k in names}, **overrides})

    def saved_s_per_token(self, num_nodes: int) -> float:
        """What one token moved to a balancing copy inside its node saves: expert compute, and
        under flat dispatch across nodes its inter-node receive too (derivation:
        :mod:`relibra_torch.planning.balance`)."""
        if num_nodes > 1 and self.dispatch == "flat":
            return self.compute_s_per_token + self.cross_node_s_per_token
        return self.compute_s_per_token

    def min_replica_tokens_on(self, num_nodes: int) -> int:
        """Fewest tokens a balancing copy must take for its fill to pay on ``num_nodes``
        nodes (0 when fills are free)."""
        per_token = self.saved_s_per_token(num_nodes)
        if self.replica_fill_s_per_expert <= 0:
            return 0
        if per_token <= 0:
            return torch.iinfo(torch.int64).max
        return math.ceil(self.replica_fill_s_per_expert / per_token)

    @property
    def min_replica_tokens(self) -> int:
        """:meth:`min_replica_tokens_on` several nodes (flat: compute + cross-node per token; hierarchical: compute)."""
        return self.min_replica_tokens_on(2)

    def fill_latency_s(self, num_nodes: int) -> float:
        """Latency a layer's first copy in a micro-batch adds: fill and gradient return, across nodes if several."""
        return 2.0 * (self.inter_node_latency_s if num_nodes > 1 else self.nvlink_latency_s)

    @property
    def min_cross_replica_tokens(self) -> int:
        """Fewest tokens a second copy of a cross-node replica must take off the busiest GPU
        of its node to pay for its fill from the owner's node (0 when fills are free).

        The tokens stay inside the node either way, so only expert compute is saved; and
        every copy is sent by the same owner, whose link carries them all. With ``two_hop``
        the copy fills from the node's first copy over NVLink (``replica_fill_s_per_expert``).
        """
        fill_s = self.replica_fill_s_per_expert if self.two_hop else self.cross_replica_fill_s_per_expert
        if fill_s <= 0:
            return 0
        if self.compute_s_per_token <= 0:
            return torch.iinfo(torch.int64).max
        return math.ceil(fill_s / self.compute_s_per_token)

    def __post_init__(self) -> None:
        for name in ("compute_s_per_token", "cross_node_s_per_token", "migration_s_per_expert",
                     "intra_migration_s_per_expert", "replica_fill_s_per_expert", "cross_replica_fill_s_per_expert",
                     "intra_node_s_per_token", "dense_fwd_s_per_token", "inter_node_latency_s", "nvlink_latency_s",
                     "plan_floor_s", "plan_floor_nodes_s", "plan_layer_s", "plan_layer_nodes_s", "plan_schedule_s"):
            check_number(name, getattr(self, name), 0)
        check_number("fill_weight_share", self.fill_weight_share, 0, maximum=1)
        check_number("light_share", self.light_share, 0, maximum=1)
        check_number("host_scale", self.host_scale, 0, strict=True)
        check_number("host_scale_nodes", self.host_scale_nodes, 0, strict=True)
        check_choice("dispatch", self.dispatch, ("flat", "hierarchical"))
        check_int("top_k", self.top_k, 0)
        for name in (f.name for f in dataclasses.fields(self) if f.type == "bool"):  # the switches
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ReLibraConfig.{name} is {getattr(self, name)!r}; allowed: True or False")
        check_int("max_swap_rounds", self.max_swap_rounds, 0)
        check_int("swap_candidates", self.swap_candidates, 1)


def _coactivation_weight(config: ReLibraConfig, pairs_LEE: torch.Tensor | None, N: int, g: int) -> float:
    """Seconds one co-located co-activated pair saves (0: co-activation not priced)."""
    if pairs_LEE is None or config.dispatch != "hierarchical" or N < 2:
        return 0.0
    return config.cross_node_s_per_token / g * (N - 1) / N


def reorder(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
            config: ReLibraConfig = ReLibraConfig(), pairs_LEE: torch.Tensor | None = None,
            also_without_traffic: bool = False):
    """Choose the step's placement ``[L, E]`` (int64 physical native slot per expert).

    ``pairs_LEE``: optional int ``[L, E, E]`` co-activation counts of the step (``count_pairs``
    of ``replay.counts``), priced under hierarchical dispatch. ``also_without_traffic``: return
    ``(placement_LE, the placement with cross_node_replicas=False)``, sharing the load-first
    search (``choose`` prices both).
    """
    M, L, S, E = loads_MLSE.shape
    N, g, El = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu
    per_node = E // N
    loads_MLSE = loads_MLSE.to(torch.int64)
    load_LME = loads_MLSE.sum(2).transpose(0, 1).contiguous()            # [L, M, E]
    own_LMNE = loads_MLSE.view(M, L, N, g, E).sum(3).permute(1, 0, 2, 3).contiguous()
    src_node_LNE = own_LMNE.sum(1)       # [L, N, E] tokens for e from node n's sources (own: per m)
    total_LE = load_LME.sum(1)
    prev_gpu_LE = previous_placement_LE // El
    prev_node_LE = prev_gpu_LE // g

    term_LME = load_term(load_LME, topology.replica_slots, El)            # the loads the load term weighs

    def node_loads(node_LE: torch.Tensor) -> torch.Tensor:
        onehot_LEN = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
        return torch.bmm(term_LME, onehot_LEN)                              # [L, M, N]

    def cross(node_LE: torch.Tensor) -> torch.Tensor:
        return (total_LE - src_node_LNE.gather(1, node_LE.unsqueeze(1)).squeeze(1)).sum(1)

    coloc_w = _coactivation_weight(config, pairs_LEE, N, g)
    pairs_LEE = pairs_LEE.to(torch.int64) if coloc_w else None

    def full_objective(node_LE: torch.Tensor) -> torch.Tensor:
        moved_L = (node_LE != prev_node_LE).sum(1)
        obj = load_first_objective(node_loads(node_LE).max(-1).values.sum(-1), cross(node_LE), moved_L, config, g, N)
        if coloc_w:
            obj = obj - coloc_w * colocated_pairs(pairs_LEE, node_LE, N).to(torch.float64)
        return obj

    # Start 1: keep the previous nodes. Start 2: greedy in decreasing load.
    best_node_LE = prev_node_LE.clone()
    if N > 1:
        greedy_LE = greedy_nodes(term_LME, total_LE, src_node_LNE, prev_node_LE, config, N, g)
        use_greedy_L = full_objective(greedy_LE) < full_objective(best_node_LE)
        best_node_LE = torch.where(use_greedy_L.unsqueeze(1), greedy_LE, best_node_LE)
        best_node_LE = swap_search(best_node_LE, term_LME, src_node_LNE, total_LE, prev_node_LE, config, N, g,
                                   full_objective, pairs_LEE, coloc_w)
    # Then each node's cross-node send and receive, net of its traffic replicas.
    out = []
    for replicas in (config.cross_node_replicas, False)[:1 + also_without_traffic]:
        node_LE = best_node_LE
        if N > 1 and config.traffic_search:
            node_LE = traffic_swap_search(best_node_LE, term_LME, own_LMNE, prev_node_LE, config, g,
                                          topology.replica_slots // 2 if replicas else 0, pairs_LEE, coloc_w)
        out.append(pack_gpus(_assign_gpus(node_LE, total_LE, prev_gpu_LE, topology), load_LME, prev_gpu_LE,
                             topology, config))
    return tuple(out) if also_without_traffic else out[0]


def relibra_plan(loads_MLSE: torch.Tensor, topology: Topology,
                 previous_placement_LE: torch.Tensor | None = None,
                 config: ReLibraConfig = ReLibraConfig(), pairs_LEE: torch.Tensor | None = None,
                 total_layers: int | None = None, step_loads_MLSE: torch.Tensor | None = None,
                 share_layers: list[int] | None = None, step_placement_LE: torch.Tensor | None = None) -> StepPlan:
    """Reorder (if ``config.reorder``) then replicate per micro-batch, on the layers where that
    can repay its host time (:mod:`~relibra_torch.planning.worth`; ``total_layers``: the step's
    layer count when these are a share of it). See the module docstring.

    Args:
        loads_MLSE: int ``[M, L, S, E]`` the step's known loads (from routing replay).
        previous_placement_LE: int64 ``[L, E]`` placement in force (static if ``None``).
        pairs_LEE: optional int ``[L, E, E]`` co-activation counts of the step (used with
            ``config.dispatch == "hierarchical"``).
        step_loads_MLSE: the whole step's loads when ``loads_MLSE`` is a share of them: the
            guard's step window (:func:`~relibra_torch.planning.step_window.step_window_s`,
            computed at most once). ``None``: ``loads_MLSE`` where it is the whole step
            (``total_layers`` unset), else no step window.
        share_layers, step_placement_LE: the share's layers in the step and the whole step's
            placement (int64 ``[total_layers, E]``), with ``step_loads_MLSE``: whether another
            rank plans a layer of the step (``worth.guarded_plan``'s ``others_planned``).
    """
    check_loads(loads_MLSE, topology)
    if not isinstance(config, ReLibraConfig):
        raise TypeError(f"config is {type(config).__name__}; allowed: a ReLibraConfig (ReLibraConfig(**fields))")
    M, L = loads_MLSE.shape[:2]
    previous_placement_LE = (topology.static_placement(L) if previous_placement_LE is None
                             else check_previous_placement(previous_placement_LE, L, topology))
    if not (M and L) or topology.num_gpus == 1:  # nothing to plan (one GPU: nothing to balance or copy)
        return native_plan(loads_MLSE, topology, previous_placement_LE, ReLibraPlanner.name, previous_placement_LE)
    # the step's window, from the whole step's loads: these when they are the whole step
    step_loads_MLSE = loads_MLSE if step_loads_MLSE is None and total_layers is None else step_loads_MLSE
    step_window = None if step_loads_MLSE is None else StepWindow(step_loads_MLSE, topology, config)
    others_planned = None
    if step_loads_MLSE is not None and share_layers is not None and step_placement_LE is not None:
        others = sorted(set(range(step_loads_MLSE.shape[1])) - set(share_layers))
        others_planned = functools.cache(lambda: any_planned(step_loads_MLSE[:, others], topology,
                                                             step_placement_LE[others], config, total_layers,
                                                             step_window))
    guarded = None if config.choose else guarded_plan(  # choose weighs whole-step alternatives
        loads_MLSE, topology, previous_placement_LE, config, total_layers, lambda ls, cfg: _search(
            loads_MLSE[:, ls], topology, previous_placement_LE[ls], cfg, None if pairs_LEE is None else pairs_LEE[ls],
            fast=False), step_window, others_planned)
    if guarded is not None:  # the guard kept some layers and planned the others
        return guarded
    return _search(loads_MLSE, topology, previous_placement_LE, config, pairs_LEE,
                   fast=config.choose or plan_floor_s(topology, config) <= 0 or L == 0)


def _search(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
            config: ReLibraConfig, pairs_LEE: torch.Tensor | None, fast: bool) -> StepPlan:
    """:func:`relibra_plan`'s search on layers the guard did not keep. ``fast``: try the fast
    path first (its plan is the search's, sooner); not on layers the guard admitted (its
    gain bound and window pass the floor): the proof that nothing pays then held on 2 of 81
    such shares of ``benchmarks/never_behind.py`` and cost up to 30% of a failed search.
    Without replica slots the placement is then polished at the layer's exact price
    (:mod:`~relibra_torch.planning.polish`), on either path, where co-activation is not priced."""
    coloc_w = _coactivation_weight(config, pairs_LEE, topology.num_nodes, topology.gpus_per_node)
    plan = _searched(loads_MLSE, topology, previous_placement_LE, config, pairs_LEE, fast, coloc_w)
    if topology.replica_slots == 0 and config.reorder and not coloc_w:
        plan = polish_placement(plan, loads_MLSE, config)
    return plan


def _searched(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
              config: ReLibraConfig, pairs_LEE: torch.Tensor | None, fast: bool, coloc_w: float) -> StepPlan:
    """:func:`_search` before the polish."""
    plan = fast_plan(loads_MLSE, topology, previous_placement_LE, config, coloc_w) if fast else None
    if plan is not None:  # provably what the full search returns (planning/fastpath.py)
        return no_worse_than_keeping(plan, loads_MLSE, topology, previous_placement_LE, config, coloc_w)

    def plain(placement_LE: torch.Tensor, c: ReLibraConfig = config) -> StepPlan:  # no worse than keeping
        return no_worse_than_keeping(_plain_plan(loads_MLSE, topology, previous_placement_LE, placement_LE, c),
                                     loads_MLSE, topology, previous_placement_LE, c, coloc_w)
    if config.choose:  # relibra without traffic replicas reorders without their slots
        both = (reorder(loads_MLSE, topology, previous_placement_LE, config, pairs_LEE, also_without_traffic=True)
                if config.reorder else (previous_placement_LE.clone(),) * 2)
        chosen = chosen_plan(loads_MLSE, topology, previous_placement_LE, config, dict(zip((True, False), both)),
                             pairs_LEE, coloc_w)
        # the plain plans too (balancing's residency-aware choice is no candidate of the sequences)
        variants = ((both[0], {}), (both[0], {"balance": False}), (both[1], {"cross_node_replicas": False}))
        plains = [plain(placement_LE, dataclasses.replace(config, **off)) for placement_LE, off in variants]
        return cheapest_plan(chosen, plains, loads_MLSE, config)
    return plain(reorder(loads_MLSE, topology, previous_placement_LE, config, pairs_LEE) if config.reorder
                 else previous_placement_LE.clone())


class ReLibraPlanner(Planner):
    """Stateful wrapper: plans each step from the previous step's placement."""
    name = "relibra"
    host_token_splits = True  # its layer derives each micro-batch's exchange sizes on the host

    def __init__(self, topology: Topology, config: ReLibraConfig = ReLibraConfig()):
        super().__init__(topology)
        self.config = config

    @property
    def splits_layers(self) -> bool:
        """Every stage works per layer, so EP ranks can each plan a share (not with ``choose``: whole-step)."""
        return not self.config.choose

    @property
    def uses_coactivation(self) -> bool:
        """Whether :meth:`plan` takes the step's pair counts (hierarchical dispatch)."""
        return self.config.dispatch == "hierarchical" and self.config.reorder

    def finish(self, plan: StepPlan, loads_MLSE: torch.Tensor, split_MLSGJ: torch.Tensor | None = None,
               total_layers: int | None = None) -> StepPlan:
        return add_relays(plan, loads_MLSE, self.config, split_MLSGJ, total_layers)  # relays, from the hook's splits

    def plan(self, loads_MLSE: torch.Tensor, pairs_LEE: torch.Tensor | None = None) -> StepPlan:
        return relibra_plan(loads_MLSE, self.topology, self.previous_placement(loads_MLSE.shape[1]), self.config, pairs_LEE)

    def plan_layers(self, loads_MLSE: torch.Tensor, layers: list[int],
                    pairs_LEE: torch.Tensor | None = None) -> StepPlan:
        step_LE = self.previous_placement(loads_MLSE.shape[1])
        # every rank reads the whole step's loads (replay): the same step window on every rank
        return relibra_plan(loads_MLSE[:, layers], self.topology, step_LE[layers], self.config,
                            None if pairs_LEE is None else pairs_LEE[layers], loads_MLSE.shape[1], loads_MLSE,
                            list(layers), step_LE)
