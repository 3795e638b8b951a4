"""A lower bound on the step time that no plan can beat, and "balanced at its own bytes".

Legend (shape suffixes): M micro-batches, L MoE layers, S source ranks (= G), E experts,
N nodes, g GPUs per node, G GPUs, J slots per GPU.

The cost model (:mod:`relibra_torch.sim.cost`) charges, per step,

    sum over (m, l) of [expert(max_q load_q) + 4 * max_q a2a_q + exposed fill + planning]
    + attention/dense + migration

where ``a2a_q = b * (max(cs_q, cr_q) / X + max(is_q, ir_q) / V)`` (``b`` bytes per token,
``X`` / ``V`` inter-node / NVLink bytes per second; ``cs``, ``cr``: copies GPU ``q`` sends to /
receives from other nodes, ``is``, ``ir``: the same inside its node). Expert compute and the
all-to-all are two separate maxima over GPUs, so a lower bound on each, summed, bounds the
step. :func:`bound_step_cost` takes:

* attention and dense layers at their exact value (the same for every plan);
* fills, gradient returns, migration and planning at 0 (every one is ``>= 0``);
* expert compute at ``ceil(total / G)``: the GPU loads sum to the micro-batch's pairs;
* the all-to-all at ``b * max(per GPU, per node, global)`` (docs/simulator.md, "The lower
  bound"), from what must move whatever the plan:

  - a GPU holds at most ``J`` distinct experts, so at least ``Lm_q = pairs_q - top_J(q)``
    of source ``q``'s pairs leave it (to another node, or over NVLink);
  - a node holds at most ``g * J`` distinct experts, so at least
    ``Cmin_n = D_n - top_gJ(D_n)`` of its sources' pairs cross nodes (``D_n``: the node's
    demand per expert), and ``cmin_q = pairs_q - top_gJ(q)`` of source ``q``'s;
  - a cross pair costs its source ``1 / (kappa_q X)``: ``kappa = 1`` in flat dispatch (one
    copy per pair); in hierarchical dispatch one copy per (token, remote node) carries up
    to ``K`` pairs, so ``kappa_q = K * max(1, max_e load_qe / T_q, pairs_q / (K T_q))``
    (``K`` alone for top-k routing; the other factors keep it a bound for the cost model's
    count-level estimate on inconsistent counts). Only counts are used, also with a routing
    file: a looser but true bound;
  - an NVLink pair costs ``1 / V`` in flat dispatch; in hierarchical dispatch one NVLink row
    per (token, destination GPU) carries up to ``min(K, J)`` of the token's pairs (a GPU
    holds at most ``J`` distinct experts), so ``1 / (min(K, J) V)``; forwarded rows
    (hierarchical) are left out (``>= 0``);
  - with relays (``planning.relay``: hierarchical, ``N > 1``, ``g > 1``) a GPU may hand a token
    (up to ``K`` pairs) to another GPU of its node, which sends its inter-node rows: the per-GPU
    term is ``Lm_q min(1 / (kappa_q X), 1 / (K V))``; the node and global terms keep their form
    and their NVLink price (any NVLink row, relay or forward, delivers at most ``min(K, J)``
    pairs to the GPU that computes them, and the relay's own stage only adds).

  Per GPU ``a2a_q >= b * min over c >= cmin_q of [c / (kappa_q X) + max(0, Lm_q - c) / V]``;
  the busiest GPU of a node carries at least the node's mean, with ``c`` summed over the node
  and ``>= Cmin_n``; the global mean is the same over all GPUs (never above the busiest
  node's, kept as a check). A convex piecewise-linear function of ``c`` takes its minimum at
  ``c = lower end`` or at its kink ``c = Lm``, so each minimum is one of two values.

:func:`balanced_at_own_bytes_s` is a reference per system, not a bound: attention/dense,
the mean expert load, and per (m, l) the system's own cross-node and NVLink copies spread
evenly over the GPUs; fills, migration and planning left out. The step minus it is what
imbalance (and fills, migration, planning) costs; it minus the bound is what the system's
extra traffic costs (it can fall below the bound where one node must send more than the
mean).
"""

from __future__ import annotations

import math

import torch

from ..planning.evaluate import PlanMetrics
from ..planning.topology import Topology
from .cost import CostModel, StepCost

