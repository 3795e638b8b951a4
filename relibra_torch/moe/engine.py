"""The execution engine shared by every relibra MoE layer.

:class:`ExpertEngine` owns what happens between routing and combine: the installed plan and
the rank's schedule derived from it, plan-driven or local execution (permute, exchange,
replica fills, grouped SwiGLU, reverse exchange, combine), the placement in force and
migration to a new one. It owns no parameters: each call is handed the expert weights (the
layer's ``w1_EFD``, ``w2_EDF``, ``w3_EFD``, plain tensors or DTensors in physical order) and
the layer's ``placement_E`` device buffer. :class:`~relibra_torch.moe.ReplayBalancedMoE` and
the torchtitan routed experts each hold one engine; :class:`EngineHost` gives both the same
public methods on top of it.

Legend: see ``docs/architecture.md``. Here T tokens, D model dim, F expert hidden dim,
E logical experts, K top-k, G EP ranks, S source ranks (= G), El = E / G native experts per
rank, R replica slots, J = El + R slots per rank, X = G * J destination slots, Rr rows
received by this rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import ops
from ..distributed.collectives import all_to_all_autograd
from ..distributed.hierarchical import (ExchangeCounts, flat_exchange_counts, hierarchical_combine,
                                        hierarchical_dispatch)
from ..distributed.relay import relay_combine, relay_dispatch
from ..distributed.mesh import EPGroup
from ..distributed.migration import move_expert_rows, native_experts
from ..distributed.replicas import FillSpec, ReplicaMemory, refetch_replica_ffn
from ..checks import check_choice
from ..planning.base import check_placement
from ..planning.pair_slots import DISPATCH_MODES
from ..planning.topology import Topology
from .counters import TransferCounts, count_dispatch, refetch_counter
from .native import NATIVE, NativeSchedules, gather_counts
from .plan_check import MISMATCH_MODES, PlanChecks
from .residents import ResidentReplicas
from .schedule import LayerPlan, RankSchedule, assign_slots, build_rank_schedule, check_layer_plan, group_permutation

__all__ = ["DISPATCH_MODES", "EXPERT_PARAMS", "MISMATCH_MODES", "ExpertEngine", "expert_ffn", "local_tensor"]

#: Names of the expert weights, torchtitan's layout: ``w1``/``w3`` ``[E, F, D]``, ``w2`` ``[E, D, F]``.
EXPERT_PARAMS = ("w1_EFD", "w2_EDF", "w3_EFD")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view sharing storage), or the tensor itself."""
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def expert_ffn(x_RD: torch.Tensor, w1_GFD: torch.Tensor, w2_GDF: torch.Tensor, w3_GFD: torch.Tensor,
               offsets_G: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts, group ``g`` = rows ``offsets[g-1]:offsets[g]`` with weight row ``g``.

    Weights are stored torchtitan-style; the ops take ``[G, in, out]``, i.e. transposed views
    (no copy). Computed in ``x_RD``'s dtype.
    """
    dt = x_RD.dtype
    return ops.expert_swiglu(x_RD, w1_GFD.to(dt).transpose(-2, -1), w2_GDF.to(dt).transpose(-2, -1),
                             w3_GFD.to(dt).transpose(-2, -1), offsets_G)


class ExpertEngine(PlanChecks):
    """Plan install, planned and local execution, placement and migration of one MoE layer.

    Args:
        topology: the layer's EP layout and slot counts.
        ep: the EP group the layer exchanges over (size 1, no group: one process).
        refetch_replicas: keep no replica buffers: fetch the weights in every micro-batch's
            forward and again in its backward (recomputing the replica rows' forward), and
            send the gradients home in every backward. Default (``False``): a replica is
            filled once per residency and its gradient sent home once (``moe.residents``).
        check_plan: check every planned forward that this rank's routed ids match the plan
            (and lie in ``[-1, E)``): one device-to-host copy of ``E + 2`` counts and one
            all-reduce of ``G`` flags per layer. Off: the caller vouches that the replay
            matches; a mismatch then sends rows by the plan's sizes regardless, which
            computes a wrong result or fails inside the exchange.
        on_mismatch: ``"degrade"`` (default): when any rank's routed ids disagree with the
            installed plan, every rank runs that forward on the current placement without
            replicas, with counts exchanged (correct, slower), warns once per process and
            records it; ``"raise"``: every rank raises ``ValueError``.
        replica_memory: replica-buffer tracker (one per layer unless shared).
        dispatch: ``"flat"`` (default: one row per token-expert pair, one all-to-all each
            way, Megatron's alltoall dispatcher) or ``"hierarchical"`` (DeepEP's normal mode:
            one row per (token, remote node), then per (token, GPU) inside the node;
            ``distributed/hierarchical.py``). Same results; only the exchange differs.

    State: ``placement_cpu`` (int64 ``[E]`` logical expert -> physical native slot), the
    installed :class:`LayerPlan` and this rank's :class:`RankSchedule`, and the counters of
    the last forward (``last_slot_tokens_J``, ``last_expert_tokens``, ``last_fills``,
    ``last_exchange``).
    """

    def __init__(self, topology: Topology, ep: EPGroup, *, refetch_replicas: bool = False,
                 check_plan: bool = True, on_mismatch: str = "degrade",
                 replica_memory: ReplicaMemory | None = None, dispatch: str = "flat"):
        if topology.num_gpus != ep.size:
            raise ValueError(f"topology has {topology.num_gpus} GPUs but the EP group has {ep.size} ranks")
        self.topology = topology
        self.ep = ep
        self.refetch_replicas = bool(refetch_replicas)
        self.check_plan = bool(check_plan)
        self.on_mismatch = check_choice("on_mismatch", on_mismatch, MISMATCH_MODES)
        self.dispatch = check_choice("dispatch", dispatch, DISPATCH_MODES)
        #: Rows and collectives of the last planned forward's token exchange (its backward's
        #: collectives included ahead of time); ``None`` before one, or without an EP group.
        self.last_exchange: ExchangeCounts | None = None
        #: Micro-batch indices (``LayerPlan.micro_batch``, ``-1`` when untagged) that ran
        #: degraded; the balancer hands every layer one shared set per step.
        self.degraded_micro_batches: set[int] = set()
        #: Forwards of this layer that ran degraded, since construction.
        self.degraded_forwards = 0
        self.replica_memory = replica_memory if replica_memory is not None else ReplicaMemory()
        #: Kept replica buffers of the step's residencies (``refetch_replicas=False``).
        self.residents = ResidentReplicas(topology, ep.rank)
        #: What this layer sent, per micro-batch (``moe.counters``; reset by the balancer
        #: at every ``plan_step``).
        self.transfer_counts = TransferCounts()
        #: Collectives issued by ``apply_placement`` (migration), since construction.
        self.migration_collectives = 0
        self.placement_cpu = torch.arange(topology.num_experts)
        self.identity_placement = True
        self.plan: LayerPlan | None = None
        self._schedule: RankSchedule | None = None
        self._natives = NativeSchedules(topology, ep.rank)
        #: Expert rows (token-expert pairs) this GPU processed in the last forward, per slot
        #: ``[J]`` and in total (taken from the executed exchange).
        self.last_slot_tokens_J = torch.zeros(topology.slots_per_gpu, dtype=torch.int64)
        self.last_expert_tokens = 0
        #: ``(slot, logical expert)`` of every fill this GPU received in the last forward.
        self.last_fills: list[tuple[int, int]] = []
        #: Inference hooks (``None`` in training; set on every EP rank alike, see
        #: ``relibra_torch.inference``). ``runtime_planner(counts_SE) -> LayerPlan``: the plan
        #: of a forward run without an installed plan, from every rank's gathered int64 CPU
        #: ``[S, E]`` counts (default: the native placement, ``native_layer_plan``); with it,
        #: one process also runs planned.
        self.runtime_planner = None
        #: ``resident``: this GPU's own expert storage, an object with ``native_weights()``
        #: ``-> (w1, w2, w3)`` ``[El, ...]`` (physical rows) and ``replica_weights(slots,
        #: experts) -> (w1, w2, w3)`` ``[len(slots), ...]``. When set, the engine computes
        #: with these instead of the weights it is handed, and replica slots use their
        #: resident copies instead of fetching fills (no weight exchange).
        self.resident = None

    @property
    def num_experts(self) -> int:
        return self.topology.num_experts

    def native_experts(self) -> torch.Tensor:
        """int64 ``[El]``: logical expert at each local row of this rank's expert weights."""
        return native_experts(self.placement_cpu, self.topology.experts_per_gpu, self.ep.rank)

    # ------------------------------------------------------------------ plans

    def set_plan(self, plan: LayerPlan | None, device: torch.device, schedule: RankSchedule | None = None) -> None:
        """Install ``plan`` for the next forwards (``None``: native placement, no replicas).

        The plan stays installed until replaced (activation recomputation in backward reuses
        it). Raises ``ValueError`` for a plan of another topology or placement. ``schedule``:
        this rank's schedule of ``plan`` built ahead (``schedule_batch.rank_schedules``), used
        (not copied again when already on ``device``) only for this rank and the placement and
        topology in force; else the plan is checked and its schedule rebuilt. ``NATIVE``
        (``moe.native``): the plan keeps every expert on its owner (``schedule_batch.
        native_layers``), so the layer runs its native path, counts exchanged at run time as
        static's layer does; the plan is kept for its micro-batch index (checked like any plan
        when of another topology or placement). With ``check_plan=False`` the layer exchanges
        no counts, so a ``NATIVE`` plan is scheduled here instead.
        """
        if plan is None:
            self.residents.begin(None, "set_plan(None)")
            self.plan, self._schedule = None, None
            return
        if schedule is NATIVE:
            if (plan.topology != self.topology or plan.placement_E is None
                    or not torch.equal(plan.placement_E, self.placement_cpu)):
                check_layer_plan(plan, self.topology, self.placement_cpu)  # raises, naming the mismatch
            if self.check_plan:  # counts exchanged at run time, as static's layer does
                self.residents.begin(None, f"installing micro-batch {plan.micro_batch}'s native plan")
                self.plan, self._schedule = plan, None
                return
            schedule = None  # built below
        if (schedule is None or plan.placement_E is None or schedule.rank != self.ep.rank
                or plan.topology != self.topology or not torch.equal(plan.placement_E, self.placement_cpu)):
            plan = check_layer_plan(plan, self.topology, self.placement_cpu)
            schedule = build_rank_schedule(self.topology, self.placement_cpu, plan, self.ep.rank)
        if schedule.device != torch.device(device):  # a blocking copy waits for the stream
            schedule = schedule.to(device)
        self.residents.begin(schedule, f"installing micro-batch {plan.micro_batch}'s plan")
        self._schedule = schedule
        self.plan = plan

    # ------------------------------------------------------------------ execution

    def run(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, gates_TK: torch.Tensor,
            weights: Sequence[torch.Tensor], placement_E: torch.Tensor) -> torch.Tensor:
        """Routed-expert output ``[T, D]`` (fp32-combined, in ``x_TD``'s dtype).

        Args:
            x_TD: tokens; ids_TK: int64 expert ids; gates_TK: their gate weights.
            weights: the layer's ``(w1_EFD, w2_EDF, w3_EFD)`` in physical order.
            placement_E: the layer's placement on ``x_TD``'s device (same values as
                ``placement_cpu``; a buffer, so a local forward needs no host copy).
        """
        if self.resident is not None:
            weights = self.resident.native_weights()
        if self.ep.group is None and self.plan is None and self.runtime_planner is None:
            return self._run_local(x_TD, ids_TK, gates_TK, weights, placement_E)
        return self._run_planned(x_TD, ids_TK, gates_TK, weights)

    def _run_local(self, x_TD, ids_TK, gates_TK, weights, placement_E):
        """One process, no plan: every expert local, slots = physical expert rows."""
        E = self.num_experts
        slot_TK = ids_TK if self.identity_placement else placement_E[ids_TK.clamp(min=0)]
        # Pad pairs (id -1) go to a drop slot past the experts: their rows are never computed
        # (rows past the last group are zero) and their gates are zero.
        slot_TK = torch.where(ids_TK < 0, E, slot_TK)
        x_sorted_RD, row_of_TK, offsets_S = ops.permute(slot_TK, x_TD, E + 1)
        offsets_E = offsets_S[:E]
        y_RD = expert_ffn(x_sorted_RD, *[local_tensor(w) for w in weights], offsets_E)
        if not torch.compiler.is_compiling():
            # Kept on the device: reading the counters is the only sync.
            counts = torch.diff(offsets_E.to(torch.int64), prepend=offsets_E.new_zeros(1))
            self.last_slot_tokens_J = torch.cat([counts, counts.new_zeros(self.topology.replica_slots)])
            self.last_expert_tokens = self.last_slot_tokens_J.sum()  # stays on the device
            self.last_fills = []
        return ops.unpermute(y_RD, row_of_TK, gates_TK)

    @torch.compiler.disable
    def _run_planned(self, x_TD, ids_TK, gates_TK, weights):
        """Plan-driven execution with exchanges (graph break under ``torch.compile``)."""
        topo, ep = self.topology, self.ep
        device = x_TD.device
        J = topo.slots_per_gpu
        planned = sched = self._schedule
        count = self.transfer_counts.counter(None if self.plan is None else self.plan.micro_batch)
        degraded = self.degraded_forwards
        if sched is None:
            sched = self._native_schedule(ids_TK, device, count)
        elif self.check_plan and not self._plan_matches(*self._host_counts(ids_TK), sched, device, count,
                                                        ids_TK.shape[0]):
            sched = self._native_schedule(ids_TK, device, count)
        # relays (planning.relay) run as planned unless this forward degraded (every rank alike)
        relay = getattr(self.plan, "relay_Gg", None) if degraded == self.degraded_forwards else None
        if self.dispatch != "hierarchical" or ep.group is None:
            count_dispatch(sched, topo.gpus_per_node, ep.rank, count)  # hierarchical: by its exchange
        on_collective = (lambda: count("collectives", 1)) if ep.group is not None else None

        # (token, k) pairs -> destination slot g * J + j, by the token_split rule; pads go to
        # slot X (sorted last, never sent).
        X = topo.num_gpus * J
        dest_TK = assign_slots(ids_TK, sched)
        hier = self.dispatch == "hierarchical" and ep.group is not None
        if hier:  # one row per (token, node), then per (token, GPU); arrives as pairs
            relayed, back, x_ex, dest_ex, gates_ex = ExchangeCounts(), None, x_TD, dest_TK, gates_TK
            if relay is not None and bool(relay.any()):  # the tokens this rank exchanges after the relay
                x_ex, dest_ex, gates_ex, back = relay_dispatch(x_TD, dest_TK, gates_TK, relay, topo, ep.rank,
                                                               ep.group, relayed)
            hx = hierarchical_dispatch(x_ex, dest_ex, gates_ex, topo, ep.rank, ep.group, relayed)
            x_recv, perm = hx.x_PD, hx.group_permutation(sched.chunk_group_C[:J])
        else:
            x_sorted, row_of_TK, _ = ops.permute(dest_TK, x_TD, X + 1)
            n_send = sum(sched.send_sizes)
            x_send = x_sorted[:n_send] if x_sorted.shape[0] > n_send else x_sorted
            x_recv = all_to_all_autograd(x_send, sched.send_sizes, sched.recv_sizes, ep.group, on_collective)
            perm = group_permutation(sched, device)

        # Group the received rows: native experts first (local row order), then fills.
        x_grp = x_recv.index_select(0, perm)
        wl = tuple(local_tensor(w) for w in weights)
        n_own = sched.num_own_rows
        if sched.any_fill and self.resident is not None:
            # Resident replicas: no weight exchange on any rank (all ranks hold them alike).
            y_own = expert_ffn(x_grp[:n_own], *wl, sched.own_offsets)
            if sched.fill_slots:
                bufs = self.resident.replica_weights(sched.fill_slots, sched.fill_experts)
                y_own = torch.cat([y_own, expert_ffn(x_grp[n_own:], *bufs, sched.fill_offsets)])
            y_grp = y_own
        elif sched.any_fill and self.refetch_replicas:
            spec = FillSpec(sched.fill_send_idx, sched.fill_send_sizes, sched.fill_recv_sizes, ep.group)
            y_own = expert_ffn(x_grp[:n_own], *wl, sched.own_offsets)
            y_fill = refetch_replica_ffn(expert_ffn, x_grp[n_own:], sched.fill_offsets, spec,
                                         self.replica_memory, wl, refetch_counter(sched, topo.gpus_per_node, ep.rank, count))
            y_grp = torch.cat([y_own, y_fill])
        elif sched.any_fill or (planned is not None and self.residents.returns_at(planned)):
            # A plan of a step (micro_batch set) keeps replicas over its residencies; any
            # other forward is a residency of its own (fresh state: fill, then return).
            residents = (self.residents if sched.micro_batch is not None
                         else ResidentReplicas(self.topology, ep.rank))
            # degraded forward (sched is the native one): residencies whose last micro-batch
            # with tokens is this one still send their gradients home
            rsched = sched if sched.any_fill else planned.without_fills()
            x_grp, bufs = residents.buffers(x_grp, wl, rsched, ep.group, self.replica_memory, count)
            y_parts = [expert_ffn(x_grp[:n_own], *wl, sched.own_offsets)]
            start = n_own
            for i, rows in enumerate(rsched.fill_counts):  # one GEMM per kept replica
                y_parts.append(expert_ffn(x_grp[start:start + rows], *(b.unsqueeze(0) for b in bufs[i]),
                                          rsched.fill_single_offsets[i]))
                start += rows
            y_grp = torch.cat(y_parts)
        else:
            y_grp = expert_ffn(x_grp, *wl, sched.own_offsets)
        inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=device))
        y_recv = y_grp.index_select(0, inv)
        self.last_slot_tokens_J = sched.slot_tokens_J.clone()
        self.last_expert_tokens = int(x_recv.shape[0])
        self.last_fills = list(zip(sched.fill_slots, sched.fill_experts))
        if hier:
            self.last_exchange = hx.counts  # combine's collectives are added as it runs
            y_TD = hierarchical_combine(y_recv, hx).to(x_TD.dtype)
            if back is not None:
                y_TD = relay_combine(y_TD, back, hx.counts)
            c = hx.counts  # rows and collectives (backward ones counted when recorded) of both stages
            count("cross_node_rows", c.cross_node_rows)
            count("intra_node_rows", c.intra_node_rows + c.relay_rows)
            count("collectives", c.collectives_forward + c.collectives_backward)
            return y_TD
        y_send = all_to_all_autograd(y_recv, sched.recv_sizes, sched.send_sizes, ep.group, on_collective)
        if x_sorted.shape[0] > n_send:  # pad rows: zero output (their gates are zero too)
            y_send = torch.cat([y_send, y_send.new_zeros(x_sorted.shape[0] - n_send, y_send.shape[1])])
        if ep.group is not None:
            self.last_exchange = flat_exchange_counts(topo, ep.rank, sched.send_sizes, sched.recv_sizes,
                                                      y_send.requires_grad)
        return ops.unpermute(y_send, row_of_TK, gates_TK)

    def _native_schedule(self, ids_TK: torch.Tensor, device: torch.device, count=None) -> RankSchedule:
        """No usable plan, or a native one (``set_plan(plan, device, NATIVE)``): gather every rank's counts (one
        all-gather, one copy to the host; ids outside ``[-1, E)`` raise on every rank) and run
        the native placement (or the ``runtime_planner``'s plan for those counts)."""
        rows_SE = gather_counts(ids_TK, self.num_experts, self.ep.group, self.ep.size)
        if self.ep.group is not None and count is not None:
            count("collectives", 1)
        if rows_SE[:, -1].any():
            self._raise_bad_ids(rows_SE[:, -1] > 0)
        native_plan = self.plan is not None and self._schedule is None  # NATIVE installed
        if native_plan and self.check_plan:
            self._native_matches(rows_SE[:, :-1])
        if self.runtime_planner is None or native_plan:  # the installed plan, not a run-time one
            return self._natives.schedule(self.placement_cpu, rows_SE[:, :-1], device)
        plan = check_layer_plan(self.runtime_planner(rows_SE[:, :-1]), self.topology, self.placement_cpu)
        return build_rank_schedule(self.topology, self.placement_cpu, plan, self.ep.rank).to(device)

    # ------------------------------------------------------------------ placement

    @torch.no_grad()
    def apply_placement(self, new_placement_E: torch.Tensor, params: Sequence[torch.Tensor],
                        placement_E: torch.Tensor, optimizer: torch.optim.Optimizer | None = None) -> int:
        """Move expert rows (weights, gradients, optimizer state) to ``new_placement_E``.

        Every rank of the EP group must call it with the same placement (between optimizer
        steps). Optimizer state tensors shaped like an expert parameter (Adam/AdamW
        ``exp_avg``, ``exp_avg_sq``, ...) move with it; scalar state (``step``) stays. The
        installed plan is dropped (it was made for the old placement).

        Args:
            new_placement_E: int ``[E]`` permutation, logical expert -> physical native slot.
            params: the layer's expert parameters (``EXPERT_PARAMS`` order).
            placement_E: the layer's device placement buffer, updated in place.
            optimizer: the optimizer holding these parameters, if any.

        Returns:
            the number of experts whose owner GPU changed.
        """
        new = check_placement(new_placement_E, self.num_experts, "new_placement_E")
        self.residents.begin(None, "apply_placement")  # a step boundary: replicas end here
        old = self.placement_cpu
        El = self.topology.experts_per_gpu
        if torch.equal(new, old):
            return 0
        moved = int((old // El != new // El).sum())
        for p in params:
            tensors = [p] + ([p.grad] if p.grad is not None else [])
            if optimizer is not None:
                for v in optimizer.state.get(p, {}).values():
                    if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(p.shape) and v.dim() > 0:
                        tensors.append(v)
            for t in tensors:
                local = local_tensor(t)
                local.copy_(move_expert_rows(local, old, new, self.ep.rank, self.ep.group))
                self.migration_collectives += int(self.ep.group is not None)
        self.set_placement(new, placement_E)
        return moved

    def set_placement(self, placement_E_cpu: torch.Tensor, placement_E: torch.Tensor) -> None:
        """Record ``placement_E_cpu`` as in force (no data moves); drops the installed plan
        and ends the step's replica residencies."""
        self.residents.begin(None, "changing the placement")
        self.placement_cpu = placement_E_cpu.clone()
        placement_E.copy_(placement_E_cpu.to(placement_E.device))
        self.identity_placement = bool(torch.equal(placement_E_cpu, torch.arange(self.num_experts)))
        self.plan, self._schedule = None, None
