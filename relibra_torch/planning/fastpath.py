"""relibra's fast path: prove, cheaply and up front, that its full search would keep the
previous placement and make no copy, and then skip it.

At real micro-batch sizes (16-64 tokens per GPU) no copy and no move pays for its fill or
migration; the full search (two swap searches, traffic replicas per micro-batch, balancing)
would find that out at a cost of 0.2 s and more per step. Three sufficient conditions,
each on counts summed once ([M, L, N, E] per-node demand):

* **no move**: every assignment of experts to nodes other than the previous one moves at
  least two experts, so its reordering objective (either search's, see
  :mod:`relibra_torch.planning.relibra` and :mod:`relibra_torch.planning.reorder_traffic`)
  is at least a lower bound plus two migrations: the busiest node at least ``ceil(total / N)``
  per micro-batch; cross-node pairs at least each node's demand beyond its ``E / N`` most
  requested experts (its own experts are fixed for the step), and beyond its ``E / N + B``
  (``B`` traffic slots) for the traffic objective. When the previous assignment's objective
  (its traffic one without replicas, which is higher) is at most that, neither search can
  find a strict improvement, so both return it. Co-activation credits are not bounded:
  with pair counts under hierarchical dispatch the fast path is not taken.
* **no traffic replica**: no remote expert's step demand from a node saves its inter-node
  fill (both the per-micro-batch and the step-long sets need that).
* **no balancing copy**: a copy takes at most its expert's load and at most what the
  node's least loaded GPU lacks to the node's mean; where neither reaches
  ``min_replica_tokens_on(N)`` in any (micro-batch, layer, node), balancing makes none
  (and ``balance.replicate_step``'s residency-priced plans provably lose:
  :func:`_balancing_copies_none`).

Where the whole-step bounds fall short (skewed or collapsed routers, 64 tokens per GPU),
tighter ones count what a move changes: a swap of two experts between two nodes, the first
thing either search tries from the previous assignment, and ``k >= 3`` moves for the
greedy start (:func:`_no_move_per_swap`); and the residency plan that shares a fill over
the step is planned exactly on one node per layer, a lower bound of its price
(:func:`_b_loses_L`).

Then relibra's plan is the previous placement (in its canonical slot order; with
``choose``, as it is) with every expert on its owner, exactly what the full search returns
(``tests/test_relibra_fastpath.py``). With ``choose`` the fast path is taken only on static
placement's GPUs, where static placement, one of its alternatives, costs the same.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, g GPUs per node.
"""

from __future__ import annotations

import dataclasses

import torch

from .balance import replicate_node_rows, step_price_L
from .choose import native_slots
from .plan import StepPlan
from .reorder_greedy import move_price_s
from .reorder_load import load_term
from .reorder_traffic import replica_min_tokens
from .gpu_pack import swap_can_pay
from .fastpath_sets import c_loses, d_loses, search_natives as _search_natives
from .topology import Topology

__all__ = ["assign_gpus", "fast_plan", "keep_plan", "nothing_pays"]