__all__ = ["REFERENCES", "a2a_lower_bound_ML", "bound_step_cost", "balanced_at_own_bytes_s", "must_cross_pairs_MLN"]

# The simulator's two references, priced here: no planner, no weights of their own.
# uniform: uniform routing on balanced GPUs (balanced_at_own_bytes_s); bound: the lower bound.
REFERENCES = ("uniform", "bound")


def _top_sum(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sum of the ``k`` largest entries along the last dim (all when ``k >= size``)."""
    k = min(k, x.shape[-1])
    return x.topk(k, dim=-1).values.sum(-1) if k > 0 else torch.zeros(x.shape[:-1], dtype=x.dtype)


def must_cross_pairs_MLN(loads_MLSE: torch.Tensor, topology: Topology) -> torch.Tensor:
    """float64 ``[M, L, N]``: pairs of node ``n``'s sources that must cross nodes under any
    plan, ``D_n - top_gJ(D_n)`` (a node holds at most ``g * J`` distinct experts)."""
    M, L, S, E = loads_MLSE.shape
    N, g, J = topology.num_nodes, topology.gpus_per_node, topology.slots_per_gpu
    D_MLNE = loads_MLSE.to(torch.float64).view(M, L, N, g, E).sum(3)
    return D_MLNE.sum(-1) - _top_sum(D_MLNE, g * J)


def _min_cost(lo, kink, a, v):
    """``min over c >= lo of a c + v max(0, kink - c)`` (convex: at ``lo`` or ``max(lo, kink)``)."""
    hi = torch.maximum(lo, kink)
    f_lo = a * lo + v * (kink - lo).clamp(min=0)
    f_hi = a * hi
    return torch.minimum(f_lo, f_hi)


def a2a_lower_bound_ML(loads_MLSE: torch.Tensor, tokens_MS: torch.Tensor, topology: Topology,
                       cost: CostModel, top_k: int) -> torch.Tensor:
    """float64 ``[M, L]``: a lower bound on one all-to-all (``CostModel.all_to_all_s``) of
    every plan, in seconds (see the module docstring; derivation in docs/simulator.md)."""
    M, L, S, E = loads_MLSE.shape
    N, g, J = topology.num_nodes, topology.gpus_per_node, topology.slots_per_gpu
    loads = loads_MLSE.to(torch.float64)
    pairs_MLS = loads.sum(-1)
    leave_MLS = pairs_MLS - _top_sum(loads, J)                     # must leave the source GPU
    cmin_MLS = pairs_MLS - _top_sum(loads, g * J)                  # must leave the source's node
    leave_MLS = torch.maximum(leave_MLS, cmin_MLS)
    X, V = cost.inter_node_bytes_per_s, cost.nvlink_bytes_per_s
    if cost.options.dispatch == "hierarchical":
        T = tokens_MS.to(torch.float64).view(M, 1, S)
        ratio = torch.maximum(loads.amax(-1) / T.clamp(min=1), pairs_MLS / (top_k * T.clamp(min=1)))
        kappa_MLS = top_k * ratio.clamp(min=1.0)
        # a source with pairs but no tokens is counted no crossings by the estimate: free
        kappa_MLS = torch.where((T == 0) & (pairs_MLS > 0), math.inf, kappa_MLS)
    else:
        kappa_MLS = torch.ones_like(pairs_MLS)
    a_MLS = 1.0 / (kappa_MLS * X)
    # NVLink rows: per pair (flat); per (token, destination GPU) (hierarchical), at most min(K, J)
    # pairs each; where relays can run (hierarchical, N > 1, g > 1) a relayed token's row carries
    # up to K pairs, and its inter-node rows leave from another GPU of the node
    relays = cost.options.dispatch == "hierarchical" and N > 1 and g > 1
    v = 1.0 / (V * (min(top_k, J) if cost.options.dispatch == "hierarchical" else 1))
    # a relay row takes up to K pairs off its source (per-GPU term), but any NVLink row delivers
    # at most min(K, J) pairs to the GPU that computes them (the node and global sums keep v)
    v_relay = torch.full_like(a_MLS, 1.0 / (V * top_k))
    gpu_ML = ((leave_MLS * torch.minimum(a_MLS, v_relay)) if relays
              else _min_cost(cmin_MLS, leave_MLS, a_MLS, v)).amax(-1)
    a_MLN = a_MLS.view(M, L, N, g).amin(-1)
    cn_MLN = must_cross_pairs_MLN(loads_MLSE, topology)
    leave_MLN = torch.maximum(leave_MLS.view(M, L, N, g).sum(-1), cn_MLN)
    node_ML = (_min_cost(cn_MLN, leave_MLN, a_MLN, v) / g).amax(-1)
    c_ML = cn_MLN.sum(-1)
    glob_ML = _min_cost(c_ML, torch.maximum(leave_MLS.sum(-1), c_ML), a_MLS.amin(-1), v) / (N * g)
    return cost.token_bytes * torch.maximum(torch.maximum(gpu_ML, node_ML), glob_ML)


def bound_step_cost(cost: CostModel, loads_MLSE: torch.Tensor, topology: Topology,
                    tokens_MS: torch.Tensor, attn_pairs_MS: torch.Tensor) -> StepCost:
    """The lower bound as a :class:`StepCost` (expert compute at the mean load rounded up,
    the all-to-all bound, attention/dense exact, nothing else). Its byte figures are what
    must cross nodes (flat: pairs; hierarchical: the copies those pairs need at least) and
    0 inside nodes."""
    M, L, S, E = loads_MLSE.shape
    G = topology.num_gpus
    total_ML = loads_MLSE.to(torch.int64).sum((2, 3))
    expert_fwd, expert_bwd = cost.expert_compute_s((total_ML + G - 1) // G)
    a2a_one = a2a_lower_bound_ML(loads_MLSE, tokens_MS, topology, cost, cost.model.top_k)
    cross = float(must_cross_pairs_MLN(loads_MLSE, topology).sum())
    if cost.options.dispatch == "hierarchical":
        cross /= cost.model.top_k
    zero = torch.zeros(M, L, dtype=torch.float64)
    dense = cost.dense_s(tokens_MS, attn_pairs_MS)
    # every plan's layer runs the token exchange's collectives (fills and plan check aside)
    latency_ML = cost.collective_latency_s(
        torch.full((M, L), cost.exchange_collectives(topology.num_nodes, topology.gpus_per_node)), topology.num_nodes)
    return cost._combine(expert_fwd, expert_bwd, a2a_one, zero, zero, dense, 0.0, 0, 0.0, cross, 0.0, 0.0,
                         latency_s_ML=latency_ML)


def balanced_at_own_bytes_s(cost: CostModel, metrics: PlanMetrics, tokens_MS: torch.Tensor,
                            attn_pairs_MS: torch.Tensor, topology: Topology) -> float:
    """Step seconds of a plan's own traffic with every GPU balanced: attention/dense, expert
    compute at the mean load, and per (m, l) the plan's cross-node and NVLink copies (the
    dispatch mode's counts, ``metrics``) spread evenly over the GPUs; no fills, migration or
    planning. A reference, not a bound."""
    G = metrics.gpu_load_MLG.shape[-1]
    mean_ML = metrics.gpu_load_MLG.to(torch.float64).mean(-1)
    fwd, bwd = cost.expert_compute_s(mean_ML)
    cross_ML = metrics.cross_send_MLG.to(torch.float64).sum(-1) / G
    intra_ML = metrics.intra_send_MLG.to(torch.float64).sum(-1) / G
    if metrics.relay_send_MLG is not None:  # relayed tokens: NVLink rows of their own stage
        intra_ML = intra_ML + metrics.relay_send_MLG.to(torch.float64).sum(-1) / G
    a2a_ML = cost.token_bytes * (cross_ML / cost.inter_node_bytes_per_s + intra_ML / cost.nvlink_bytes_per_s)
    dense = cost.dense_s(tokens_MS, attn_pairs_MS)
    # plus the fixed latency of the token exchange and plan check every layer runs (fills aside)
    M, L, _ = metrics.gpu_load_MLG.shape
    n = cost.exchange_collectives(topology.num_nodes, topology.gpus_per_node) + int(G > 1)
    latency = float(cost.collective_latency_s(torch.full((M, L), n), topology.num_nodes).sum())
    return float((fwd + bwd + 4.0 * a2a_ML).sum()) + float(dense["total"].sum()) + latency
