"""Every micro-batch's layer plans and one rank's schedules of a step, built at once.

:meth:`relibra_torch.hook.ReplayBalancer.plan_step` calls :func:`rank_schedules` right after
planning, inside the window the planner hides in, and moves them to the layers' device, so
``install(m)`` only hands a micro-batch's schedules over; the simulator charges the same call.
Built one (micro-batch, layer) at a time (``check_layer_plan`` then ``build_rank_schedule``)
this took about 0.3 ms per pair on small shapes, most of the host work of a step at 16-64
tokens per GPU; here every tensor step runs once over all ``B = M * L`` pairs, and only the
final per-pair objects are made one by one. The result equals the one-pair path field for
field (``tests/test_schedule_batch.py``). The plan is validated once for the whole step
(``planning.plan.validate_plan`` with the loads: the same invariants ``check_layer_plan``
checks per pair, quotas summing to the loads included).

Legend: M micro-batches, L layers, B = M * L pairs, G GPUs (S source ranks = G), J slots
per GPU, X = G * J, E experts, El native experts per GPU, F fills of the rank in all pairs.
"""

from __future__ import annotations

import dataclasses

import torch

from ..planning.plan import StepPlan, token_split, validate_plan
from ..planning.residency import residencies, step_residency_micro_batches
from .native import NATIVE
from .schedule import LayerPlan, RankSchedule

__all__ = ["native_layers", "rank_schedules", "share_splits", "step_splits"]


def _owners(plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[M * L, G, J]`` owner GPU of every slot's expert (``-1`` empty), and bool
    ``[M * L, G, J]``: the slot holds an expert another GPU owns (a copy)."""
    M, L, G, J = plan.slot_expert_MLGJ.shape
    se_BGJ = plan.slot_expert_MLGJ.reshape(M * L, G, J)
    owner_BGJ = torch.where(se_BGJ >= 0, plan.owner_gpu_LE().repeat(M, 1).gather(
        1, se_BGJ.reshape(M * L, -1).clamp(min=0)).view(M * L, G, J), -1)
    return owner_BGJ, (se_BGJ >= 0) & (owner_BGJ != torch.arange(G).view(1, G, 1))


def native_layers(plan: StepPlan, loads_MLSE: torch.Tensor) -> torch.Tensor:
    """bool ``[L]``: the layers whose plan is the native one in every micro-batch (the
    layer then runs its native path, ``moe.native``): the placement is a permutation, every
    GPU's native slots hold its own experts by it, replica slots are empty, and every slot's
    quota is its expert's load (``loads_MLSE``: int ``[M, L, S, E]``)."""
    topo = plan.topology
    L = plan.num_layers
    G, J, E, El = topo.num_gpus, topo.slots_per_gpu, topo.num_experts, topo.experts_per_gpu
    M = plan.slot_expert_MLGJ.shape[0]
    if (tuple(plan.slot_expert_MLGJ.shape) != (M, L, G, J) or plan.slot_tokens_MLGJ.shape != plan.slot_expert_MLGJ.shape
            or tuple(plan.placement_LE.shape) != (L, E) or tuple(loads_MLSE.shape) != (M, L, G, E)
            or any(t.dtype != torch.int64 for t in (plan.placement_LE, plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ))):
        return torch.zeros(L, dtype=torch.bool)  # validate_plan names what is wrong
    perm_L = (plan.placement_LE.sort(1).values == torch.arange(E)).all(1)
    if not bool(perm_L.any()):
        return perm_L
    native_LX = plan.native_experts_LGl().reshape(L, G * El)
    se_MLGJ, st_MLGJ = plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ
    tokens_MLX = loads_MLSE.sum(2).to(torch.int64).gather(2, native_LX.expand(M, L, G * El))
    ok_ML = ((se_MLGJ[..., :El].reshape(M, L, G * El) == native_LX).all(-1) & (se_MLGJ[..., El:] < 0).flatten(2).all(-1)
             & (st_MLGJ[..., :El].reshape(M, L, G * El) == tokens_MLX).all(-1) & (st_MLGJ[..., El:] == 0).flatten(2).all(-1))
    return perm_L & ok_ML.all(0)


def step_splits(plan: StepPlan, loads_MLSE: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, L, S, G, J]``: ``planning.token_split`` of every micro-batch. Its rows are
    independent, so any share of the layers gives those layers' rows (the hook splits them
    over the EP ranks as it splits the planning). A native layer (:func:`native_layers`)
    sends every source's load of an expert to its one slot (a gather); the others take
    ``token_split``, in calls of about :data:`SPLIT_ROWS` rows where a slot holds a copy,
    else one call."""
    return share_splits(plan, loads_MLSE)[0]


def share_splits(plan: StepPlan, loads_MLSE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(step_splits(plan, loads_MLSE), native_layers(plan, loads_MLSE))``: the layers' native
    mask is per layer too, so the shares' masks joined are the step's, and
    :func:`rank_schedules` need not find them again."""
    native_L = native_layers(plan, loads_MLSE)
    return _splits(plan, loads_MLSE, native_L), native_L


