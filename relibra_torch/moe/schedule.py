"""What one EP rank does in one MoE layer for one micro-batch, derived on the host.

Legend (shape suffixes):
    E logical experts, G EP ranks (node-major), S source ranks (= G), J = El + R slots per
    GPU (El native, R replica), X = G * J destination slots, C = S * J received chunks,
    Fs fills this rank serves (sends weights for), Fr fills this rank receives, M
    micro-batches, L layers.

A :class:`LayerPlan` is the per-layer, per-micro-batch slice of a
:class:`~relibra_torch.planning.StepPlan` plus its token split. Every rank holds the same
plan and turns it into a :class:`RankSchedule` without talking to the others: the sizes
of every exchange follow from the plan.

Local expert groups. A rank computes its experts as two grouped GEMMs: first one group
per *native* expert (local parameter row ``i`` in ``[0, El)``; a native expert that sits
in no slot of this GPU gets an empty group), then one group per *fill* (a slot holding an
expert this GPU does not own, its weights received from the owner), in receive order
(owner rank, then slot). A slot that holds an expert its GPU owns, replica slot or not,
uses the local parameter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..planning.base import check_placement
from ..planning.pair_slots import assign_pair_slots, slot_quota_runs
from ..planning.plan import StepPlan, token_split
from ..planning.relay import check_relays
from ..planning.residency import Residencies, residencies, residency_micro_batches
from ..planning.topology import Topology

__all__ = ["LayerPlan", "RankSchedule", "assign_slots", "build_rank_schedule", "check_layer_plan", "fill_exchange",
           "group_permutation", "layer_plans", "native_layer_plan"]


@dataclass(frozen=True)
class LayerPlan:
    """What one MoE layer executes for one micro-batch (the same object on every rank).

    Attributes:
        slot_expert_GJ: int64 ``[G, J]`` logical expert in each slot, ``-1`` empty.
        split_SGJ: int64 ``[S, G, J]`` token-expert pairs source rank ``s`` sends to slot
            ``(g, j)`` (``token_split`` of the plan; row ``s`` is rank ``s``'s send sizes,
            column ``[:, g]`` rank ``g``'s receive sizes).
        placement_E: optional int64 ``[E]`` placement the plan was made for; when given,
            the layer checks that it is the placement in force.
        topology: optional topology the plan was made for; when given, the layer checks
            that it is its own (shapes alone cannot tell 1 x 4 GPUs from 2 x 2).
        micro_batch: optional index of the micro-batch in its step plan; a layer that has to
            degrade (routing that does not match the plan) reports it under this index.
        fill_mb_GJ / return_mb_GJ: optional int64 ``[G, J]`` replica residencies
            (``planning.residency``): the micro-batch whose forward fills the slot's residency
            and the one whose backward sends its gradient home (``-1``: not a fill slot, or a
            residency without tokens). Set by :func:`layer_plans` (with ``micro_batch``);
            without them every forward is a residency of its own (fill and return in the same
            micro-batch).
        hub_GJ: optional int64 ``[G, J]``: the flat slot ``gpu * J + j`` a second-hop
            residency fills from and reduces its gradient into over NVLink
            (``planning.two_hop``), ``-1`` for every other slot. Set by :func:`layer_plans`;
            ``None``: every fill comes from its owner.
        relay_Gg: optional int64 ``[G, g]``: tokens EP rank ``q`` hands to the GPU of its node
            with local index ``p`` before a hierarchical exchange (``planning.relay``).
    """

    slot_expert_GJ: torch.Tensor
    split_SGJ: torch.Tensor
    placement_E: torch.Tensor | None = None
    topology: Topology | None = None
    micro_batch: int | None = None
    fill_mb_GJ: torch.Tensor | None = None
    return_mb_GJ: torch.Tensor | None = None
    hub_GJ: torch.Tensor | None = None
    relay_Gg: torch.Tensor | None = None


def layer_plans(plan: StepPlan, loads_MLSE: torch.Tensor, micro_batch: int,
                res: Residencies | None = None) -> list[LayerPlan]:
    """Per-layer :class:`LayerPlan` objects of micro-batch ``micro_batch`` of ``plan``.

    Computes :func:`~relibra_torch.planning.token_split` once for all layers.

    Args:
        plan: the step plan (``M`` micro-batches, ``L`` layers).
        loads_MLSE: int ``[M, L, S, E]`` the counts the plan was made from.
        micro_batch: ``m`` in ``[0, M)``.
        res: ``residencies(plan)`` when already computed (it spans the whole step, so the
            caller computes it once for all ``M`` micro-batches).

    Returns:
        ``L`` layer plans, in layer order.
    """
    M = plan.num_micro_batches
    if not 0 <= micro_batch < M:
        raise ValueError(f"micro_batch={micro_batch} is outside the plan's [0, {M})")
    if loads_MLSE.dim() != 4 or loads_MLSE.shape[0] != M:
        raise ValueError(f"loads_MLSE has shape {tuple(loads_MLSE.shape)}, expected [{M}, L, S, E]")
    split_LSGJ = token_split(plan.micro_batch(micro_batch),
                             loads_MLSE[micro_batch : micro_batch + 1])[0]
    res = residencies(plan) if res is None else res
    fill_mb_LGJ, return_mb_LGJ = residency_micro_batches(plan, micro_batch, res)
    hub_LGJ = res.hubs()[micro_batch]
    relay = plan.relay_MLGg
    return [LayerPlan(plan.slot_expert_MLGJ[micro_batch, l].clone(), split_LSGJ[l].clone(),
                      plan.placement_LE[l].clone(), plan.topology, micro_batch,
                      fill_mb_LGJ[l].clone(), return_mb_LGJ[l].clone(), hub_LGJ[l].clone(),
                      relay[micro_batch, l].clone() if relay is not None and relay[micro_batch, l].any() else None)
            for l in range(plan.num_layers)]


def check_layer_plan(layer_plan: object, topology: Topology,
                     placement_E: torch.Tensor | None = None) -> LayerPlan:
    """Validate ``layer_plan`` against the layer's topology; return it with CPU int64 tensors.

    Raises ``ValueError``/``TypeError`` naming the problem: wrong type, shapes of another
    topology (``G`` GPUs, ``J`` slots), values out of range, two instances of one expert on
    one GPU, tokens on an empty slot, negative splits, a placement other than the one in
    force.
    """
    if not isinstance(layer_plan, LayerPlan):
        raise TypeError(f"plan must be a LayerPlan or None, got {type(layer_plan).__name__}")
    G, J, E = topology.num_gpus, topology.slots_per_gpu, topology.num_experts
    if layer_plan.topology is not None and layer_plan.topology != topology:
        raise ValueError(f"the plan is for another topology: {layer_plan.topology}, but this layer "
                         f"runs on {topology}")
    se, sp = layer_plan.slot_expert_GJ, layer_plan.split_SGJ
    for name, t in (("slot_expert_GJ", se), ("split_SGJ", sp)):
        if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"LayerPlan.{name} must be an integer torch.Tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if tuple(se.shape) != (G, J):
        raise ValueError(f"LayerPlan.slot_expert_GJ has shape {tuple(se.shape)}, but this layer's "
                         f"topology ({topology.num_nodes} nodes x {topology.gpus_per_node} GPUs, "
                         f"{topology.experts_per_gpu} native + {topology.replica_slots} replica "
                         f"slots) needs [{G}, {J}]: the plan is for another topology")
    if tuple(sp.shape) != (G, G, J):
        raise ValueError(f"LayerPlan.split_SGJ has shape {tuple(sp.shape)}, but this layer's "
                         f"topology needs [{G}, {G}, {J}]: the plan is for another topology")
    se = se.detach().to("cpu", torch.int64)
    sp = sp.detach().to("cpu", torch.int64)
    if (se < -1).any() or (se >= E).any():
        raise ValueError(f"LayerPlan.slot_expert_GJ has values outside [-1, {E - 1}]: {se.tolist()}")
    if (sp < 0).any():
        raise ValueError("LayerPlan.split_SGJ has negative token counts")
    if ((se < 0).unsqueeze(0) & (sp > 0)).any():
        raise ValueError("LayerPlan.split_SGJ sends tokens to an empty slot (slot_expert_GJ = -1)")
    s_sorted = se.sort(dim=1).values
    dup = (s_sorted[:, 1:] == s_sorted[:, :-1]) & (s_sorted[:, 1:] >= 0)
    if dup.any():
        g = int(dup.nonzero()[0, 0])
        raise ValueError(f"LayerPlan.slot_expert_GJ: GPU {g} holds two instances of one expert "
                         f"({se[g].tolist()})")
    pl = layer_plan.placement_E
    if pl is not None:
        pl = check_placement(pl, E, "LayerPlan.placement_E")
        if placement_E is not None and not torch.equal(pl, placement_E):
            raise ValueError(f"LayerPlan.placement_E {pl.tolist()} is not the layer's placement "
                             f"{placement_E.tolist()}: apply the step's placement "
                             f"(apply_placement) before installing its plans")
    res = []
    for name in ("fill_mb_GJ", "return_mb_GJ"):
        t = getattr(layer_plan, name)
        if t is not None:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (G, J):
                raise ValueError(f"LayerPlan.{name} must be an integer tensor [{G}, {J}] (or None), got "
                                 f"{getattr(t, 'shape', type(t).__name__)}")
            t = t.detach().to("cpu", torch.int64)
        res.append(t)
    if (res[0] is None) != (res[1] is None):
        raise ValueError("LayerPlan.fill_mb_GJ and return_mb_GJ come together (layer_plans sets both)")
    hub = layer_plan.hub_GJ
    if hub is not None:
        if not isinstance(hub, torch.Tensor) or tuple(hub.shape) != (G, J):
            raise ValueError(f"LayerPlan.hub_GJ must be an integer tensor [{G}, {J}] (or None), got "
                             f"{getattr(hub, 'shape', type(hub).__name__)}")
        hub = hub.detach().to("cpu", torch.int64)
        if ((hub < -1) | (hub >= G * J)).any():
            raise ValueError(f"LayerPlan.hub_GJ has values outside [-1, {G * J - 1}] (flat slots gpu * J + j)")
    relay = layer_plan.relay_Gg
    if relay is not None:
        relay = torch.as_tensor(relay).detach().to("cpu", torch.int64)
        check_relays(relay.view(1, 1, *relay.shape), (1, 1), topology)  # [G, g], >= 0, none to itself
    return LayerPlan(se, sp, pl, layer_plan.topology, layer_plan.micro_batch, *res, hub, relay)


def native_layer_plan(topology: Topology, placement_E: torch.Tensor,
                      counts_SE: torch.Tensor) -> LayerPlan:
    """Every expert on its owner only, replica slots empty.

    Args:
        placement_E: int64 ``[E]`` physical native slot of every logical expert.
        counts_SE: int ``[S, E]`` token-expert pairs of every source rank per expert.
    """
    G, J, El, E = topology.num_gpus, topology.slots_per_gpu, topology.experts_per_gpu, topology.num_experts
    native_E = torch.empty_like(placement_E)
    native_E[placement_E] = torch.arange(E)
    slot_expert_GJ = torch.full((G, J), -1, dtype=torch.int64)
    slot_expert_GJ[:, :El] = native_E.view(G, El)
    split_SGJ = torch.zeros(G, G, J, dtype=torch.int64)
    split_SGJ[:, :, :El] = counts_SE.to(torch.int64)[:, native_E].view(G, G, El)
    return LayerPlan(slot_expert_GJ, split_SGJ, placement_E.clone(), topology)


@dataclass
class RankSchedule:
    """Host-side execution data of one rank (see the module docstring for the groups).

    Attributes:
        rank: this EP rank.
        send_sizes / recv_sizes: ``[G]`` token rows sent to / received from every rank.
        expected_counts_E: int64 ``[E]`` token-expert pairs this rank must route per expert.
        slot_order_X: int64 ``[X]`` destination slots ``g * J + j`` sorted by (expert, slot).
        slot_cum_end_X: int64 ``[X]`` cumulative send counts in that order: the ``p``-th pair
            of this rank in (expert, token, k) order goes to ``slot_order_X[q]`` with ``q`` the
            first index whose end exceeds ``p``.
        chunk_group_C / chunk_count_C: int64 ``[C]`` local group and row count of every
            received chunk ``(s, j)`` (rows arrive source-major, then by slot).
        own_counts: ``[El]`` rows of every native expert's group.
        fill_counts: ``[Fr]`` rows of every fill group, in receive order.
        slot_tokens_J: int64 ``[J]`` rows every slot of this GPU processes.
        any_fill: some rank of the group receives weights (then every rank joins the fill).
        fill_send_idx: int64 ``[Fs]`` local native rows to send, ordered by (dest rank, slot).
        fill_send_sizes / fill_recv_sizes: ``[G]`` weight rows sent to / received from every rank.
        fill_slots / fill_experts: ``[Fr]`` slot and logical expert of every received fill.
        own_offsets / fill_offsets: int32 cumulative ends of the native / fill groups.
        fill_single_offsets: one int32 ``[1]`` tensor per fill (its row count): the
            per-slot GEMM of a kept replica.
        slot_expert_GJ / owner_GJ / active_GJ: every GPU's slots (host): expert, owner GPU
            (``-1`` empty), and whether it is a fill slot with tokens.
        fill_mb_GJ / return_mb_GJ: the residencies (see :class:`LayerPlan`; derived for a
            plan without them: this forward is the whole residency).
        local_E: int64 ``[E]`` local row of every expert at its owner.
        hub_GJ: int64 ``[G, J]`` second-hop hubs (see :class:`LayerPlan`; all ``-1``
            without them).

    The tensors the forward indexes with live on the layer's device after :meth:`to`;
    ``expected_counts_E`` and ``slot_tokens_J`` stay on the CPU (host-side checks and
    counters).
    """

    rank: int
    send_sizes: list[int]
    recv_sizes: list[int]
    expected_counts_E: torch.Tensor
    slot_order_X: torch.Tensor
    slot_cum_end_X: torch.Tensor
    chunk_group_C: torch.Tensor
    chunk_count_C: torch.Tensor
    own_counts: list[int]
    fill_counts: list[int]
    slot_tokens_J: torch.Tensor
    any_fill: bool
    fill_send_idx: torch.Tensor
    fill_send_sizes: list[int]
    fill_recv_sizes: list[int]
    fill_slots: list[int]
    fill_experts: list[int]
    own_offsets: torch.Tensor
    fill_offsets: torch.Tensor
    slot_expert_GJ: torch.Tensor
    owner_GJ: torch.Tensor
    active_GJ: torch.Tensor
    fill_mb_GJ: torch.Tensor
    return_mb_GJ: torch.Tensor
    local_E: torch.Tensor
    micro_batch: int | None = None
    fill_single_offsets: list = dataclasses.field(default_factory=list)
    hub_GJ: torch.Tensor | None = None
    device: torch.device | None = None  # where :meth:`to` put the index tensors (None: not moved)

    _DEVICE_FIELDS = ("slot_order_X", "slot_cum_end_X", "chunk_group_C", "chunk_count_C",
                      "fill_send_idx", "own_offsets", "fill_offsets")

    def to(self, device: torch.device | str) -> "RankSchedule":
        """A copy whose index tensors live on ``device`` (moved once per plan, not per call)."""
        moved = {f: getattr(self, f).to(device) for f in self._DEVICE_FIELDS}
        moved["device"] = torch.device(device)
        moved["fill_single_offsets"] = [torch.tensor([n], dtype=torch.int32, device=device)
                                        for n in self.fill_counts]
        return dataclasses.replace(self, **moved)

    def without_fills(self) -> "RankSchedule":
        """This schedule's residency data with no slot computed (a degraded forward)."""
        return dataclasses.replace(self, active_GJ=torch.zeros_like(self.active_GJ), fill_slots=[],
                                   fill_experts=[], fill_counts=[], fill_single_offsets=[], any_fill=False)

    @property
    def num_own_rows(self) -> int:
        return sum(self.own_counts)

    @property
    def num_recv_rows(self) -> int:
        return sum(self.recv_sizes)


def build_rank_schedule(topology: Topology, placement_E: torch.Tensor, layer_plan: LayerPlan,
                        rank: int) -> RankSchedule:
    """Turn a validated :class:`LayerPlan` into rank ``rank``'s :class:`RankSchedule`.

    Fills are executed only for slots that process at least one token (every rank sees the
    same split, so all agree on which weights move).
    """
    G, J, El, E = topology.num_gpus, topology.slots_per_gpu, topology.experts_per_gpu, topology.num_experts
    X = G * J
    se_GJ, sp_SGJ = layer_plan.slot_expert_GJ, layer_plan.split_SGJ
    owner_E = placement_E // El
    local_E = placement_E % El

    # Send side: destination slots sorted by (expert, slot), empty slots (-1) first.
    se_X = se_GJ.reshape(X)
    send_X = sp_SGJ[rank].reshape(X)
    slot_order_X, slot_cum_end_X = slot_quota_runs(se_X, send_X.unsqueeze(0))
    expected_counts_E = torch.zeros(E, dtype=torch.int64).scatter_add_(
        0, se_X.clamp(min=0), send_X * (se_X >= 0))

    # Fills: (gpu, slot) holding an expert owned elsewhere that processes tokens.
    tokens_GJ = sp_SGJ.sum(0)
    owner_GJ = torch.where(se_GJ >= 0, owner_E[se_GJ.clamp(min=0)], torch.full_like(se_GJ, -1))
    is_fill_GJ = (se_GJ >= 0) & (owner_GJ != torch.arange(G).unsqueeze(1)) & (tokens_GJ > 0)
    any_fill = bool(is_fill_GJ.any())
    fill_send_idx, fill_send_sizes, fill_recv_sizes, fill_slots_t = fill_exchange(
        is_fill_GJ, se_GJ, owner_GJ, local_E, rank)
    fill_slots = fill_slots_t.tolist()
    fill_experts = se_GJ[rank, fill_slots_t].tolist()
    if layer_plan.fill_mb_GJ is not None:
        fill_mb_GJ, return_mb_GJ = layer_plan.fill_mb_GJ, layer_plan.return_mb_GJ
    else:  # a plan without residencies: this forward fills and returns
        here = 0 if layer_plan.micro_batch is None else layer_plan.micro_batch
        fill_mb_GJ = torch.where(is_fill_GJ, here, -1)
        return_mb_GJ = fill_mb_GJ.clone()

    # Receive side: local group of every slot of this GPU.
    se_J = se_GJ[rank]
    group_J = torch.zeros(J, dtype=torch.int64)
    own_J = (se_J >= 0) & (owner_E[se_J.clamp(min=0)] == rank)
    group_J[own_J] = local_E[se_J[own_J]]
    group_J[fill_slots_t] = El + torch.arange(len(fill_slots))
    recv_SJ = sp_SGJ[:, rank]
    slot_tokens_J = recv_SJ.sum(0)
    own_counts = torch.zeros(El, dtype=torch.int64)
    own_counts[group_J[own_J]] = slot_tokens_J[own_J]
    # A slot that receives tokens must be computed: owned or filled. (Non-owned slots
    # with tokens are fills by construction, so nothing can be dropped here.)
    return RankSchedule(
        rank=rank,
        send_sizes=sp_SGJ[rank].sum(1).tolist(),
        recv_sizes=recv_SJ.sum(1).tolist(),
        expected_counts_E=expected_counts_E,
        slot_order_X=slot_order_X,
        slot_cum_end_X=slot_cum_end_X,
        chunk_group_C=group_J.expand(G, J).reshape(G * J).clone(),
        chunk_count_C=recv_SJ.reshape(G * J).clone(),
        own_counts=own_counts.tolist(),
        fill_counts=slot_tokens_J[fill_slots_t].tolist(),
        slot_tokens_J=slot_tokens_J,
        any_fill=any_fill,
        fill_send_idx=fill_send_idx,
        fill_send_sizes=fill_send_sizes,
        fill_recv_sizes=fill_recv_sizes,
        fill_slots=fill_slots,
        fill_experts=fill_experts,
        own_offsets=own_counts.cumsum(0).to(torch.int32),
        fill_offsets=slot_tokens_J[fill_slots_t].cumsum(0).to(torch.int32),
        slot_expert_GJ=se_GJ,
        owner_GJ=owner_GJ,
        active_GJ=is_fill_GJ,
        fill_mb_GJ=fill_mb_GJ,
        return_mb_GJ=return_mb_GJ,
        local_E=local_E,
        micro_batch=layer_plan.micro_batch,
        hub_GJ=(layer_plan.hub_GJ if layer_plan.hub_GJ is not None and layer_plan.fill_mb_GJ is not None
                else torch.full_like(se_GJ, -1)),
    )


def fill_exchange(mask_GJ: torch.Tensor, se_GJ: torch.Tensor, owner_GJ: torch.Tensor,
                  local_E: torch.Tensor, rank: int) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
    """The weight exchange that moves the experts of the slots in ``mask_GJ`` from their owners.

    Args:
        mask_GJ: bool ``[G, J]`` slots to fill (or whose gradients go home: the reverse).
        se_GJ / owner_GJ: int64 ``[G, J]`` expert and owner GPU of every slot.
        local_E: int64 ``[E]`` local row of every expert at its owner.

    Returns:
        ``(send_idx [Fs], send_sizes [G], recv_sizes [G], recv_slots [Fr])``: the local rows this
        rank sends (by destination GPU, then slot), and this rank's slots it receives, in the
        order the owners send them (owner, then slot).
    """
    G = mask_GJ.shape[0]
    J = mask_GJ.shape[1]
    served = (mask_GJ & (owner_GJ == rank)).nonzero()  # row-major: (dest gpu, slot)
    send_idx = local_E[se_GJ[served[:, 0], served[:, 1]]] if len(served) else torch.zeros(0, dtype=torch.int64)
    send_sizes = torch.bincount(served[:, 0], minlength=G).tolist() if len(served) else [0] * G
    mine_j = mask_GJ[rank].nonzero().flatten()
    mine_owner = owner_GJ[rank, mine_j]
    recv_slots = mine_j[(mine_owner * J + mine_j).argsort()]
    recv_sizes = torch.bincount(mine_owner, minlength=G).tolist() if len(mine_j) else [0] * G
    return send_idx, send_sizes, recv_sizes, recv_slots


def assign_slots(ids_TK: torch.Tensor, schedule: RankSchedule) -> torch.Tensor:
    """Destination slot ``g * J + j`` of every (token, k) pair of this rank, on ids' device.

    Follows the :func:`~relibra_torch.planning.token_split` rule: the pairs of expert ``e``,
    in flat ``t * K + k`` order, fill ``e``'s instances in slot order, each with its quota
    (:func:`relibra_torch.planning.pair_slots.assign_pair_slots`, the function the
    simulator's exact hierarchical count uses too).
    Requires this rank's counts to equal ``schedule.expected_counts_E``.

    Args:
        ids_TK: int64 ``[T, K]`` expert ids; ``-1`` is a pad (no expert).
    Returns:
        int64 ``[T, K]`` destination slots, ``X = G * J`` (one past the last slot) for pads.
    """
    return assign_pair_slots(ids_TK, schedule.slot_order_X, schedule.slot_cum_end_X,
                             int(schedule.expected_counts_E.numel()))


def group_permutation(schedule: RankSchedule, device: torch.device) -> torch.Tensor:
    """int64 ``[Rr]``: received row order -> grouped order (native groups, then fills).

    ``x_grouped = x_received[perm]``; stable, so inside a group rows stay source-major.
    """
    group_of_row = torch.repeat_interleave(schedule.chunk_group_C.to(device),
                                           schedule.chunk_count_C.to(device),
                                           output_size=schedule.num_recv_rows)
    return group_of_row.argsort(stable=True)
