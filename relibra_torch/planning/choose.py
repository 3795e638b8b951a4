"""Never worse than its own alternatives: relibra prices the replica sets its mechanisms can
produce and keeps the cheapest.

Candidates, all under the step's placement (each mechanism switched off in
:class:`~relibra_torch.planning.relibra.ReLibraConfig` drops the ones that use it):

* ``none``: every expert on its owner only;
* ``traffic``: cross-node traffic replicas only (:mod:`relibra_torch.planning.traffic`);
* ``balance``: balancing replication only (:mod:`relibra_torch.planning.balance`);
* ``both``: traffic replicas, then balancing (relibra's plan before this module);
* ``step``: the step-long traffic set of every (layer, node), then balancing.

Each candidate is a complete, valid set of slots per (micro-batch, layer) (every expert's
load on its instances), so any per-(micro-batch, layer) mix of them is a valid plan. Its
price (:mod:`relibra_torch.planning.price`) is compute + all-to-all per (micro-batch, layer)
plus fills; a fill is charged once per residency, so what a slot costs at ``m`` depends on
what it held at ``m - 1``, i.e. on the candidate chosen there. Per layer, the cheapest
sequence of candidates over the step is then a shortest path over ``M`` stages of ``C``
states (Viterbi): ``V[m, c] = moe[m, c] + min_c' (V[m - 1, c'] + fill[m, c' -> c])``. It is
exact for the planner's price, so the chosen sequence is never priced above any single
candidate's (the ``none`` sequence included). Ties go to the earlier candidate, ``none``
first.

Legend: C candidates, M micro-batches, L layers, S source ranks, E experts, G GPUs,
J slots per GPU, El native experts per GPU.
"""

from __future__ import annotations

import torch

from .balance import replicate
from .plan import StepPlan
from .price import fill_seconds_ML, migration_seconds_L, moe_seconds_ML
from .reorder_traffic import colocated_pairs
from .topology import Topology
from .traffic import traffic_replicas

__all__ = ["candidate_sets", "choose_sequence", "chosen_plan", "native_slots"]

_NEVER = torch.iinfo(torch.int64).max
_ROWS = 128  # (candidate, micro-batch, layer) rows priced per token split: bounds its memory


def native_slots(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_expert_MLGJ, slot_tokens_MLGJ)`` with every expert on its owner only."""
    M, L, _, E = loads_MLSE.shape
    G, El, R = topology.num_gpus, topology.experts_per_gpu, topology.replica_slots
    inverse_LE = torch.empty_like(placement_LE).scatter_(1, placement_LE, torch.arange(E).expand(L, E))
    native_MLGl = inverse_LE.view(1, L, G, El).expand(M, L, G, El)
    tokens_MLGl = loads_MLSE.to(torch.int64).sum(2).gather(2, native_MLGl.reshape(M, L, G * El)).view(M, L, G, El)
    se = torch.cat([native_MLGl, torch.full((M, L, G, R), -1, dtype=torch.int64)], -1)
    st = torch.cat([tokens_MLGl, torch.zeros(M, L, G, R, dtype=torch.int64)], -1)
    return se.contiguous(), st.contiguous()


def candidate_sets(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, config
                   ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``[(name, slot_expert_MLGJ, slot_tokens_MLGJ), ...]``, ``none`` first (module docstring)."""
    R, g, N = topology.replica_slots, topology.gpus_per_node, topology.num_nodes
    out = [("none", *native_slots(loads_MLSE, topology, placement_LE))]
    if not R:
        return out
    mt = config.min_replica_tokens if config.balance else _NEVER
    mct = config.min_cross_replica_tokens if config.balance else _NEVER
    traffic = config.cross_node_replicas and N > 1
    if traffic:
        best, step = traffic_replicas(loads_MLSE, topology, placement_LE, R // 2, config.cross_node_s_per_token / g,
                                      config.cross_replica_fill_s_per_expert, also_step=True)
        if bool((best[0] >= 0).any()):
            out.append(("traffic", *replicate(loads_MLSE, topology, placement_LE, _NEVER, best, _NEVER)))
    if config.balance:
        out.append(("balance", *replicate(loads_MLSE, topology, placement_LE, mt, None, mct)))
    if traffic and bool((best[0] >= 0).any()):
        if config.balance:
            out.append(("both", *replicate(loads_MLSE, topology, placement_LE, mt, best, mct)))
        if bool((step[0] >= 0).any()) and not torch.equal(step[0], best[0]):
            out.append(("step", *replicate(loads_MLSE, topology, placement_LE, mt, step, mct)))
    # a candidate equal to an earlier one adds nothing but pricing time
    unique: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for name, se, st in out:
        if not any(torch.equal(se, u[1]) and torch.equal(st, u[2]) for u in unique):
            unique.append((name, se, st))
    return unique