def _splits(plan: StepPlan, loads_MLSE: torch.Tensor, native_L: torch.Tensor) -> torch.Tensor:
    """:func:`step_splits`, told the native layers."""
    M, L, G, J = plan.slot_expert_MLGJ.shape
    S = loads_MLSE.shape[2]
    if bool(native_L.all()):  # the idle step's common case: one gather, no index copies
        return _native_splits(plan.slot_expert_MLGJ, loads_MLSE).view(M, L, S, G, J)
    out = torch.zeros(M, L, S, G, J, dtype=torch.int64)
    nat, rest = native_L.nonzero().flatten(), (~native_L).nonzero().flatten()
    if nat.numel():
        out[:, nat] = _native_splits(plan.slot_expert_MLGJ[:, nat], loads_MLSE[:, nat]).view(M, len(nat), S, G, J)
    if rest.numel():
        sub, sub_loads = plan.layers(rest), loads_MLSE[:, rest]
        step = max(1, SPLIT_ROWS // len(rest)) if bool(_owners(sub)[1].any()) else M
        out[:, rest] = torch.cat([token_split(sub.micro_batches(m, m + step), sub_loads[m:m + step])
                                  for m in range(0, M, step)])
    return out


def _native_splits(slot_expert_MLGJ: torch.Tensor, loads_MLSE: torch.Tensor) -> torch.Tensor:
    """int64 ``[M, L, S, G * J]``: every source's load of each slot's expert (0 for an empty
    slot), the split of a native layer."""
    M, L, G, J = slot_expert_MLGJ.shape
    se_MLSX = slot_expert_MLGJ.reshape(M, L, 1, G * J)
    return (loads_MLSE.to(torch.int64).gather(3, se_MLSX.clamp(min=0).expand(M, L, loads_MLSE.shape[2], G * J))
            .masked_fill_(se_MLSX < 0, 0))


#: (micro-batch, layer) rows per ``token_split`` call for a plan with copies: its greedy
#: rounds run to the slowest row of a call, but each call has a fixed cost. Measured on this
#: machine (one thread): a split-planning share of 1-4 layers x 8 micro-batches in one call
#: 2-4x faster than per micro-batch (``switch-64/zipf/t32x8/2x8``: 1.1 against 4.6 ms); a
#: whole step of 48 layers per micro-batch 1.7x faster than in one call (91 against 150 ms).
SPLIT_ROWS = 32


def rank_schedules(plan: StepPlan, loads_MLSE: torch.Tensor, rank: int, split_MLSGJ: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", scheduled_L: torch.Tensor | None = None,
                   native_L: torch.Tensor | None = None) -> list[list[tuple[LayerPlan, RankSchedule | object]]]:
    """``[M][L]`` ``(layer plan, rank rank's schedule)`` of every micro-batch and layer of
    ``plan`` (``loads_MLSE``: int ``[M, L, S, E]``, the counts it was made from): what
    ``moe.schedule.layer_plans`` and ``build_rank_schedule`` give pair by pair, the
    schedules already on ``device`` (as ``RankSchedule.to`` puts them) with one copy per batch tensor for
    the whole step, so that installing a micro-batch copies nothing (a blocking copy to a
    GPU would wait for the work queued before it). ``split_MLSGJ``: :func:`step_splits` of
    the plan when already at hand.

    A native layer (:func:`native_layers`: every expert on its owner in every micro-batch)
    gets :data:`~relibra_torch.moe.native.NATIVE` instead of a schedule: the layer counts its
    exchange at run time, as static's layer does, and nothing is built for it here. The
    other layers are validated (``validate_plan``) and scheduled. ``scheduled_L``: bool
    ``[L]``, layers scheduled even where native (a layer with ``check_plan=False`` exchanges
    no counts at run time: the hook passes those). ``native_L``: bool ``[L]``,
    :func:`native_layers` of the plan when already at hand (:func:`share_splits`)."""
    if native_L is None:
        native_L = native_layers(plan, loads_MLSE)
    if split_MLSGJ is None:
        split_MLSGJ = _splits(plan, loads_MLSE, native_L)
    if scheduled_L is not None:
        native_L = native_L & ~scheduled_L.to(torch.bool)
    M, L = plan.num_micro_batches, plan.num_layers
    out: list[list] = [[None] * L for _ in range(M)]
    nat, rest = native_L.nonzero().flatten(), (~native_L).nonzero().flatten()
    if rest.numel():
        sub = plan if not nat.numel() else plan.layers(rest)
        sub_loads = loads_MLSE if not nat.numel() else loads_MLSE[:, rest]
        validate_plan(sub, sub_loads)
        built = _schedules(sub, rank, split_MLSGJ if not nat.numel() else split_MLSGJ[:, rest], device)
        for m in range(M):
            for i, l in enumerate(rest.tolist()):
                out[m][l] = built[m][i]
    if nat.numel():  # views in bulk (unbind): one indexing call per pair was most of this on small steps
        placements = plan.placement_LE.unbind(0)
        none_GJ = torch.full(plan.slot_expert_MLGJ.shape[2:], -1, dtype=torch.int64)  # no residency, no hub
        se_ML = [t.unbind(0) for t in plan.slot_expert_MLGJ.unbind(0)]
        split_ML = [t.unbind(0) for t in split_MLSGJ.unbind(0)]
        for l in nat.tolist():
            for m in range(M):
                out[m][l] = (LayerPlan(se_ML[m][l], split_ML[m][l], placements[l], plan.topology, m,
                                       none_GJ, none_GJ, none_GJ), NATIVE)
    if plan.relay_MLGg is not None:  # relays (planning.relay) ride on native and scheduled layers alike
        for m, l in plan.relay_MLGg.flatten(2).any(-1).nonzero().tolist():
            out[m][l] = (dataclasses.replace(out[m][l][0], relay_Gg=plan.relay_MLGg[m, l]), out[m][l][1])
    return out


def _schedules(plan: StepPlan, rank: int, split_MLSGJ: torch.Tensor,
               device: torch.device | str) -> list[list[tuple[LayerPlan, RankSchedule]]]:
    """:func:`rank_schedules` of a validated plan with its splits, every layer scheduled."""
    topo = plan.topology
    M, L, G, J = plan.slot_expert_MLGJ.shape
    E, El, X, B = topo.num_experts, topo.experts_per_gpu, G * J, M * L
    se_BGJ = plan.slot_expert_MLGJ.reshape(B, G, J)
    placement_BE = plan.placement_LE.repeat(M, 1)
    owner_BE, local_BE = placement_BE // El, placement_BE % El
    owner_BGJ, foreign_BGJ = _owners(plan)
    copies = bool(foreign_BGJ.any())
    sp_BSGJ = split_MLSGJ.reshape(B, G, G, J)
    if copies:   # residencies span micro-batches: computed once for the step
        res = residencies(plan)
        fill_mb_BGJ, return_mb_BGJ = (t.reshape(B, G, J) for t in step_residency_micro_batches(plan, res))
        hub_BGJ = res.hubs().reshape(B, G, J)
    else:   # no slot holds another GPU's expert: no residency, no hub
        fill_mb_BGJ = return_mb_BGJ = hub_BGJ = torch.full_like(se_BGJ, -1)

    # send side: slots by (expert, slot), empty first (planning.pair_slots.slot_quota_runs per row)
    se_BX = se_BGJ.reshape(B, X)
    send_BX = sp_BSGJ[:, rank].reshape(B, X)
    valid_BX = se_BX >= 0
    order_BX = torch.where(valid_BX, se_BX * X + torch.arange(X), -1).argsort(dim=1, stable=True)
    cum_end_BX = (send_BX * valid_BX).gather(1, order_BX).cumsum(1)
    expected_BE = torch.zeros(B, E, dtype=torch.int64).scatter_add_(1, se_BX.clamp(min=0), send_BX * valid_BX)

    # fills: slots holding an expert owned elsewhere that process tokens
    fill_BGJ = foreign_BGJ & (sp_BSGJ.sum(1) > 0)
    served = (fill_BGJ & (owner_BGJ == rank)).nonzero()                  # (pair, dest gpu, slot), row-major
    send_idx = local_BE[served[:, 0], se_BGJ[served[:, 0], served[:, 1], served[:, 2]]]
    fill_send_BG = torch.zeros(B, G, dtype=torch.int64).index_put_(
        (served[:, 0], served[:, 1]), torch.ones(len(served), dtype=torch.int64), accumulate=True)
    mine = fill_BGJ[:, rank].nonzero()                                    # (pair, slot)
    mine_owner = owner_BGJ[mine[:, 0], rank, mine[:, 1]]
    mine = mine[(mine[:, 0] * X + mine_owner * J + mine[:, 1]).argsort()]  # by pair, then (owner, slot)
    mine_owner = owner_BGJ[mine[:, 0], rank, mine[:, 1]]
    fill_recv_BG = torch.zeros(B, G, dtype=torch.int64).index_put_(
        (mine[:, 0], mine_owner), torch.ones(len(mine), dtype=torch.int64), accumulate=True)
    fills_B = torch.bincount(mine[:, 0], minlength=B)
    nth_F = torch.arange(len(mine)) - (fills_B.cumsum(0) - fills_B)[mine[:, 0]]   # index among the pair's fills

    # receive side: the local group of every slot of this GPU (natives, then fills in receive order)
    se_BJ = se_BGJ[:, rank]
    own_BJ = (se_BJ >= 0) & (owner_BE.gather(1, se_BJ.clamp(min=0)) == rank)
    group_BJ = torch.where(own_BJ, local_BE.gather(1, se_BJ.clamp(min=0)), 0)
    group_BJ[mine[:, 0], mine[:, 1]] = El + nth_F
    recv_BSJ = sp_BSGJ[:, :, rank]
    tokens_BJ = recv_BSJ.sum(1)
    own_counts_BE = torch.zeros(B, El + 1, dtype=torch.int64).scatter_(
        1, torch.where(own_BJ, group_BJ, El), torch.where(own_BJ, tokens_BJ, 0))[:, :El]
    fill_tokens_F = tokens_BJ[mine[:, 0], mine[:, 1]]
    fill_experts_F = se_BJ[mine[:, 0], mine[:, 1]]

    # per pair: views of the batch (unbind, one call per tensor) and slices of flat lists
    per = fills_B.tolist()
    ends = fills_B.cumsum(0)
    starts = (ends - fills_B).tolist()
    # each fill's cumulative rows within its pair (fills are sorted by pair)
    csum_F = torch.cat([fill_tokens_F.new_zeros(1), fill_tokens_F.cumsum(0)])
    fill_offsets_F = (csum_F[1:] - csum_F[(ends - fills_B)[mine[:, 0]]]).to(torch.int32)
    lists = [x.tolist() for x in (sp_BSGJ[:, rank].sum(-1), recv_BSJ.sum(-1), own_counts_BE, fill_send_BG,
                                  fill_recv_BG)]
    slots_F, tokens_F, experts_F = mine[:, 1].tolist(), fill_tokens_F.tolist(), fill_experts_F.tolist()
    any_fill_B = fill_BGJ.flatten(1).any(1).tolist()
    # the fields the forward indexes with (RankSchedule._DEVICE_FIELDS and each fill's [1] row
    # count) go to the device here, one copy per batch tensor for the whole step
    device = torch.device(device)
    order_BX, cum_end_BX, chunk_group_BX, chunk_count_BX, own_offsets_BE, send_idx, fill_offsets_F, counts_F = (
        _to(t, device) for t in (order_BX, cum_end_BX, group_BJ.unsqueeze(1).expand(B, G, J).reshape(B, X),
                                 recv_BSJ.reshape(B, X), own_counts_BE.cumsum(1).to(torch.int32), send_idx,
                                 fill_offsets_F, fill_tokens_F.to(torch.int32)))
    send_idx_B = torch.split(send_idx, torch.bincount(served[:, 0], minlength=B).tolist())
    fill_offsets_B = torch.split(fill_offsets_F, per)
    singles_F = counts_F.split(1)
    views = [t.unbind(0) for t in (se_BGJ, sp_BSGJ, fill_mb_BGJ, return_mb_BGJ, hub_BGJ, expected_BE, order_BX,
                                   cum_end_BX, chunk_group_BX, chunk_count_BX, tokens_BJ, own_offsets_BE,
                                   owner_BGJ, fill_BGJ, local_BE)]
    se, sp, fmb, rmb, hub, exp, order, cum, cgroup, ccount, tok, own_off, owner, active, local = views
    placements = plan.placement_LE.unbind(0)
    out: list[list[tuple[LayerPlan, RankSchedule]]] = []
    for m in range(M):
        row = []
        for l in range(L):
            b, a = m * L + l, starts[m * L + l]
            z = a + per[b]
            lp = LayerPlan(se[b], sp[b], placements[l], topo, m, fmb[b], rmb[b], hub[b])
            row.append((lp, RankSchedule(
                rank=rank, send_sizes=lists[0][b], recv_sizes=lists[1][b], expected_counts_E=exp[b],
                slot_order_X=order[b], slot_cum_end_X=cum[b], chunk_group_C=cgroup[b], chunk_count_C=ccount[b],
                own_counts=lists[2][b], fill_counts=tokens_F[a:z], slot_tokens_J=tok[b], any_fill=any_fill_B[b],
                fill_send_idx=send_idx_B[b], fill_send_sizes=lists[3][b], fill_recv_sizes=lists[4][b],
                fill_slots=slots_F[a:z], fill_experts=experts_F[a:z], own_offsets=own_off[b],
                fill_offsets=fill_offsets_B[b], slot_expert_GJ=se[b], owner_GJ=owner[b], active_GJ=active[b],
                fill_mb_GJ=fmb[b], return_mb_GJ=rmb[b], local_E=local[b], micro_batch=m,
                fill_single_offsets=list(singles_F[a:z]), hub_GJ=hub[b], device=device)))
        out.append(row)
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: for a GPU from pinned memory without blocking (a blocking copy
    would wait for the work queued before it); on the CPU, ``t`` itself."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)
