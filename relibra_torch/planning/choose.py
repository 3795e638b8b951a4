"""Never worse than its own alternatives: relibra prices the plans its mechanisms can make
(:mod:`relibra_torch.planning.price`, the simulator's step cost in its units) and keeps
the cheapest (``ReLibraConfig.choose``).

**Candidates** under one placement (:func:`candidate_sets`), each a complete, valid set of
slots per (micro-batch, layer), so any per-(micro-batch, layer) mix of them is a valid plan:
``none`` (every expert on its owner only), ``traffic`` (cross-node traffic replicas,
:mod:`relibra_torch.planning.traffic`), ``balance`` (balancing copies,
:mod:`relibra_torch.planning.balance`), ``both`` (traffic, then balancing: relibra's plan
without ``choose``) and ``step`` (the step-long traffic set, then balancing). A replica
slot without tokens is emptied, so that a residency starts exactly where a slot's expert
changes (:func:`~relibra_torch.planning.price.window_seconds`).

**Cheapest sequence** per layer (:func:`cheapest_sequence`): a fill is paid once per
residency, so what a slot costs at ``m`` depends on the candidate at ``m - 1`` (and its
gradient return at ``m - 1`` on the one at ``m``); the step's price is a sum of
per-micro-batch and per-window terms, so the cheapest sequence is a shortest path over
``M`` stages of ``C`` states (Viterbi), exact for that price: never priced above any single
candidate's sequence, ``none``'s included. Ties go to the earlier candidate. The windows
see second hops (two-hop replicas) on their two micro-batches only, so that price is the
residencies' exactly with one micro-batch or without second hops, else an estimate.

**Whole-step alternatives** (:func:`chosen_plan`): for the mechanism subsets the config
enables (traffic replicas, balancing), the plan relibra with only that subset would make
(its placement: reordering with traffic slots iff it has traffic replicas; the cheapest
sequence over its candidates; per layer the previous placement without copies instead
where that prices lower, migration priced per layer), the same in every layer, and the
previous placement without copies. The cheapest, priced exactly (every residency with
its hub, ``price.replica_seconds_ML``; migration of all layers at once), is the plan. Each alternative is computed exactly as relibra configured with
only that subset computes it, so relibra's step is priced at most every ablation's
(traffic replicas off, balancing off, both off), every single candidate's sequence under
its placement (where the windows are exact), and keeping the previous placement (from static placement: static's step),
in the simulator's units (``tests/test_relibra_choose.py``). Static placement is not an
alternative elsewhere: moving back to it costs static's step plus a migration.

Legend: C candidates, M micro-batches, L layers, S source ranks, E experts, G GPUs,
J slots per GPU, El native experts per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .balance import replicate
from .plan import StepPlan
from .price import (compute_seconds_ML, exchange_latency_s, migration_seconds, migration_seconds_L, moe_parts_ML,
                    replica_seconds_ML, step_seconds, window_seconds)
from .reorder_traffic import colocated_pairs
from .topology import Topology
from .traffic import traffic_replicas
from .fill_spread import spread_args

__all__ = ["Group", "candidate_sets", "cheapest_sequence", "chosen_plan", "native_slots", "price_groups"]

_NEVER = torch.iinfo(torch.int64).max
_ROWS = 128  # (candidate, micro-batch, layer) rows priced per token split: bounds its memory
#: candidate names each mechanism subset may use (the ablation relibra with only those)
SUBSET_NAMES = {("traffic", "balance"): ("none", "traffic", "balance", "both", "step"),
                ("traffic",): ("none", "traffic"), ("balance",): ("none", "balance"), (): ("none",)}


def native_slots(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                 load_MLE: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_expert_MLGJ, slot_tokens_MLGJ)`` with every expert on its owner only
    (``load_MLE``: ``loads_MLSE`` summed over sources, when the caller has it)."""
    M, L, _, E = loads_MLSE.shape
    G, El, R = topology.num_gpus, topology.experts_per_gpu, topology.replica_slots
    inverse_LE = torch.empty_like(placement_LE).scatter_(1, placement_LE, torch.arange(E).expand(L, E))
    native_MLGl = inverse_LE.view(1, L, G, El).expand(M, L, G, El)
    load_MLE = loads_MLSE.to(torch.int64).sum(2) if load_MLE is None else load_MLE
    tokens_MLGl = load_MLE.gather(2, native_MLGl.reshape(M, L, G * El)).view(M, L, G, El)
    se = torch.cat([native_MLGl, torch.full((M, L, G, R), -1, dtype=torch.int64)], -1)
    st = torch.cat([tokens_MLGl, torch.zeros(M, L, G, R, dtype=torch.int64)], -1)
    return se.contiguous(), st.contiguous()


