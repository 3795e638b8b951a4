"""Dispatch modes of the token exchange: how many copies of a token cross the network.

Legend (shape suffixes): M micro-batches, L MoE layers, S source ranks (= G), E experts,
G GPUs (node-major), J slots per GPU, X = G * J slots, N nodes, T tokens, K top-k.

* ``flat`` (the default, today's model): one copy per (token, expert) pair. A pair whose
  destination GPU is on another node crosses the inter-node network; one on another GPU of
  the same node crosses NVLink. ``evaluate`` counts exactly these.
* ``hierarchical`` (DeepEP's internode kernels, NVIDIA HybridEP): a token crosses to each
  remote node **at most once**, lands on the GPU of that node with the same local index as
  its source, and fans out over NVLink from there. Per GPU, per (token, remote node):
  one inter-node send at the source, one inter-node receive at the landing GPU; per
  (token, expert) pair whose destination GPU is not the landing GPU, one NVLink send at
  the landing GPU and one NVLink receive at the destination (a pair per copy, as in flat
  mode; DeepEP would merge two pairs bound to one GPU, which this leaves out). Pairs that
  stay in their source's node travel as in flat mode.

Which remote nodes a token needs depends on its whole top-k set:

* **exact** (routing replay files): every (token, k) pair's destination slot follows the
  plan's :func:`~relibra_torch.planning.token_split` quotas and the layer's rule
  (``relibra_torch.moe.schedule.assign_slots``: a source's pairs of expert ``e``, in flat
  ``t * K + k`` order, fill ``e``'s instances in slot order up to each quota), so each
  token's set of destination nodes is counted exactly;
* **estimated** (loads files, count-only synthetic traces): with ``f[s, n, e]`` the
  split's pairs of expert ``e`` that source ``s`` sends to node ``n``, ``T_s`` its tokens and
  ``p_e = f / T_s``, the chance that a token of ``s`` needs node ``n`` is
  ``1 - min(P_indep, P_draws)``, clipped to ``[max_e p_e, sum_e p_e]`` (bounds that always
  hold), where

  - ``P_indep = prod_e (1 - p_e)``: experts chosen independently (right when a few hot
    experts are chosen by most tokens);
  - ``P_draws = prod_{i < K} (1 - Q / (1 - i * rho))``: the token's ``K`` experts as ``K``
    successive draws without replacement with draw probabilities ``r = p / K``; ``Q`` is
    node ``n``'s mass ``sum_e r_e`` and ``rho = sum_{other nodes} r^2 / (1 - Q)`` the mass an
    expert drawn elsewhere takes out of the pool. Exact for uniform routing (it is then
    ``C(E - a, K) / C(E, K)`` for a node holding ``a`` experts) and for top-1.

  Both terms over-state the chance of needing no expert on ``n`` in the cases checked, so
  the smaller is used. Measured against the exact count on routing with per-sample expert
  preferences (``tests/test_sim_dispatch.py``): total cross-node bytes within 0.3%; see
  docs/simulator.md for a measurement on the synthetic trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..planning.evaluate import PlanMetrics
from ..planning.plan import StepPlan, token_split
from ..planning.topology import Topology

__all__ = ["DISPATCH_MODES", "TokenRouting", "approx_cross_tokens", "exact_cross_tokens",
           "hierarchical_traffic", "hierarchical_metrics", "token_routing_from_bins",
           "uniform_remote_node_probability",
           "ESTIMATE_NOTE", "EXACT_NOTE"]

DISPATCH_MODES = ("flat", "hierarchical")

ESTIMATE_NOTE = ("hierarchical dispatch, remote nodes per token estimated from counts: "
                 "P(token of rank s needs node n) = 1 - min(prod_e (1 - p_e), "
                 "prod_(i<K) (1 - Q/(1 - i rho))), p_e = f(s,n,e)/T_s (f: pairs of expert e that s "
                 "sends to node n, T_s: its tokens), Q = sum_e p_e/K, rho = mass of an expert drawn "
                 "from other nodes (independent experts, or K draws without replacement; exact for "
                 "uniform routing and top-1; see docs/simulator.md)")
EXACT_NOTE = "hierarchical dispatch, remote nodes per token exact (per-token expert sets of the routing file)"


@dataclass
class TokenRouting:
    """Per-token expert ids of a workload, grouped into (micro-batch, source rank) bins.

    Attributes:
        routed_experts_TLK: int ``[T, L, K]`` expert ids of every token (``-1``: a pad).
        token_index: one int64 ``[T_x]`` tensor per step: rows of ``routed_experts_TLK``
            ordered by (micro-batch, source rank), each bin's samples in file order (the
            order a trainer concatenates them in).
        bin_offsets: one int64 ``[M * S + 1]`` tensor per step: bin ``m * S + s`` holds
            ``token_index[x][bin_offsets[x][b] : bin_offsets[x][b + 1]]``.
        num_ranks: ``S``.
    """

    routed_experts_TLK: torch.Tensor
    token_index: list[torch.Tensor]
    bin_offsets: list[torch.Tensor]
    num_ranks: int

    def micro_batch(self, x: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows_T, source_T)`` of micro-batch ``m`` of step ``x``: the rows of
        ``routed_experts_TLK`` holding its tokens (sources in rank order, each in file order)
        and the source rank of each token (int64 ``[T_m]`` both; ids are gathered one layer
        at a time by :func:`exact_cross_tokens`, so memory stays ``O(T_m K)``)."""
        S = self.num_ranks
        offs = self.bin_offsets[x][m * S : (m + 1) * S + 1]
        rows = self.token_index[x][int(offs[0]) : int(offs[-1])]
        source_T = torch.repeat_interleave(torch.arange(S), offs[1:] - offs[:-1])
        return rows, source_T