def choose_sequence(candidates: list[tuple[str, torch.Tensor, torch.Tensor]], placement_LE: torch.Tensor,
                    loads_MLSE: torch.Tensor, topology: Topology, config
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The cheapest per-layer sequence of candidates (module docstring).

    Returns:
        ``(slot_expert_MLGJ, slot_tokens_MLGJ, choice_ML, priced_L)``: the chosen slots, the
        index of the candidate chosen per (micro-batch, layer), and float64 ``[L]`` the
        price of each layer's chosen sequence (compute + all-to-all + fills over the step).
    """
    C = len(candidates)
    M, L, G, J = candidates[0][1].shape
    se_CMLGJ = torch.stack([c[1] for c in candidates])
    st_CMLGJ = torch.stack([c[2] for c in candidates])
    # Compute and all-to-all per (candidate, micro-batch, layer); a row equal to an earlier
    # candidate's at the same (m, l) takes its price (most rows, where no copy is made).
    first_CML = torch.arange(C).view(C, 1, 1).expand(C, M, L).clone()
    for c in range(1, C):
        for cp in range(c):
            same = ((se_CMLGJ[c] == se_CMLGJ[cp]) & (st_CMLGJ[c] == st_CMLGJ[cp])).flatten(2).all(-1)
            first_CML[c] = torch.where(same & (first_CML[c] == c), cp, first_CML[c])
    own = first_CML == torch.arange(C).view(C, 1, 1)
    c_R, m_R, l_R = own.nonzero(as_tuple=True)
    price_R = torch.empty(c_R.numel(), dtype=torch.float64)
    for a in range(0, c_R.numel(), _ROWS):  # rows priced as the layers of one micro-batch
        c_, m_, l_ = c_R[a:a + _ROWS], m_R[a:a + _ROWS], l_R[a:a + _ROWS]
        rows = StepPlan(topology, placement_LE[l_], se_CMLGJ[c_, m_, l_].unsqueeze(0),
                        st_CMLGJ[c_, m_, l_].unsqueeze(0), "relibra")
        price_R[a:a + _ROWS] = moe_seconds_ML(rows, loads_MLSE[m_, l_].unsqueeze(0), config)[0]
    priced_CML = torch.zeros(C, M, L, dtype=torch.float64)
    priced_CML[c_R, m_R, l_R] = price_R
    moe_MCL = priced_CML.gather(0, first_CML).permute(1, 0, 2)
    se_all = se_CMLGJ.permute(1, 0, 2, 3, 4).reshape(M, C * L, G, J)
    place_all = placement_LE.repeat(C, 1)
    owner_all = place_all // topology.experts_per_gpu
    # fill[m, c', c]: fills of candidate c at m after candidate c' at m - 1
    fill_MPCL = torch.empty(M, C, C, L, dtype=torch.float64)
    for cp in range(C):
        before = torch.cat([torch.full_like(se_CMLGJ[cp, :1], -2), se_CMLGJ[cp, :-1]]).repeat(1, C, 1, 1)
        fill_MPCL[:, cp] = fill_seconds_ML(se_all, before, owner_all, topology, config).view(M, C, L)
    value_CL = moe_MCL[0] + fill_MPCL[0, 0]      # m = 0: every slot starts empty (before = -2)
    back_MCL = torch.zeros(M, C, L, dtype=torch.int64)
    for m in range(1, M):
        via_PCL = value_CL.unsqueeze(1) + fill_MPCL[m]        # [c', c, L]
        best_CL, arg_CL = via_PCL.min(0)                      # first minimum: earlier c' on ties
        back_MCL[m] = arg_CL
        value_CL = moe_MCL[m] + best_CL
    priced_L, last_L = value_CL.min(0)
    choice_ML = torch.empty(M, L, dtype=torch.int64)
    choice_ML[M - 1] = last_L
    for m in range(M - 1, 0, -1):
        choice_ML[m - 1] = back_MCL[m].gather(0, choice_ML[m].unsqueeze(0)).squeeze(0)
    pick = choice_ML.view(1, M, L, 1, 1).expand(1, M, L, G, J)
    return se_CMLGJ.gather(0, pick)[0], st_CMLGJ.gather(0, pick)[0], choice_ML, priced_L


def chosen_plan(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                previous_placement_LE: torch.Tensor, config, pairs_LEE: torch.Tensor | None = None,
                coloc_w: float = 0.0) -> StepPlan:
    """The cheapest sequence of candidates under the new placement, or, per layer, the
    previous placement without copies when that prices lower (the layer's migration priced
    as if it moved alone, at least its share of the cost model's joint move), so no
    mechanism makes the step slower than leaving it out; layers decide alone, so any subset
    of layers plans as in the full plan.

    ``coloc_w``: seconds one co-located co-activated pair saves under hierarchical dispatch
    (0: not priced); with the step's ``pairs_LEE`` the crossings the move saves that way,
    which the count-level price cannot see, are credited to it.
    """
    candidates = candidate_sets(loads_MLSE, topology, placement_LE, config)
    # slots reordered inside a GPU move nothing: keeping the previous placement is then the
    # ``none`` candidate itself
    El = topology.experts_per_gpu
    moved_L = (placement_LE // El != previous_placement_LE // El).any(1)
    if len(candidates) == 1 and not bool(moved_L.any()):  # nothing to choose between: no pricing
        return StepPlan(topology, placement_LE, candidates[0][1], candidates[0][2], "relibra",
                        previous_placement_LE.clone())
    se, st, _, priced_L = choose_sequence(candidates, placement_LE, loads_MLSE, topology, config)
    if bool(moved_L.any()):
        moved = moved_L.nonzero().squeeze(1)
        new_L = priced_L[moved] + migration_seconds_L(placement_LE[moved], previous_placement_LE[moved],
                                                      topology, config)
        if coloc_w and pairs_LEE is not None:
            N, per_node = topology.num_nodes, topology.experts_per_node
            pairs = pairs_LEE[moved].to(torch.int64)
            gained = (colocated_pairs(pairs, placement_LE[moved] // per_node, N)
                      - colocated_pairs(pairs, previous_placement_LE[moved] // per_node, N))
            new_L = new_L - coloc_w * gained.to(torch.float64)
        prev = previous_placement_LE[moved]
        keep_se, keep_st = native_slots(loads_MLSE[:, moved], topology, prev)
        keep = StepPlan(topology, prev, keep_se, keep_st, "relibra")
        revert = moved[moe_seconds_ML(keep, loads_MLSE[:, moved], config).sum(0) <= new_L]
        if revert.numel():
            placement_LE = placement_LE.clone()
            placement_LE[revert] = previous_placement_LE[revert]
            back_se, back_st = native_slots(loads_MLSE[:, revert], topology, previous_placement_LE[revert])
            se, st = se.clone(), st.clone()
            se[:, revert], st[:, revert] = back_se, back_st
    return StepPlan(topology, placement_LE, se, st, "relibra", previous_placement_LE.clone())
