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
  (and ``balance.replicate_step``'s residency-priced plans provably lose).

Then relibra's plan is the previous placement (in its canonical slot order; with
``choose``, as it is) with every expert on its owner, exactly what the full search returns
(``tests/test_relibra_fastpath.py``). With ``choose`` the fast path is taken only on static
placement's GPUs, where static placement, one of its alternatives, costs the same.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, g GPUs per node.
"""

from __future__ import annotations

import torch

from .choose import native_slots
from .plan import StepPlan
from .topology import Topology

__all__ = ["assign_gpus", "fast_plan", "nothing_pays"]


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


def _copy_possible_ML(gpu_MLNg: torch.Tensor, biggest_MLN: torch.Tensor, min_tokens: int) -> torch.Tensor:
    """bool ``[M, L]``: balancing (:func:`relibra_torch.planning.balance.replicate`, no
    traffic replicas) may make a copy there (arguments from :func:`_node_loads`). It provably
    makes none where, in every node, either no GPU is above ``target = ceil(node load / g)``
    or every copy would take fewer than ``min_tokens``: a copy takes at most its expert's
    load, and at most the receiver's deficit, which is at most ``target`` minus the node's
    least GPU load (that only rises)."""
    target = (gpu_MLNg.sum(-1) + gpu_MLNg.shape[-1] - 1) // gpu_MLNg.shape[-1]
    most = torch.minimum(target - gpu_MLNg.min(-1).values, biggest_MLN)
    return ~((gpu_MLNg.max(-1).values <= target) | (most < min_tokens)).all(-1)


def _no_residency_copy(load_MLE: torch.Tensor, placement_LE: torch.Tensor, topology: Topology, config,
                       min_tokens: int, node_loads: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether :func:`relibra_torch.planning.balance.replicate_step`'s residency-priced plans
    provably lose to the plan without copies (ties keep it). The step-long set makes no copy
    when relibra plans traffic replicas (it is then not planned) or its step totals allow
    none, and the set over every free slot copies only an expert with ``2 * min_tokens`` step
    tokens; copies sharing one fill (``min_tokens / M`` each) occur only where a copy of that
    size is possible, and there they lower a micro-batch's busiest GPU at most to
    ``max over nodes of ceil(node load / g)`` (copies stay inside a node), while a plan with
    a copy pays at least one fill and one latency. ``node_loads``: :func:`_node_loads` of
    ``load_MLE``."""
    M = load_MLE.shape[0]
    g, N = topology.gpus_per_node, topology.num_nodes
    gpu_MLNg, biggest_MLN = node_loads
    floor_ML = ((gpu_MLNg.sum(-1) + g - 1) // g).amax(-1)
    drop_ML = gpu_MLNg.flatten(2).amax(-1) - floor_ML
    # the step-long set is planned only without traffic replicas (relibra passes them as
    # ``prefilled`` on several nodes); the set over every free slot (planning.step_set) copies
    # only an expert whose step load gives each of two instances ``min_tokens``
    step_set = not (config.cross_node_replicas and N > 1 and topology.replica_slots)
    every_slot = int(load_MLE.sum(0).max()) >= 2 * min_tokens
    if not every_slot and not (step_set and bool(_copy_possible_ML(
            *_node_loads(load_MLE.sum(0, keepdim=True), placement_LE, topology), min_tokens).any())):
        drop_ML = drop_ML * _copy_possible_ML(gpu_MLNg, biggest_MLN, -(-min_tokens // M))
    gain_L = drop_ML.sum(0).to(torch.float64) * config.saved_s_per_token(N)
    return bool((gain_L < config.replica_fill_s_per_expert + config.fill_latency_s(N)).all())


def nothing_pays(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
                 config, coloc_w: float = 0.0) -> bool:
    """True when relibra's full search provably returns the previous placement, no copies."""
    M, L, S, E = loads_MLSE.shape
    N, g, R = topology.num_nodes, topology.gpus_per_node, topology.replica_slots
    own_MLNE = loads_MLSE.view(M, L, N, g, E).sum(3, dtype=torch.int64)       # demand by source node
    load_MLE = own_MLNE.sum(2)
    mt = config.min_replica_tokens_on(N)
    # balance.replicate_step: the per-micro-batch plan makes no copy, and its residency-priced
    # plans are skipped (no expert has mt tokens in the whole step) or provably lose
    if config.balance and R:
        node_loads = _node_loads(load_MLE, previous_placement_LE, topology)
        if bool(_copy_possible_ML(*node_loads, mt).any()) or (
                int(load_MLE.sum(0).max()) >= mt
                and not _no_residency_copy(load_MLE, previous_placement_LE, topology, config, mt, node_loads)):
            return False
    node_LE = previous_placement_LE // topology.experts_per_node
    step_LNE = own_MLNE.sum(0)
    mine_LNE = node_LE.unsqueeze(1) == torch.arange(N).view(1, N, 1)
    if config.cross_node_replicas and N > 1 and R:
        remote_max = int(step_LNE.masked_fill(mine_LNE, 0).max())
        if remote_max * config.cross_node_s_per_token / g > config.cross_replica_fill_s_per_expert:
            return False
    if not config.reorder or N < 2:
        return True
    if coloc_w:
        return False
    two_moves = 2.0 * config.migration_s_per_expert
    onehot_LEN = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
    nl_MLN = torch.einsum("mle,len->mln", load_MLE, onehot_LEN)
    total_ML = load_MLE.sum(-1)
    best_max = ((total_ML + N - 1) // N).sum(0).to(torch.float64)             # [L]
    now_max = nl_MLN.max(-1).values.sum(0).to(torch.float64)
    per_node = E // N
    # load-first objective (relibra._objective): node_w * sum_m max node load + cross_w * pairs
    node_w = (config.compute_s_per_token + config.cross_node_s_per_token) / g
    cross_w = config.cross_node_s_per_token / g
    cross_now = (step_LNE.sum(-1) - (step_LNE * mine_LNE).sum(-1)).sum(-1).to(torch.float64)
    cross_best = _beyond_top(step_LNE, per_node).sum(-1).to(torch.float64)
    if bool(((node_w * (now_max - best_max) + cross_w * (cross_now - cross_best)) > two_moves).any()):
        return False
    if not config.traffic_search:
        return True
    # traffic objective (reorder_traffic.traffic_objective), previous assignment without replicas
    tc = config.compute_s_per_token / g
    crosses = ~mine_LNE
    send_MLN = (own_MLNE * crosses.unsqueeze(0)).sum(-1)
    inflow_MLE = (own_MLNE * crosses.unsqueeze(0)).sum(2)
    recv_MLN = torch.einsum("mle,len->mln", inflow_MLE, onehot_LEN)
    tr_now = torch.maximum(send_MLN, recv_MLN).max(-1).values.sum(0).to(torch.float64)
    slots = g * (R // 2 if config.cross_node_replicas else 0)
    tr_best = _beyond_top(step_LNE, per_node + slots).max(-1).values.to(torch.float64)
    return not bool(((tc * (now_max - best_max) + cross_w * (tr_now - tr_best)) > two_moves).any())


def fast_plan(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor, config,
              coloc_w: float = 0.0) -> StepPlan | None:
    """relibra's plan when :func:`nothing_pays` proves it (else ``None``): the previous
    placement (reordering without ``choose``: in canonical slot order, as :func:`assign_gpus`
    gives it) with every expert on its owner. With ``choose`` only from static placement's GPUs, where
    static placement, one of its alternatives, costs the same."""
    L = loads_MLSE.shape[1]
    El = topology.experts_per_gpu
    prev_gpu_LE = previous_placement_LE // El
    if config.choose and not torch.equal(prev_gpu_LE, topology.static_placement(L) // El):
        return None
    if not nothing_pays(loads_MLSE, topology, previous_placement_LE, config, coloc_w):
        return None
    native_LGl = torch.empty_like(previous_placement_LE).scatter_(
        1, previous_placement_LE, torch.arange(topology.num_experts).expand(L, -1)).view(L, topology.num_gpus, -1)
    canonical = bool((native_LGl[..., 1:] > native_LGl[..., :-1]).all())
    placement_LE = previous_placement_LE.clone()
    # choose keeps the previous placement as it is (every alternative prices the same)
    if config.reorder and not canonical and not config.choose:
        placement_LE = assign_gpus(prev_gpu_LE // topology.gpus_per_node, torch.zeros_like(prev_gpu_LE),
                                   prev_gpu_LE, topology)
    return StepPlan(topology, placement_LE, *native_slots(loads_MLSE, topology, placement_LE), "relibra",
                    previous_placement_LE.clone())


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