def token_routing_from_bins(routed_experts_TLK: torch.Tensor, sample_offsets_N1: torch.Tensor,
                            bin_N: list[torch.Tensor], sample_ids: list[torch.Tensor],
                            num_bins: int, num_ranks: int) -> TokenRouting:
    """Build a :class:`TokenRouting` from per-step sample bins.

    Args:
        routed_experts_TLK: the file's ids; sample_offsets_N1: int64 ``[N + 1]``.
        bin_N: per step, int64 ``[n_x]`` bin ``m * S + s`` of each of the step's samples.
        sample_ids: per step, int64 ``[n_x]`` the samples (indices into the file), file order.
        num_bins: ``M * S``; num_ranks: ``S``.
    """
    token_index, bin_offsets = [], []
    for bins, ids in zip(bin_N, sample_ids):
        order = (bins * (ids.numel() + 1) + torch.arange(ids.numel())).argsort()  # bin, then file order
        ids_sorted = ids[order]
        starts = sample_offsets_N1[ids_sorted]
        lengths = sample_offsets_N1[ids_sorted + 1] - starts
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        token_index.append(torch.repeat_interleave(starts, lengths) + within)
        per_bin = torch.zeros(num_bins, dtype=torch.int64).index_add_(0, bins, sample_offsets_N1[ids + 1]
                                                                      - sample_offsets_N1[ids])
        offs = torch.zeros(num_bins + 1, dtype=torch.int64)
        offs[1:] = per_bin.cumsum(0)
        bin_offsets.append(offs)
    return TokenRouting(routed_experts_TLK, token_index, bin_offsets, num_ranks)


def uniform_remote_node_probability(num_experts: int, top_k: int, num_nodes: int) -> float:
    """Chance that a token with ``top_k`` distinct uniform experts needs a given remote node
    holding ``num_experts / num_nodes`` of them: ``1 - C(E - E/N, K) / C(E, K)``."""
    if num_nodes <= 1:
        return 0.0
    others = num_experts - num_experts // num_nodes
    return 1.0 - math.comb(others, top_k) / math.comb(num_experts, top_k)


def _flow_LSNE(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, topo: Topology) -> torch.Tensor:
    """int64 ``[L, S, N, E]``: pairs of expert ``e`` that source ``s`` sends to node ``n``."""
    L, S, G, J = split_LSGJ.shape
    N, E = topo.num_nodes, topo.num_experts
    e_LX = slot_expert_LGJ.reshape(L, G * J)
    valid_LX = e_LX >= 0
    node_X = torch.arange(G * J) // (J * topo.gpus_per_node)
    idx_LX = node_X * E + e_LX.clamp(min=0)
    vals = split_LSGJ.reshape(L, S, G * J) * valid_LX.unsqueeze(1)
    out = torch.zeros(L, S, N * E, dtype=torch.int64)
    out.scatter_add_(2, idx_LX.unsqueeze(1).expand(L, S, G * J), vals)
    return out.view(L, S, N, E)