def _beyond_top(step_LNE: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[L, N]``: each node's step demand beyond its ``k`` most requested experts."""
    k = min(k, step_LNE.shape[-1])
    return step_LNE.sum(-1) - step_LNE.topk(k, dim=-1).values.sum(-1) if k else step_LNE.sum(-1)


def _node_loads(load_MLE: torch.Tensor, placement_LE: torch.Tensor, topology: Topology
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gpu_MLNg, biggest_MLN)`` int64: each GPU's load with every expert at its native
    slot, and each node's largest expert load (``load_MLE`` may be step totals, ``M = 1``)."""
    M, L, E = load_MLE.shape
    G, g, N = topology.num_gpus, topology.gpus_per_node, topology.num_nodes
    gpu_MLNg = torch.zeros(M, L, G, dtype=torch.int64).scatter_add_(
        2, (placement_LE // topology.experts_per_gpu).unsqueeze(0).expand(M, L, E), load_MLE).view(M, L, N, g)
    biggest_MLN = torch.zeros(M, L, N, dtype=torch.int64).scatter_reduce_(
        2, (placement_LE // topology.experts_per_node).unsqueeze(0).expand(M, L, E), load_MLE, "amax")
    return gpu_MLNg, biggest_MLN


def _copy_possible_MLN(gpu_MLNg: torch.Tensor, biggest_MLN: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """bool ``[M, L, N]``: balancing (:func:`relibra_torch.planning.balance.replicate`, no
    traffic replicas) may make a copy in that node (arguments from :func:`_node_loads`). It
    provably makes none where either no GPU of the node is above ``target = ceil(node load /
    g)`` or every copy would take fewer than ``min_tokens``: a copy takes at most its expert's
    load, and at most the receiver's deficit, which is at most ``target`` minus the node's
    least GPU load (that only rises)."""
    target = (gpu_MLNg.sum(-1) + gpu_MLNg.shape[-1] - 1) // gpu_MLNg.shape[-1]
    most = torch.minimum(target - gpu_MLNg.min(-1).values, biggest_MLN)
    return ~((gpu_MLNg.max(-1).values <= target) | (most < min_tokens))


def _copy_possible_ML(gpu_MLNg: torch.Tensor, biggest_MLN: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """bool ``[M, L]``: :func:`_copy_possible_MLN` in some node."""
    return _copy_possible_MLN(gpu_MLNg, biggest_MLN, min_tokens).any(-1)


def _balancing_copies_none(own_MLNE: torch.Tensor, load_MLE: torch.Tensor, placement_LE: torch.Tensor,
                           topology: Topology, config, r0: int) -> bool:
    """Whether :func:`relibra_torch.planning.balance.replicate_step` provably makes no copy
    on the placement the full search keeps (``placement_LE``'s GPUs, :func:`_search_natives`)
    after ``r0`` traffic slots per GPU that hold nothing (0: none reserved). Its plans: ``a``
    per micro-batch (copies of at least ``mt = min_replica_tokens_on(N)`` tokens), ``b`` the same with ``mt / M`` (a fill shared by the
    step's micro-batches), without traffic slots ``c`` one step-long set, and ``d``; per layer
    the cheapest at its step price (ties keep ``a``).

    * ``a`` makes none where no copy of ``mt`` tokens is possible (:func:`_copy_possible_MLN`);
      ``b`` and ``c`` are not planned where no expert has ``mt`` tokens in the step.
    * Copies stay inside a node, so they lower a micro-batch's busiest GPU at most to
      ``max over nodes of ceil(node load / g)`` (its *drop*), and a plan with a copy pays at
      least one fill and one latency: ``c`` loses in a layer where its step totals allow no
      copy or the step's drops cannot pay that, ``b`` where its drops in the micro-batches
      where a copy of ``mt / M`` tokens is possible cannot, and ``d`` (the set over every
      free slot, :mod:`relibra_torch.planning.step_set`, planned with traffic replicas too)
      where no expert has ``2 mt`` step tokens or the step's drops cannot pay.
    * Elsewhere ``b``'s rows of one node per layer (:func:`_b_loses_L`) are planned exactly,
      and ``c`` and ``d`` in full (:mod:`relibra_torch.planning.fastpath_sets`).
    """
    M = load_MLE.shape[0]
    N, g = topology.num_nodes, topology.gpus_per_node
    mt = config.min_replica_tokens_on(N)
    gpu_MLNg, biggest_MLN = _node_loads(load_MLE, placement_LE, topology)
    if bool(_copy_possible_ML(gpu_MLNg, biggest_MLN, mt).any()):
        return False
    saved, fill, latency = config.saved_s_per_token(N), config.replica_fill_s_per_expert, config.fill_latency_s(N)
    if (M < 2 or (fill <= 0 and latency <= 0) or mt <= 0 or mt == torch.iinfo(torch.int64).max
            or int(load_MLE.sum(0).max()) < mt):
        return True  # replicate_step keeps a
    ceil_MLN = (gpu_MLNg.sum(-1) + g - 1) // g
    busiest_ML = gpu_MLNg.flatten(2).amax(-1)
    drop_ML = busiest_ML - ceil_MLN.amax(-1)
    step_set = r0 == 0  # the step-long set is planned only without traffic slots (``prefilled``)
    pays_L = drop_ML.sum(0).to(torch.float64) * saved >= fill + latency
    # the set over every free slot (planning.step_set) is planned with or without traffic
    # replicas and copies only an expert whose step load gives each of two instances ``mt``
    every_L = pays_L & (load_MLE.sum(0).amax(-1) >= 2 * mt)
    if bool(every_L.any()) and not d_loses(load_MLE, every_L.nonzero().squeeze(1), placement_LE, topology, config, r0):
        return False
    if step_set:
        step_L = _copy_possible_ML(*_node_loads(load_MLE.sum(0, keepdim=True), placement_LE, topology), mt)[0]
        if bool((step_L & pays_L).any()) and not c_loses(own_MLNE, (step_L & pays_L).nonzero().squeeze(1),
                                                         placement_LE, topology, config):
            return False
    possible_MLN = _copy_possible_MLN(gpu_MLNg, biggest_MLN, -(-mt // M))
    open_L = (drop_ML * possible_MLN.any(-1)).sum(0).to(torch.float64) * saved >= fill + latency
    if not bool(open_L.any()):
        return True
    # a quarter of the micro-batches first (usually enough), then all of them where it is not
    for K in sorted({min(M, max(2, M // 4)), M}):
        lay = open_L.nonzero().squeeze(1)
        natives_LGl = _search_natives(placement_LE[lay], topology, config)
        open_L[lay] = ~_b_loses_L(own_MLNE, lay, load_MLE[:, lay], natives_LGl, gpu_MLNg[:, lay],
                                  possible_MLN[:, lay], r0, K, topology, config)
        if not bool(open_L.any()):
            return True
    return False


def _b_loses_L(own_MLNE: torch.Tensor, layers_L: torch.Tensor, load_MLE: torch.Tensor, natives_LGl: torch.Tensor,
               gpu_MLNg: torch.Tensor, possible_MLN: torch.Tensor, r0: int, K: int, topology: Topology,
               config) -> torch.Tensor:
    """bool ``[L]``: ``replicate_step``'s plan ``b`` (see :func:`_balancing_copies_none`)
    provably prices above the plan without copies in that layer. Its rows of one node per
    layer (where the layer's busiest GPU sits most, weighted by the drop) are planned
    exactly (:func:`relibra_torch.planning.balance.replicate_node_rows`, ``r0`` empty
    traffic slots); a copy there that its GPU did not hold in the micro-batch before starts
    a residency (the plan keeps a held copy in its slot, ``balance.align_slots``), so the
    node's fills and latencies are exact and the rest at least 0; the busiest GPU is at
    least the node's planned load and every other node's ``ceil(node load / g)`` where a
    copy is possible there, its busiest GPU elsewhere. Only the first ``K`` micro-batches are
    planned (a prefix is planned as in the whole step, and its fills are a part of the
    step's); the others count as copies that lower the busiest GPU as far as a node allows,
    for free."""
    M, L, N, g = gpu_MLNg.shape
    R, El, E = topology.replica_slots, topology.experts_per_gpu, topology.num_experts
    saved, fill, latency = config.saved_s_per_token(N), config.replica_fill_s_per_expert, config.fill_latency_s(N)
    busiest_ML = gpu_MLNg.flatten(2).amax(-1)
    ceil_MLN = (gpu_MLNg.sum(-1) + g - 1) // g
    drop_ML = busiest_ML - ceil_MLN.amax(-1)
    hot_ML = gpu_MLNg.flatten(2).argmax(-1) // g
    node_L = torch.zeros(L, N, dtype=torch.int64).scatter_add_(1, hot_ML.T, drop_ML.T).argmax(1)
    rows = torch.arange(L)
    natives_Lgl = natives_LGl.view(L, N, g, El)[rows, node_L]
    home_MLE = own_MLNE[:K, layers_L, node_L]           # own_MLNE: every layer; the others: layers_L only
    rep_KLgR, load_KLg = replicate_node_rows(load_MLE[:K], home_MLE, natives_Lgl, R, r0,
                                             -(-config.min_replica_tokens_on(N) // M),
                                             -(-config.min_cross_replica_tokens // M))
    before_KLgR = torch.cat([torch.full_like(rep_KLgR[:1], -1), rep_KLgR[:-1]])
    new_KLgR = (rep_KLgR >= 0) & ~(rep_KLgR.unsqueeze(-1) == before_KLgR.unsqueeze(-2)).any(-1)
    local_LE = torch.zeros(L, E, dtype=torch.int64).scatter_(
        1, natives_Lgl.flatten(1), torch.arange(g).repeat_interleave(El).expand(L, -1))   # owner GPU in the node
    owner_KLgR = local_LE.view(1, L, 1, E).expand(K, L, g, E).gather(3, rep_KLgR.clamp(min=0))
    sent_KLg = torch.zeros(K, L, g, dtype=torch.int64).scatter_add_(2, owner_KLgR.flatten(2),
                                                                    new_KLgR.flatten(2).to(torch.int64))
    link_KL = torch.maximum(sent_KLg, new_KLgR.sum(-1)).amax(-1)
    floor_MLN = torch.where(possible_MLN, ceil_MLN, gpu_MLNg.amax(-1))
    floor_MLN[:K, rows, node_L] = load_KLg.amax(-1)
    price_a_L = (busiest_ML.to(torch.float64) * saved).sum(0)
    low_b_L = ((floor_MLN.amax(-1).to(torch.float64) * saved).sum(0)
               + (link_KL.to(torch.float64) * fill + new_KLgR.flatten(2).any(-1).to(torch.float64) * latency).sum(0))
    # a margin far above float64 rounding of these sums, far below one token's price
    return low_b_L - price_a_L > 1e-9 * (price_a_L + fill + latency)


def nothing_pays(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
                 config, coloc_w: float = 0.0) -> bool:
    """True when relibra's full search provably returns the previous placement, no copies."""
    M, L, S, E = loads_MLSE.shape
    N, g = topology.num_nodes, topology.gpus_per_node
    own_MLNE = loads_MLSE.view(M, L, N, g, E).sum(3, dtype=torch.int64)       # demand by source node
    return _nothing_pays(own_MLNE, topology, previous_placement_LE, config, coloc_w)


def _nothing_pays(own_MLNE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
                  config, coloc_w: float = 0.0) -> bool:
    """:func:`nothing_pays` from the step's demand by source node ``own_MLNE`` (int64 ``[M, L, N, E]``)."""
    M, L, N, E = own_MLNE.shape
    g, R = topology.gpus_per_node, topology.replica_slots
    traffic = bool(config.cross_node_replicas and N > 1 and R)
    # choose also weighs the plain plan without traffic replicas (relibra.py), whose
    # candidates include the capped step-long sets: it must make nothing either
    configs = [config]
    if config.choose and traffic:
        configs.append(dataclasses.replace(config, cross_node_replicas=False))
    load_MLE = own_MLNE.sum(2)
    node_LE = previous_placement_LE // topology.experts_per_node
    step_LNE = own_MLNE.sum(0)
    mine_LNE = node_LE.unsqueeze(1) == torch.arange(N).view(1, N, 1)
    if traffic:
        remote_max = int(step_LNE.masked_fill(mine_LNE, 0).max())
        if remote_max * config.cross_node_s_per_token / g > config.cross_replica_fill_s_per_expert:
            return False
    if config.reorder and N > 1 and not _no_move(own_MLNE, load_MLE, step_LNE, node_LE, mine_LNE, configs, g, R,
                                                  coloc_w):
        return False
    if config.reorder and swap_can_pay(load_MLE, previous_placement_LE, topology, config):
        return False  # R = 0: experts may swap GPUs inside a node (planning/gpu_pack.py)
    if not (config.balance and R):
        return True
    # balance.replicate_step on the placement the search keeps, after traffic replicas that made
    # none, in their R // 2 slots and without them (the plain plan weighs both, planning/plain.py).
    # Without traffic slots the last config's check implies the others': it differs only where
    # choose's plan without traffic replicas also weighs the capped step-long sets (a superset)
    checks = ([(config, R // 2)] if traffic and R // 2 else []) + [(configs[-1], 0)]
    return all(_balancing_copies_none(own_MLNE, load_MLE, previous_placement_LE, topology, c, r0)
               for c, r0 in checks)


def _no_move(own_MLNE, load_MLE, step_LNE, node_LE, mine_LNE, configs: list, g: int, R: int, coloc_w: float) -> bool:
    """Both reordering searches provably keep every expert's node (module docstring), under
    each of ``configs`` (one ``ReLibraConfig``, or with ``choose`` also the same without traffic
    replicas: they differ only in the traffic search's replica slots)."""
    M, L, N, E = own_MLNE.shape
    if coloc_w:
        return False
    config = configs[0]
    two_moves = 2.0 * move_price_s(config, g, N)
    node_MLE = node_LE.unsqueeze(0).expand(M, L, E)
    term_MLE = load_term(load_MLE, R, E // (N * g))                    # the loads the searches' load term weighs
    nl_MLN = torch.zeros(M, L, N, dtype=torch.int64).scatter_add_(2, node_MLE, term_MLE)
    total_ML = term_MLE.sum(-1)
    best_max = ((total_ML + N - 1) // N).sum(0).to(torch.float64)             # [L]
    now_max = nl_MLN.max(-1).values.sum(0).to(torch.float64)
    per_node = E // N
    # load-first objective (relibra._objective): node_w * sum_m max node load + cross_w * pairs
    node_w = (config.compute_s_per_token + config.cross_node_s_per_token) / g
    cross_w = config.cross_node_s_per_token / g
    cross_now = (step_LNE.sum(-1) - (step_LNE * mine_LNE).sum(-1)).sum(-1).to(torch.float64)
    cross_best = _beyond_top(step_LNE, per_node).sum(-1).to(torch.float64)
    first = bool(((node_w * (now_max - best_max) + cross_w * (cross_now - cross_best)) <= two_moves).all())
    tc = config.compute_s_per_token / g
    # each expert's demand from its own node's sources: the rest crosses (the sums on [M, L, E]
    # and [M, L, N], not on [M, L, N, E])
    home_MLE = own_MLNE.gather(2, node_LE.view(1, L, 1, E).expand(M, L, 1, E)).squeeze(2)
    send_MLN = own_MLNE.sum(-1) - torch.zeros(M, L, N, dtype=torch.int64).scatter_add_(2, node_MLE, home_MLE)
    inflow_MLE = load_MLE - home_MLE
    recv_MLN = torch.zeros(M, L, N, dtype=torch.int64).scatter_add_(2, node_MLE, inflow_MLE)
    tr_now = torch.maximum(send_MLN, recv_MLN).max(-1).values.sum(0).to(torch.float64)
    for cfg in configs:
        second = True
        if cfg.traffic_search:
            # traffic objective (reorder_traffic.traffic_objective), previous assignment without replicas
            slots = g * (R // 2 if cfg.cross_node_replicas else 0)
            tr_best = _beyond_top(step_LNE, per_node + slots).max(-1).values.to(torch.float64)
            second = bool(((tc * (now_max - best_max) + cross_w * (tr_now - tr_best)) <= two_moves).all())
        if not (first and second) and not _no_move_per_swap(
                own_MLNE, term_MLE, step_LNE, node_LE, mine_LNE, nl_MLN, send_MLN, recv_MLN, inflow_MLE, cfg, g,
                R, first, second):
            return False
    return True


def _no_move_per_swap(own_MLNE, load_MLE, step_LNE, node_LE, mine_LNE, nl_MLN, send_MLN, recv_MLN, inflow_MLE,
                      config, g: int, R: int, first: bool, second: bool) -> bool:
    """:func:`_no_move` where its whole-step bounds fall short, counting what the moves can
    change. A search from the previous assignment first tries swaps of two experts between
    two nodes ``i, j`` (every assignment that moves two experts is one): the busiest node is
    then at least every other node's load and ``i``'s and ``j``'s less their largest
    expert; cross-node pairs fall at most by the best gain of an expert of ``i`` on ``j`` and
    one of ``j`` on ``i``; a node's cross-node send at most by its largest remote demand
    (the expert that joins it, or a replica that becomes worth its fill: only the two moved
    experts' demand can newly reach it), its receive by its largest inflow (the expert that
    leaves), the other nodes' neither. The load-first search also weighs a greedy start,
    which may move ``k >= 3`` experts: then the busiest node keeps at least its load less
    its ``k`` largest experts, and cross-node pairs fall at most by the ``k`` largest gains."""
    M, L, N, E = own_MLNE.shape
    per_node = E // N
    node_w = (config.compute_s_per_token + config.cross_node_s_per_token) / g
    cross_w = config.cross_node_s_per_token / g
    mig = move_price_s(config, g, N)
    node_MLE = node_LE.unsqueeze(0).expand(M, L, E)
    biggest_MLN = torch.zeros(M, L, N, dtype=torch.int64).scatter_reduce_(2, node_MLE, load_MLE, "amax")
    ceil_ML = (load_MLE.sum(-1) + N - 1) // N
    i_P, j_P = torch.triu_indices(N, N, 1)
    others_PN = torch.ones(i_P.numel(), N, dtype=torch.bool)
    others_PN[torch.arange(i_P.numel()), i_P] = False
    others_PN[torch.arange(i_P.numel()), j_P] = False

    def swap_floor(now_MLN: torch.Tensor, less_MLN: torch.Tensor) -> torch.Tensor:
        """int64 ``[M, L, P]``: the busiest of the nodes after any swap between ``i`` and ``j``."""
        rest = now_MLN.unsqueeze(2).masked_fill(~others_PN, torch.iinfo(torch.int64).min).amax(-1)
        return torch.maximum(rest, torch.maximum(less_MLN[..., i_P], less_MLN[..., j_P]))

    nl_floor_LP = torch.maximum(swap_floor(nl_MLN, nl_MLN - biggest_MLN), ceil_ML.unsqueeze(-1)).sum(0)
    now_L = nl_MLN.amax(-1).sum(0)
    scale_L = node_w * now_L.to(torch.float64) + 2 * mig                     # margin against float rounding
    if not first:
        home_LE = (step_LNE * mine_LNE).sum(1)
        gain_LNE = step_LNE - home_LE.unsqueeze(1)                            # moving e to node q
        best_LNN = torch.full((L, N, N), torch.iinfo(torch.int64).min).scatter_reduce(
            1, node_LE.unsqueeze(1).expand(L, N, E).transpose(1, 2), gain_LNE.transpose(1, 2), "amax")   # [l, from, to]
        swap_LP = 2 * mig + node_w * (nl_floor_LP - now_L.unsqueeze(1)).to(torch.float64) - cross_w * (
            best_LNN[:, i_P, j_P] + best_LNN[:, j_P, i_P]).to(torch.float64)
        if bool((swap_LP <= 1e-9 * scale_L.unsqueeze(1)).any()):
            return False
        # k >= 3 moves (the greedy start): the busiest node at least ceil(total / N) first,
        # then (only if that falls short) at least each node's load less its k largest experts
        best_gain_Lk = gain_LNE.masked_fill(mine_LNE, torch.iinfo(torch.int64).min).amax(1).sort(
            -1, descending=True).values.cumsum(-1)
        cross_now = (step_LNE.sum(-1).sum(-1) - home_LE.sum(-1)).unsqueeze(1)
        cross_low_Lk = torch.maximum(cross_now - best_gain_Lk, _beyond_top(step_LNE, per_node).sum(-1, keepdim=True))
        k = torch.arange(1, E + 1)
        for exact in (False, True):
            if exact:
                members_LNp = node_LE.argsort(dim=1, stable=True).view(L, N, per_node)   # every node holds E / N
                load_MLNp = load_MLE.gather(2, members_LNp.view(1, L, E).expand(M, L, E)).view(M, L, N, per_node)
                cum_MLNk = load_MLNp.sort(-1, descending=True).values.cumsum(-1)
                low_Lk = torch.maximum((nl_MLN.unsqueeze(-1) - cum_MLNk).amax(2), ceil_ML.unsqueeze(-1)).sum(0)
                low_Lk = torch.cat([low_Lk, low_Lk[:, -1:].expand(L, max(E - per_node, 0))], 1)     # k = 1..E
            else:
                low_Lk = ceil_ML.sum(0, keepdim=True).T
            many_Lk = (k * mig + node_w * (low_Lk - now_L.unsqueeze(1)).to(torch.float64)
                       + cross_w * (cross_low_Lk - cross_now).to(torch.float64))[:, 2:]
            if bool((many_Lk > 1e-9 * scale_L.unsqueeze(1)).all()):
                break
        else:
            return False
    if not second:
        slots = g * (R // 2 if config.cross_node_replicas else 0)
        if slots and int(step_LNE.masked_fill(mine_LNE, 0).max()) >= max(replica_min_tokens(config, g), 1):
            return False  # the previous assignment's objective would have replicas
        tc = config.compute_s_per_token / g
        tr_MLN = torch.maximum(send_MLN, recv_MLN)
        biggest_remote_MLN = own_MLNE.masked_fill(mine_LNE.unsqueeze(0), 0).amax(-1)
        biggest_inflow_MLN = torch.zeros(M, L, N, dtype=torch.int64).scatter_reduce(
            2, node_LE.unsqueeze(0).expand(M, L, E), inflow_MLE, "amax")
        less_MLN = torch.maximum(send_MLN - biggest_remote_MLN, recv_MLN - biggest_inflow_MLN)
        tr_floor_LP = swap_floor(tr_MLN, less_MLN).sum(0)
        tr_now_L = tr_MLN.amax(-1).sum(0)
        swap_LP = (2 * mig + tc * (nl_floor_LP - now_L.unsqueeze(1)).to(torch.float64)
                   + cross_w * (tr_floor_LP - tr_now_L.unsqueeze(1)).to(torch.float64))
        if bool((swap_LP <= 1e-9 * (scale_L + cross_w * tr_now_L.to(torch.float64)).unsqueeze(1)).any()):
            return False
    return True


def fast_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor, config,
              coloc_w: float = 0.0) -> StepPlan | None:
    """relibra's plan when :func:`nothing_pays` proves it (else ``None``): the previous
    placement (reordering without ``choose``: in canonical slot order, as :func:`assign_gpus`
    gives it) with every expert on its owner. ``relibra_plan`` then applies
    ``plain.no_worse_than_keeping`` to it, as to the full search's plan, so a layer whose
    canonical order differs from the previous one keeps the previous order. With ``choose`` only from static placement's GPUs, where
    static placement, one of its alternatives, costs the same."""
    M, L, S, E = loads_MLSE.shape
    El = topology.experts_per_gpu
    prev_gpu_LE = previous_placement_LE // El
    if config.choose and not torch.equal(prev_gpu_LE, topology.static_placement(L) // El):
        return None
    own_MLNE = loads_MLSE.view(M, L, topology.num_nodes, topology.gpus_per_node, E).sum(3, dtype=torch.int64)
    if not _nothing_pays(own_MLNE, topology, previous_placement_LE, config, coloc_w):
        return None
    return keep_plan(loads_MLSE, topology, previous_placement_LE, config, own_MLNE.sum(2))


def keep_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor, config,
              load_MLE: torch.Tensor | None = None) -> StepPlan:
    """The previous placement with every expert on its owner and no copy: what the full
    search returns when nothing pays (reordering without ``choose``: in canonical slot order,
    as :func:`assign_gpus` gives it; with ``choose`` as it is, every alternative prices the same)."""
    L, E = previous_placement_LE.shape
    placement_LE = previous_placement_LE.clone()
    if config.reorder and not config.choose:
        natives_LS = _search_natives(previous_placement_LE, topology, config).view(L, E)
        placement_LE = torch.empty_like(placement_LE).scatter_(1, natives_LS, torch.arange(E).expand(L, E))
    return StepPlan(topology, placement_LE, *native_slots(loads_MLSE, topology, placement_LE, load_MLE),
                    "relibra", previous_placement_LE.clone())


def assign_gpus(node_LE: torch.Tensor, total_LE: torch.Tensor, prev_gpu_LE: torch.Tensor,
                 topology: Topology) -> torch.Tensor:
    """GPUs inside each node: experts stay on their previous GPU when it is in their node and
    has room; the rest go, heaviest first, to the node's GPU with the least step load."""
    L, E = node_LE.shape
    g, El = topology.gpus_per_node, topology.experts_per_gpu
    G = topology.num_gpus
    node, total, prev = node_LE.tolist(), total_LE.tolist(), prev_gpu_LE.tolist()
    placement = []
    for l in range(L):
        room = [El] * G
        gpu_load = [0] * G
        gpu_of = [-1] * E
        order = sorted(range(E), key=lambda e: (-total[l][e], e))
        for e in order:
            p = prev[l][e]
            if p // g == node[l][e] and room[p] > 0:
                gpu_of[e] = p
                room[p] -= 1
                gpu_load[p] += total[l][e]
        for e in order:
            if gpu_of[e] < 0:
                gpus = range(node[l][e] * g, node[l][e] * g + g)
                p = min((q for q in gpus if room[q] > 0), key=lambda q: (gpu_load[q], q))
                gpu_of[e] = p
                room[p] -= 1
                gpu_load[p] += total[l][e]
        next_local = [0] * G
        place = [0] * E
        for e in range(E):  # native slots in logical order inside a GPU: deterministic
            place[e] = gpu_of[e] * El + next_local[gpu_of[e]]
            next_local[gpu_of[e]] += 1
        placement.append(place)
    return torch.tensor(placement, dtype=torch.int64)
