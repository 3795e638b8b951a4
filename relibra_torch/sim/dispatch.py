"""Dispatch modes of the token exchange: how many copies of a token cross the network.

Legend (shape suffixes): M micro-batches, L MoE layers, S source ranks (= G), E experts,
G GPUs (node-major), J slots per GPU, X = G * J slots, N nodes, T tokens, K top-k.

* ``flat`` (the default, today's model): one copy per (token, expert) pair. A pair whose
  destination GPU is on another node crosses the inter-node network; one on another GPU of
  the same node crosses NVLink. ``evaluate`` counts exactly these.
* ``hierarchical`` (DeepEP's normal mode, NVIDIA HybridEP; what the layer runs with
  ``dispatch="hierarchical"``, ``distributed/hierarchical.py``): a token crosses to each
  remote node **at most once**, lands on the GPU of that node with the same local index as
  its source, and fans out over NVLink from there, **one row per (token, GPU)**. Per GPU:
  one inter-node send per (token, remote node) at the source and one receive at the
  landing GPU; one NVLink send per (token, GPU of its own node other than itself) at the
  source, and one per (token, GPU of a remote node other than the landing GPU) at the
  landing GPU, each received by that GPU. (Before the layer ran hierarchical dispatch NVLink was counted per pair;
  the layer, like DeepEP, sends a token to a GPU once however many of its experts that
  GPU holds, so this module now counts what the layer sends.)

Which remote nodes and GPUs a token needs depends on its whole top-k set:

* **exact** (routing replay files): every (token, k) pair's destination slot follows the
  plan's :func:`~relibra_torch.planning.token_split` quotas and the layer's own rule, the
  one function both call (:func:`relibra_torch.planning.pair_slots.assign_pair_slots`: a
  source's pairs of expert ``e``, in flat ``t * K + k`` order, fill ``e``'s instances in
  slot order up to each quota), so each token's sets of destination nodes and GPUs are
  counted exactly (:func:`hierarchical_rows` gives the layer's per-GPU rows);
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
  the smaller is used. The same estimate over GPUs instead of nodes gives the (token, GPU)
  rows of the NVLink stage. Measured against the exact count on routing with per-sample expert
  preferences (``tests/test_sim_dispatch.py``): total cross-node bytes within 0.3%; see
  docs/simulator.md for a measurement on the synthetic trace.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from ..planning.evaluate import PlanMetrics
from ..planning.pair_slots import DISPATCH_MODES, assign_pair_slots, slot_quota_runs
from ..planning.plan import StepPlan, token_split
from ..planning.relay import exec_ranks, relay_rows, relayed_counts
from ..planning.hier_estimate import approx_need as _approx_need
from ..planning.hier_estimate import hierarchical_traffic
from ..planning.topology import Topology

__all__ = ["DISPATCH_MODES", "TokenRouting", "approx_cross_tokens", "approx_gpu_copies", "exact_copies",
           "exact_cross_tokens", "hierarchical_traffic", "hierarchical_metrics", "hierarchical_rows",
           "token_routing_from_bins",
           "uniform_remote_node_probability",
           "ESTIMATE_NOTE", "EXACT_NOTE"]

ESTIMATE_NOTE = ("hierarchical dispatch, remote nodes per token estimated from counts: "
                 "P(token of rank s needs node n) = 1 - min(prod_e (1 - p_e), "
                 "prod_(i<K) (1 - Q/(1 - i rho))), p_e = f(s,n,e)/T_s (f: pairs of expert e that s "
                 "sends to node n, T_s: its tokens), Q = sum_e p_e/K, rho = mass of an expert drawn "
                 "from other nodes (independent experts, or K draws without replacement; exact for "
                 "uniform routing and top-1; see docs/simulator.md); NVLink rows per (token, GPU) by the "
                 "same estimate over GPUs")
EXACT_NOTE = ("hierarchical dispatch, remote nodes and GPUs per token exact (per-token expert sets of the "
              "routing file)")


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


def _flow_LSPE(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, piece_X: torch.Tensor,
               pieces: int, num_experts: int) -> torch.Tensor:
    """int64 ``[L, S, P, E]``: pairs of expert ``e`` that source ``s`` sends to piece ``p``
    (a node, or a GPU) of the slots, ``piece_X`` the piece of every slot."""
    L, S, G, J = split_LSGJ.shape
    E = num_experts
    e_LX = slot_expert_LGJ.reshape(L, G * J)
    valid_LX = e_LX >= 0
    idx_LX = piece_X * E + e_LX.clamp(min=0)
    vals = split_LSGJ.reshape(L, S, G * J) * valid_LX.unsqueeze(1)
    out = torch.zeros(L, S, pieces * E, dtype=torch.int64)
    out.scatter_add_(2, idx_LX.unsqueeze(1).expand(L, S, G * J), vals)
    return out.view(L, S, pieces, E)


def approx_cross_tokens(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, tokens_S: torch.Tensor,
                        top_k: int, topo: Topology) -> torch.Tensor:
    """float64 ``[L, S, N]``: expected tokens of source ``s`` that need remote node ``n``
    (0 for the source's own node), estimated from counts (see the module docstring)."""
    G, J, g, N = topo.num_gpus, topo.slots_per_gpu, topo.gpus_per_node, topo.num_nodes
    flow = _flow_LSPE(split_LSGJ, slot_expert_LGJ, torch.arange(G * J) // (J * g), N, topo.num_experts)
    own = torch.nn.functional.one_hot(torch.arange(G) // g, N).bool()
    return _approx_need(flow, tokens_S, top_k).masked_fill(own.unsqueeze(0), 0.0)


def approx_gpu_copies(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, tokens_S: torch.Tensor,
                      top_k: int, topo: Topology) -> torch.Tensor:
    """float64 ``[L, S, G]``: expected tokens of source ``s`` with a pair on GPU ``g``, the
    same estimate over GPUs instead of nodes."""
    # A GPU holds at most one instance of an expert, so its slots are its pieces' experts:
    # the split itself is the flow ([L, S, G, J], not [L, S, G, E]; 0 on empty slots).
    flow = split_LSGJ * (slot_expert_LGJ >= 0).unsqueeze(1)
    return _approx_need(flow, tokens_S, top_k)


def exact_copies(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, ids_TLK: torch.Tensor,
                 source_T: torch.Tensor, topo: Topology, rows_T: torch.Tensor | None = None,
                 relay_LSg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cross_LSN, copies_LSG)`` int64: tokens of source ``s`` with at least one pair bound
    for remote node ``n`` (0 for the own node), and with at least one pair on GPU ``g``,
    from the per-token ids of one micro-batch.

    ``ids_TLK`` holds the micro-batch's ids (token ``t`` from source ``source_T[t]``,
    sources in rank order), or, with ``rows_T``, a larger table whose rows ``rows_T`` are
    the micro-batch's tokens (gathered one layer at a time).

    Pairs go to slots by the layer's own rule, :func:`planning.pair_slots.assign_pair_slots`
    (a source's pairs of expert ``e`` in flat ``t * K + k`` order fill ``e``'s instances in
    slot order, each up to its quota ``split[s, g, j]``). One layer at a time (memory ``O(T K)``).
    With ``relay_LSg`` (``planning.relay``) a relayed token is counted for the GPU that exchanges
    it (its slots still follow its source's quotas): ``[L, S, ...]`` are then per exchanging GPU.
    """
    L, S, G, J = split_LSGJ.shape
    X, E, N, g = G * J, topo.num_experts, topo.num_nodes, topo.gpus_per_node
    T = source_T.numel()
    node_S = torch.arange(S) // g
    cross = torch.zeros(L, S, N, dtype=torch.int64)
    copies = torch.zeros(L, S, G, dtype=torch.int64)
    for l in range(L):
        order_X, cum_R = slot_quota_runs(slot_expert_LGJ[l].reshape(X), split_LSGJ[l].reshape(S, X))
        ids_TK = (ids_TLK[:, l] if rows_T is None else ids_TLK[rows_T, l]).to(torch.int64)
        real = int((ids_TK >= 0).sum())
        if int(cum_R[-1]) != real:
            raise ValueError(f"layer {l}: the plan's split holds {int(cum_R[-1])} pairs but the routing "
                             f"has {real}; the loads were not counted from these ids")
        dest_TK = assign_pair_slots(ids_TK, order_X, cum_R, E, source_T)
        gpu_TK = torch.where(dest_TK < X, dest_TK // J, G)
        need_TG = torch.zeros(T, G + 1, dtype=torch.bool).scatter_(1, gpu_TK, True)[:, :G]
        need_TN = need_TG.view(T, N, g).any(-1)
        need_TN[torch.arange(T), node_S[source_T]] = False
        at_T = source_T if relay_LSg is None or not relay_LSg[l].any() else exec_ranks(source_T, relay_LSg[l], g)
        cross[l].index_add_(0, at_T, need_TN.to(torch.int64))
        copies[l].index_add_(0, at_T, need_TG.to(torch.int64))
    return cross, copies


def exact_cross_tokens(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, ids_TLK: torch.Tensor,
                       source_T: torch.Tensor, topo: Topology, rows_T: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[L, S, N]``: the first part of :func:`exact_copies`."""
    return exact_copies(split_LSGJ, slot_expert_LGJ, ids_TLK, source_T, topo, rows_T)[0]


def hierarchical_metrics(plan: StepPlan, metrics: PlanMetrics, loads_MLSE: torch.Tensor,
                         tokens_MS: torch.Tensor, top_k: int, routing: TokenRouting | None = None,
                         step: int = 0) -> PlanMetrics:
    """``metrics`` with its four traffic fields replaced by hierarchical-dispatch counts.

    Exact when ``routing`` is given (its step ``step``), estimated from counts otherwise.
    The replaced fields are int64 when exact, float64 (expected tokens) when estimated.
    """
    topo = plan.topology
    M, L = loads_MLSE.shape[:2]
    parts: list[list[torch.Tensor]] = [[], [], [], [], [], []]
    for m in range(M):  # one micro-batch at a time keeps the [L, S, G, J] split small
        split_LSGJ = token_split(plan.micro_batch(m), loads_MLSE[m : m + 1])[0]
        slot_expert_LGJ = plan.slot_expert_MLGJ[m]
        relay_LSg = None if plan.relay_MLGg is None else plan.relay_MLGg[m]
        if routing is not None:
            rows_T, source_T = routing.micro_batch(step, m)
            cross, copies = exact_copies(split_LSGJ, slot_expert_LGJ, routing.routed_experts_TLK, source_T,
                                         topo, rows_T, relay_LSg)
        else:
            cross = approx_cross_tokens(split_LSGJ, slot_expert_LGJ, tokens_MS[m], top_k, topo)
            copies = approx_gpu_copies(split_LSGJ, slot_expert_LGJ, tokens_MS[m], top_k, topo)
            if relay_LSg is not None:  # a relayed token's expected rows go with it
                copies, cross = relayed_counts(copies, cross, relay_LSg, tokens_MS[m].expand(L, -1),
                                               topo.gpus_per_node)[:2]
        for acc, t in zip(parts, hierarchical_traffic(copies, cross, topo)):
            acc.append(t)
        if relay_LSg is not None:
            for acc, t in zip(parts[4:], relay_rows(relay_LSg)):
                acc.append(t)
    cs, cr, is_, ir = (torch.stack(p) for p in parts[:4])
    relay_s, relay_r = (torch.stack(p) if p else None for p in parts[4:])
    return replace(metrics, cross_send_MLG=cs, cross_recv_MLG=cr, intra_send_MLG=is_, intra_recv_MLG=ir,
                   relay_send_MLG=relay_s, relay_recv_MLG=relay_r)


def hierarchical_rows(plan: StepPlan, loads_MLSE: torch.Tensor,
                      routed_ids: Sequence[Sequence[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Rows every GPU sends and receives in each layer's forward dispatch under hierarchical
    dispatch, exactly as the layer sends them (``engine.last_exchange``).

    Args:
        plan: the step plan; loads_MLSE: int ``[M, L, S, E]`` the counts it was made from.
        routed_ids: ``routed_ids[m][s]`` int ``[T, L, K]`` the ids source rank ``s`` routes
            in micro-batch ``m`` (``-1`` pads), the layer's token order.

    Returns:
        int64 ``[M, L, G]`` tensors ``cross_node_rows``, ``intra_node_rows``,
        ``cross_node_recv_rows``, ``intra_node_recv_rows`` (units: :func:`hierarchical_traffic`),
        ``relay_rows``, ``relay_recv_rows`` (tokens handed to / taken from GPUs of the node, ``planning.relay``).
    """
    topo = plan.topology
    out: dict[str, list[torch.Tensor]] = {k: [] for k in ("cross_node_rows", "cross_node_recv_rows",
                                                          "intra_node_rows", "intra_node_recv_rows",
                                                          "relay_rows", "relay_recv_rows")}
    for m in range(loads_MLSE.shape[0]):
        split_LSGJ = token_split(plan.micro_batch(m), loads_MLSE[m : m + 1])[0]
        ids = [torch.as_tensor(t).to(torch.int64) for t in routed_ids[m]]
        source_T = torch.repeat_interleave(torch.arange(len(ids)), torch.tensor([t.shape[0] for t in ids]))
        relay_LSg = plan.relays()[m]
        cross, copies = exact_copies(split_LSGJ, plan.slot_expert_MLGJ[m], torch.cat(ids), source_T, topo,
                                     relay_LSg=relay_LSg)
        for key, t in zip(out, (*hierarchical_traffic(copies, cross, topo), *relay_rows(relay_LSg))):
            out[key].append(t)
    return {k: torch.stack(v) for k, v in out.items()}