def approx_cross_tokens(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, tokens_S: torch.Tensor,
                        top_k: int, topo: Topology) -> torch.Tensor:
    """float64 ``[L, S, N]``: expected tokens of source ``s`` that need remote node ``n``
    (0 for the source's own node), estimated from counts (see the module docstring)."""
    flow = _flow_LSNE(split_LSGJ, slot_expert_LGJ, topo).to(torch.float64)
    T = tokens_S.to(torch.float64).view(1, -1, 1, 1)
    p = torch.where(T > 0, flow / T.clamp(min=1.0), torch.zeros_like(flow)).clamp(0.0, 1.0)
    none_indep = torch.log1p(-p).sum(-1).exp()
    # K successive draws without replacement, draw probabilities r = p / K: the next draw
    # hits node n with n's mass over the mass left, after i draws elsewhere have each
    # removed rho (the expected mass of an item drawn from the other nodes' pieces).
    r = p / top_k
    mass_SN = r.sum(-1).clamp(max=1.0)
    sq_SN = (r * r).sum(-1)
    rest = (1.0 - mass_SN).clamp(min=1e-12)
    rho = ((sq_SN.sum(-1, keepdim=True) - sq_SN) / rest).clamp(min=0.0)
    none_draws = torch.ones_like(mass_SN)
    for i in range(top_k):
        left = (1.0 - i * rho).clamp(min=1e-12)
        none_draws = none_draws * (1.0 - mass_SN / left).clamp(0.0, 1.0)
    need = 1.0 - torch.minimum(none_indep, none_draws)
    # always-true bounds: at least the most-chosen piece, at most the expected pairs
    need = torch.minimum(torch.maximum(need, p.amax(-1)), p.sum(-1))
    S, N, g = topo.num_gpus, topo.num_nodes, topo.gpus_per_node
    own = torch.nn.functional.one_hot(torch.arange(S) // g, N).bool()
    return (need * T.view(1, -1, 1)).masked_fill(own.unsqueeze(0), 0.0)


def exact_cross_tokens(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, ids_TLK: torch.Tensor,
                       source_T: torch.Tensor, topo: Topology, rows_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[L, S, N]``: tokens of source ``s`` with at least one pair bound for remote
    node ``n`` (0 for the own node), from the per-token ids of one micro-batch.

    ``ids_TLK`` holds the micro-batch's ids (token ``t`` from source ``source_T[t]``,
    sources in rank order), or, with ``rows_T``, a larger table whose rows ``rows_T`` are
    the micro-batch's tokens (gathered one layer at a time).

    Pairs go to slots by the layer's rule: source ``s``'s pairs of expert ``e`` in flat
    ``t * K + k`` order fill ``e``'s instances in slot order, each up to its quota
    ``split[s, g, j]``. One layer at a time (memory ``O(T K)``).
    """
    L, S, G, J = split_LSGJ.shape
    X, E, N = G * J, topo.num_experts, topo.num_nodes
    K = ids_TLK.shape[2]
    T = source_T.numel()
    node_S = torch.arange(S) // topo.gpus_per_node
    out = torch.zeros(L, S, N, dtype=torch.int64)
    src_pair = source_T.repeat_interleave(K)
    token_pair = torch.arange(T).repeat_interleave(K)
    for l in range(L):
        e_X = slot_expert_LGJ[l].reshape(X)
        # Slots sorted by (expert, slot); empty slots (-1, quota 0) first.
        order_X = (e_X * X + torch.arange(X)).argsort()
        quota_SX = (split_LSGJ[l].reshape(S, X) * (e_X >= 0))[:, order_X]
        cum = quota_SX.reshape(-1).cumsum(0)
        ids_TK = ids_TLK[:, l] if rows_T is None else ids_TLK[rows_T, l]
        e_P = ids_TK.to(torch.int64).reshape(-1)
        keep = e_P >= 0
        e_P, s_P, t_P = e_P[keep], src_pair[keep], token_pair[keep]
        # Position of each pair in (source, expert, flat index) order = its place in the
        # concatenated (source, sorted slot) quota runs.
        rank_P = (s_P * E + e_P).argsort(stable=True)
        pos_P = torch.empty_like(rank_P).scatter_(0, rank_P, torch.arange(rank_P.numel()))
        if cum.numel() and int(cum[-1]) != pos_P.numel():
            raise ValueError(f"layer {l}: the plan's split holds {int(cum[-1])} pairs but the routing "
                             f"has {pos_P.numel()}; the loads were not counted from these ids")
        q = torch.searchsorted(cum, pos_P, right=True).clamp(max=S * X - 1)
        dest_node = order_X[q % X] // (J * topo.gpus_per_node)
        need = torch.zeros(T, N, dtype=torch.bool)
        need[t_P, dest_node] = True
        need[torch.arange(T), node_S[source_T]] = False
        out[l].index_add_(0, source_T, need.to(torch.int64))
    return out


def hierarchical_traffic(split_LSG: torch.Tensor, cross_tokens_LSN: torch.Tensor, topo: Topology
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-GPU ``(cross_send, cross_recv, intra_send, intra_recv)`` ``[L, G]`` of one
    micro-batch under hierarchical dispatch.

    Args:
        split_LSG: pairs source ``s`` sends to GPU ``g`` (the split summed over slots).
        cross_tokens_LSN: tokens of source ``s`` that cross to remote node ``n``.
    Cross-node units are tokens (one copy per token and remote node), NVLink units pairs.
    """
    L, S, G = split_LSG.shape
    g, N = topo.gpus_per_node, topo.num_nodes
    node_S, local_S = torch.arange(S) // g, torch.arange(S) % g
    dtype = cross_tokens_LSN.dtype
    cross_send = cross_tokens_LSN.sum(-1)
    land_SN = torch.arange(N).view(1, N) * g + local_S.view(S, 1)  # landing GPU of (source, node)
    cross_recv = torch.zeros(L, G, dtype=dtype).scatter_add_(
        1, land_SN.reshape(1, S * N).expand(L, S * N), cross_tokens_LSN.reshape(L, S * N))
    same_node = node_S.view(S, 1) == node_S.view(1, G)
    dst_G = torch.arange(G)
    local = split_LSG * (same_node & (torch.arange(S).view(S, 1) != dst_G.view(1, G)))
    land_SG = (dst_G // g).view(1, G) * g + local_S.view(S, 1)
    fwd = split_LSG * (~same_node & (land_SG != dst_G.view(1, G)))
    intra_send = local.sum(2).to(dtype).scatter_add_(
        1, land_SG.reshape(1, S * G).expand(L, S * G), fwd.reshape(L, S * G).to(dtype))
    intra_recv = (local.sum(1) + fwd.sum(1)).to(dtype)
    return cross_send, cross_recv, intra_send, intra_recv


def hierarchical_metrics(plan: StepPlan, metrics: PlanMetrics, loads_MLSE: torch.Tensor,
                         tokens_MS: torch.Tensor, top_k: int, routing: TokenRouting | None = None,
                         step: int = 0) -> PlanMetrics:
    """``metrics`` with its four traffic fields replaced by hierarchical-dispatch counts.

    Exact when ``routing`` is given (its step ``step``), estimated from counts otherwise.
    The replaced fields are int64 when exact, float64 (expected tokens) when estimated.
    """
    topo = plan.topology
    M = loads_MLSE.shape[0]
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    for m in range(M):  # one micro-batch at a time keeps the [L, S, G, J] split small
        split_LSGJ = token_split(plan.micro_batch(m), loads_MLSE[m : m + 1])[0]
        slot_expert_LGJ = plan.slot_expert_MLGJ[m]
        if routing is not None:
            rows_T, source_T = routing.micro_batch(step, m)
            cross = exact_cross_tokens(split_LSGJ, slot_expert_LGJ, routing.routed_experts_TLK, source_T,
                                       topo, rows_T)
        else:
            cross = approx_cross_tokens(split_LSGJ, slot_expert_LGJ, tokens_MS[m], top_k, topo)
        for acc, t in zip(parts, hierarchical_traffic(split_LSGJ.sum(-1), cross, topo)):
            acc.append(t)
    cs, cr, is_, ir = (torch.stack(p) for p in parts)
    return replace(metrics, cross_send_MLG=cs, cross_recv_MLG=cr, intra_send_MLG=is_, intra_recv_MLG=ir)