def _emptied(se: torch.Tensor, st: torch.Tensor, El: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica slots without tokens hold nothing (a residency then starts where the slot's
    expert changes; an empty slot costs nothing)."""
    idle = (st == 0) & (torch.arange(se.shape[-1]) >= El)
    return se.masked_fill(idle, -1), st


def candidate_sets(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, config,
                   traffic: bool, balance: bool) -> tuple[list[tuple[str, torch.Tensor, torch.Tensor]], dict]:
    """``([(name, slot_expert_MLGJ, slot_tokens_MLGJ), ...], alias)``: ``none`` first, then
    the candidates ``traffic`` and ``balance`` allow (module docstring); a candidate equal to
    an earlier one is left out and ``alias`` maps every produced name to its kept index."""
    R, g, N, El = topology.replica_slots, topology.gpus_per_node, topology.num_nodes, topology.experts_per_gpu
    out = [("none", *native_slots(loads_MLSE, topology, placement_LE))]
    if R:
        mt, mct = config.min_replica_tokens_on(N), config.min_cross_replica_tokens
        best = step = None
        if traffic and N > 1:
            best, step = traffic_replicas(loads_MLSE, topology, placement_LE, R // 2, config.cross_node_s_per_token / g,
                                          config.cross_replica_fill_s_per_expert, also_step=True,
                                          spread=spread_args(config))
            best = best if bool((best[0] >= 0).any()) else None
            step = step if bool((step[0] >= 0).any()) and (best is None or not torch.equal(step[0], best[0])) else None
        for name, traffic_set, use_balance in (("traffic", best, False), ("balance", None, True),
                                               ("both", best, True), ("step", step, True)):
            if (use_balance and not balance) or (name != "balance" and traffic_set is None):
                continue
            out.append((name, *replicate(loads_MLSE, topology, placement_LE, mt if use_balance else _NEVER,
                                         traffic_set, mct if use_balance else _NEVER,
                                         keep_prefilled=int(config.two_hop))))
    unique: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    alias: dict[str, int] = {}
    for name, se, st in out:
        se, st = _emptied(se, st, El)
        same = [i for i, u in enumerate(unique) if torch.equal(se, u[1]) and torch.equal(st, u[2])]
        if same:
            alias[name] = same[0]
        else:
            alias[name] = len(unique)
            unique.append((name, se, st))
    return unique, alias


@dataclass
class Group:
    """One placement's candidates and their prices (float64; ``O`` candidates).

    Attributes:
        placement_LE: the placement; slots_O: ``[(slot_expert_MLGJ, slot_tokens_MLGJ)]``.
        moe_OML: compute + all-to-all + exchange latency of each candidate (NaN: not priced).
        cross_OML: the all-to-all's inter-node part alone (``price.a2a_parts_ML``).
        start_OL: fills at the step's first micro-batch; end_OL: returns at its last.
        window_MOOL: ``[M - 1]``: fills at ``m + 1`` and returns at ``m`` from candidate
            ``o'`` at ``m`` to ``o`` at ``m + 1`` (index ``[m, o', o]``).
    """

    placement_LE: torch.Tensor
    slots_O: list
    moe_OML: torch.Tensor | None = None
    cross_OML: torch.Tensor | None = None
    start_OL: torch.Tensor | None = None
    end_OL: torch.Tensor | None = None
    window_MOOL: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.moe_OML is None:
            O, (M, L) = len(self.slots_O), self.slots_O[0][0].shape[:2]
            self.moe_OML = torch.full((O, M, L), float("nan"), dtype=torch.float64)
            self.cross_OML = self.moe_OML.clone()

    def lower_ML(self, o: int, topology: Topology, config) -> torch.Tensor:
        """float64 ``[M, L]``: at most candidate ``o``'s price: its compute and exchange
        latency exactly, its all-to-all at least 0. (A twin's inter-node part is no bound:
        balancing copies inside a node change which GPU receives the remote tokens, and the
        busiest GPU's inter-node rows can grow.)"""
        return compute_seconds_ML(self.slots_O[o][1], config) + exchange_latency_s(topology, config)


def price_groups(groups: list[Group], loads_MLSE: torch.Tensor, topology: Topology, config,
                 todo: list[list[int]] | None = None, pool: list[Group] = (),
                 common_ML: torch.Tensor | None = None) -> None:
    """Price the candidates ``todo[i]`` of group ``i`` (default: all), and every group's
    fills and returns. A (micro-batch, layer) row equal to one priced in the same call, or
    to a priced candidate of ``groups`` or ``pool``, takes its price (same slots, any group):
    most rows, where no copy is made. Rows ``common_ML`` (the same slots in every
    alternative: every choice pays them alike) are priced 0, not computed."""
    todo = todo if todo is not None else [list(range(len(grp.slots_O))) for grp in groups]
    rows = [(gi, o) for gi, grp in enumerate(groups) for o in todo[gi]]
    M, L = loads_MLSE.shape[:2]
    if rows:
        se_RMLGJ = torch.stack([groups[gi].slots_O[o][0] for gi, o in rows])
        st_RMLGJ = torch.stack([groups[gi].slots_O[o][1] for gi, o in rows])
        X = se_RMLGJ.shape[0]
        first_XML = torch.arange(X).view(X, 1, 1).expand(X, M, L).clone()
        for c in range(1, X):
            for cp in range(c):
                same = ((se_RMLGJ[c] == se_RMLGJ[cp]) & (st_RMLGJ[c] == st_RMLGJ[cp])).flatten(2).all(-1)
                first_XML[c] = torch.where(same & (first_XML[c] == c), cp, first_XML[c])
        own_XML = first_XML == torch.arange(X).view(X, 1, 1)
        value_2XML = torch.full((2, X, M, L), float("nan"), dtype=torch.float64)
        if common_ML is not None:
            value_2XML.masked_fill_(common_ML, 0.0)
            own_XML &= ~common_ML
        priced = [(grp, op) for grp in [*groups, *[p for p in pool if all(p is not q for q in groups)]]
                  for op in range(len(grp.slots_O)) if not bool(grp.moe_OML[op].isnan().any())]
        for x in range(X):  # rows a candidate shares with one priced before
            for grp, op in priced:
                same = ((grp.slots_O[op][0] == se_RMLGJ[x]) & (grp.slots_O[op][1] == st_RMLGJ[x])).flatten(2).all(-1)
                take = same & own_XML[x]
                value_2XML[0, x] = torch.where(take, grp.moe_OML[op], value_2XML[0, x])
                value_2XML[1, x] = torch.where(take, grp.cross_OML[op], value_2XML[1, x])
                own_XML[x] &= ~same
        c_R, m_R, l_R = own_XML.nonzero(as_tuple=True)
        price_R = torch.empty(2, c_R.numel(), dtype=torch.float64)
        # any placement will do for the rows: compute and all-to-all depend on the slots alone
        place = groups[0].placement_LE
        for a in range(0, c_R.numel(), _ROWS):  # rows priced as the layers of one micro-batch
            c_, m_, l_ = c_R[a:a + _ROWS], m_R[a:a + _ROWS], l_R[a:a + _ROWS]
            part = StepPlan(topology, place[l_], se_RMLGJ[c_, m_, l_].unsqueeze(0),
                            st_RMLGJ[c_, m_, l_].unsqueeze(0), "relibra")
            moe, cross = moe_parts_ML(part, loads_MLSE[m_, l_].unsqueeze(0), config)
            price_R[0, a:a + _ROWS], price_R[1, a:a + _ROWS] = moe[0], cross[0]
        value_2XML[:, c_R, m_R, l_R] = price_R
        value_2XML = value_2XML.gather(1, first_XML.unsqueeze(0).expand(2, X, M, L))
        for x, (gi, o) in enumerate(rows):
            groups[gi].moe_OML[o], groups[gi].cross_OML[o] = value_2XML[0, x], value_2XML[1, x]
    for grp in groups:
        if grp.start_OL is not None:
            continue
        O = len(grp.slots_O)
        se_O = torch.stack([s[0] for s in grp.slots_O])
        st_O = torch.stack([s[1] for s in grp.slots_O])
        owner = grp.placement_LE // topology.experts_per_gpu
        empty = torch.full_like(se_O[:, 0], -1)
        zero = torch.zeros_like(st_O[:, 0])
        grp.start_OL = window_seconds(empty, zero, se_O[:, 0], st_O[:, 0], owner, topology, config)[0]
        grp.end_OL = window_seconds(se_O[:, M - 1], st_O[:, M - 1], empty, zero, owner, topology, config)[1]
        win = torch.zeros(max(M - 1, 0), O, O, L, dtype=torch.float64)
        for op in range(O):
            before = se_O[op, :-1].unsqueeze(0).expand(O, M - 1, *se_O.shape[2:])
            tokens = st_O[op, :-1].unsqueeze(0).expand(O, M - 1, *st_O.shape[2:])
            fill_b, ret_a = window_seconds(before, tokens, se_O[:, 1:], st_O[:, 1:], owner, topology, config)
            win[:, op] = (fill_b + ret_a).transpose(0, 1)
        grp.window_MOOL = win


def cheapest_sequence(grp: Group, allowed: list[int], moe_OML: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(choice_ML, priced_L)``: per layer the cheapest sequence of the candidates
    ``allowed`` (indices into ``grp.slots_O``) and its price (module docstring); with
    ``moe_OML`` (lower bounds of some candidates' prices), a lower bound of that price."""
    idx = torch.tensor(allowed)
    moe = (grp.moe_OML if moe_OML is None else moe_OML)[idx]
    M = moe.shape[1]
    value_CL = moe[:, 0] + grp.start_OL[idx]
    back = []
    for m in range(1, M):
        via_PCL = value_CL.unsqueeze(1) + grp.window_MOOL[m - 1][idx][:, idx]     # [c', c, L]
        best_CL, arg_CL = via_PCL.min(0)                                            # ties: earlier c'
        back.append(arg_CL)
        value_CL = moe[:, m] + best_CL
    priced_L, last_L = (value_CL + grp.end_OL[idx]).min(0)
    choice = [last_L]
    for arg_CL in reversed(back):
        choice.append(arg_CL.gather(0, choice[-1].unsqueeze(0)).squeeze(0))
    return idx[torch.stack(choice[::-1])], priced_L


def _assemble(parts: list[tuple[Group, torch.Tensor, torch.Tensor]], L: int, topology: Topology):
    """``(placement_LE, se, st, moe_ML)`` taking layer ``l`` from the group and choice of
    ``parts`` whose mask ``[L]`` holds it (the later one where several do); ``moe_ML``: the
    chosen rows' priced compute, all-to-all and exchange latency."""
    placement_LE = se = st = moe = None
    for grp, mask_L, choice_ML in parts:
        se_O = torch.stack([s[0] for s in grp.slots_O])
        st_O = torch.stack([s[1] for s in grp.slots_O])
        pick = choice_ML.view(1, *choice_ML.shape, 1, 1).expand(1, *choice_ML.shape, *se_O.shape[-2:])
        g_se, g_st = se_O.gather(0, pick)[0], st_O.gather(0, pick)[0]
        g_moe = grp.moe_OML.gather(0, choice_ML.unsqueeze(0))[0]
        if placement_LE is None:
            placement_LE, se, st, moe = grp.placement_LE.clone(), g_se, g_st, g_moe
        else:
            m = mask_L.view(1, L, 1, 1)
            placement_LE = torch.where(mask_L.view(L, 1), grp.placement_LE, placement_LE)
            se, st = torch.where(m, g_se, se), torch.where(m, g_st, st)
            moe = torch.where(mask_L.view(1, L), g_moe, moe)
    return placement_LE, se, st, moe


def chosen_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor, config,
                placements: dict[bool, torch.Tensor], pairs_LEE: torch.Tensor | None = None,
                coloc_w: float = 0.0) -> StepPlan:
    """The cheapest whole-step alternative (module docstring). ``placements[t]``: relibra's
    reordered placement with (``True``) and without traffic slots; ``coloc_w``: seconds a
    co-located co-activated pair saves (hierarchical dispatch with the step's ``pairs_LEE``),
    credited to a placement for the crossings the count-level price cannot see.

    Of the mechanism subsets that share a placement only the largest is priced in full: its
    cheapest sequences are per layer at most a smaller subset's (a superset of candidates),
    so its per-layer choice moves every layer the smaller one moves, each for less than it
    saves at its own migration, which bounds what it adds to the joint move. Two subsets
    are priced lazily: relibra without balancing (traffic replicas, step-long set; twins
    ``both`` and ``step``) and relibra without traffic replicas (its balancing copies; twin:
    its ``none``). A lower bound of their alternatives
    (:meth:`Group.lower_ML` in the cheapest sequence, migration exact) is computed first, and
    their candidates are priced only when it beats the best plan so far."""
    M, L = loads_MLSE.shape[:2]
    R, N = topology.replica_slots, topology.num_nodes
    traffic_on = bool(config.cross_node_replicas and N > 1 and R)
    balance_on = bool(config.balance and R)
    bal = ("balance",) if balance_on else ()
    # (group, allowed names, lazy names -> twin names), main subsets first
    plans: list[tuple[Group, list[str], dict[str, str]]] = []
    groups, aliases = [], []
    for t in ((True, False) if traffic_on else (False,)):
        if not t and groups and torch.equal(placements[False], groups[0].placement_LE):
            break  # the same placement: the subsets with traffic replicas cover those without
        slots, alias = candidate_sets(loads_MLSE, topology, placements[t], config, traffic=t, balance=balance_on)
        groups.append(Group(placements[t], [(se, st) for _, se, st in slots]))
        aliases.append(alias)
        if t and balance_on:
            plans.append((len(groups) - 1, ["none", "balance", "both", "step"], {}))
            plans.append((len(groups) - 1, ["none", "traffic"], {"traffic": "both"}))
        elif t or not traffic_on:
            plans.append((len(groups) - 1, list(SUBSET_NAMES[(("traffic",) if t else ()) + bal]), {}))
        else:  # relibra without traffic replicas, beside a full subset on another placement
            plans.append((len(groups) - 1, list(SUBSET_NAMES[bal]), {"balance": "none"} if balance_on else {}))
    resolved = []
    for gi, names, lazy in plans:
        alias = aliases[gi]
        twins = {alias[n]: alias[tw] for n, tw in lazy.items() if n in alias and tw in alias}
        allowed = sorted({alias[n] for n in names if n in alias})
        # the smaller subsets' sequences too: with second hops the windows only estimate, so
        # a superset's cheapest sequence may price above a subset's exactly
        subs = {tuple(sorted({alias[n] for n in sub if n in alias})) for sub in SUBSET_NAMES.values()
                if set(sub) < set(names)} - {tuple(allowed)}
        resolved.append((groups[gi], allowed, {o: tw for o, tw in twins.items() if o != tw}, sorted(subs)))
    keep = Group(previous_placement_LE, [native_slots(loads_MLSE, topology, previous_placement_LE)])
    # (micro-batch, layer) rows with the same slots in every candidate and the kept placement
    common_ML = torch.ones(M, L, dtype=torch.bool)
    for grp in groups:
        for se, st in grp.slots_O:
            common_ML &= ((se == keep.slots_O[0][0]) & (st == keep.slots_O[0][1])).flatten(2).all(-1)
    exact = [sorted({o for grp2, allowed, twins, _ in resolved if grp2 is grp for o in allowed if o not in twins}
                    | {tw for grp2, _, twins, _ in resolved if grp2 is grp for tw in twins.values()})
             for grp in groups]
    if all(len(grp.slots_O) == 1 for grp in groups) and bool(common_ML.all()):
        # one plan whatever is chosen (no copy made, nothing moved): nothing to price
        return StepPlan(topology, previous_placement_LE.clone(), *keep.slots_O[0], "relibra",
                        previous_placement_LE.clone())
    price_groups(groups + [keep], loads_MLSE, topology, config, exact + [[0]], common_ML=common_ML)
    none_ML = torch.zeros(M, L, dtype=torch.int64)
    every = torch.ones(L, dtype=torch.bool)

    def credit_L(p_LE: torch.Tensor) -> torch.Tensor:
        if not coloc_w or pairs_LEE is None:
            return torch.zeros(L, dtype=torch.float64)
        per_node, pairs = topology.experts_per_node, pairs_LEE.to(torch.int64)
        gained = (colocated_pairs(pairs, p_LE // per_node, N)
                  - colocated_pairs(pairs, previous_placement_LE // per_node, N))
        return coloc_w * gained.to(torch.float64)

    def total(priced_L: torch.Tensor, placement_LE: torch.Tensor) -> float:
        return (float(priced_L.sum()) + migration_seconds(placement_LE, previous_placement_LE, topology, config)
                - float(credit_L(placement_LE).sum()))

    def exact(parts) -> float:
        """An alternative's exact price (``price.step_seconds`` less the rows every one pays
        alike): the windows of the cheapest sequence estimate second hops, these replicas not."""
        placement_LE, se, st, moe_ML = _assemble(parts, L, topology)
        replicas = replica_seconds_ML(StepPlan(topology, placement_LE, se, st, "relibra"), config)
        return total(moe_ML.sum(0) + replicas.sum(0), placement_LE)

    keep_L = cheapest_sequence(keep, [0])[1]
    best = [(keep, every, none_ML)]
    best_price = exact(best)
    for grp, allowed, twins, subs in sorted(resolved, key=lambda r: bool(r[2])):  # lazy subsets last
        moved_L = migration_seconds_L(grp.placement_LE, previous_placement_LE, topology, config)
        gain_L = credit_L(grp.placement_LE)
        pending = [o for o in twins if bool(grp.moe_OML[o].isnan().any())]
        if pending:
            lower = grp.moe_OML.clone()
            for o in pending:  # rows common to every alternative are priced 0 in all
                lower[o] = grp.lower_ML(o, topology, config).masked_fill(common_ML, 0.0)
            low_L = cheapest_sequence(grp, allowed, lower)[1]
            if (float(torch.minimum(low_L - gain_L, keep_L).sum()) >= best_price
                    and total(low_L, grp.placement_LE) >= best_price):
                continue  # neither alternative can beat the best: not priced
            price_groups([grp], loads_MLSE, topology, config, [pending], pool=groups + [keep], common_ML=common_ML)
        for sub in [allowed, *[list(x) for x in subs if not bool(grp.moe_OML[list(x)].isnan().any())]]:
            choice_ML, priced_L = cheapest_sequence(grp, sub)
            use_L = priced_L + moved_L - gain_L < keep_L
            for parts in ([(grp, use_L, choice_ML), (keep, ~use_L, none_ML)], [(grp, every, choice_ML)]):
                price = exact(parts)
                if price < best_price:
                    best, best_price = parts, price
    placement_LE, se, st, _ = _assemble(best, L, topology)
    return StepPlan(topology, placement_LE, se, st, "relibra", previous_placement_LE.clone())


def cheapest_plan(chosen: StepPlan, plains: list[StepPlan], loads_MLSE: torch.Tensor, config) -> StepPlan:
    """The cheapest of ``choose``'s plan and relibra's plain plans at the exact step price
    (:func:`relibra_torch.planning.price.step_seconds`); ties keep the earliest, ``chosen``
    first. So ``choose`` is never priced above relibra without it (the plain plan's
    residency-aware balancing is not among the candidates). Each plan is priced once; one
    equal to an earlier plan is not priced."""
    def same(p: StepPlan, q: StepPlan) -> bool:
        return (torch.equal(p.placement_LE, q.placement_LE) and torch.equal(p.slot_expert_MLGJ, q.slot_expert_MLGJ)
                and torch.equal(p.slot_tokens_MLGJ, q.slot_tokens_MLGJ)
                and (p.previous_placement_LE is None) == (q.previous_placement_LE is None)
                and (p.previous_placement_LE is None or torch.equal(p.previous_placement_LE, q.previous_placement_LE)))

    best, best_s = chosen, None
    seen = [chosen]
    for plain in plains:
        if any(same(plain, q) for q in seen):
            continue
        seen.append(plain)
        if best_s is None:
            best_s = step_seconds(chosen, loads_MLSE, config)
        plain_s = step_seconds(plain, loads_MLSE, config)
        if plain_s < best_s:
            best, best_s = plain, plain_s
    return best
