"""Which relays relibra keeps: :mod:`relibra_torch.planning.relay`'s rule where the priced
all-to-all pays for it (the planner's pricing, :mod:`relibra_torch.planning.price`), on the
layers where it can repay its own host time (:func:`relays_worth_L`).

Finding them prices each (micro-batch, layer)'s hierarchical all-to-all twice from the
count-level estimate: ``[M, S, G, J]`` per layer, 4-28 ms of one thread per layer on 8 x 8
GPUs at 4-16 micro-batches, on every EP rank's share, after its plan. On a kept placement
at small micro-batches that was the whole of a step's planning charge (``docs/results.md``,
"The relays' host time"), while the relays saved nothing. So, as the guard
(:mod:`~relibra_torch.planning.worth`) does for the search, a layer gets relays only where
an upper bound of their saving, counted for every layer whose saving one share-layer's host
time buys, covers their host time.

Legend (shape suffixes): M micro-batches, L MoE layers, B rows (micro-batch, layer), S source
ranks (= G), N nodes, g GPUs per node.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .gain_bound import hierarchical_rows_bound
from .hier_estimate import hierarchical_traffic
from .price import hierarchical_estimate, rows_seconds, split_chunks
from .relay import RELAY_COLLECTIVES, plan_relays, relayed_counts

__all__ = ["RELAY_HOST_S", "add_relays", "relay_bound_ML", "relay_host_s", "relay_savings", "relays_worth_L"]

#: ``(per call, per micro-batch and source, per micro-batch, source, GPU and slot)``: the
#: host time of :func:`relay_savings` with the token splits given, one thread, in the guard's
#: fitted time (``planning.pricing.PLAN_FLOOR_S``'s machine): fitted on 48 shapes (2 x 4 to
#: 8 x 8 GPUs, 32-256 experts, top-2 and top-8, 4 and 16 micro-batches, 64 and 1,024 tokens
#: per GPU; measured over fit 0.86-1.23) as 1.07 ms + 0.85 us M S + 31.6 ns M S G J on a host
#: whose ``measure_host_scale`` gave 0.59 across nodes, that is 0.28 of the fit before
#: ``moe.host_speed.FIT_SPREAD`` (so times ``host_scale_nodes`` they are 2.1x that median,
#: the floors' 90th percentile). The elements carry the GPUs, so no ``G / 16`` factor.
RELAY_HOST_S = (3.8e-3, 3.0e-6, 1.12e-7)


def _relays_possible(config, topology) -> bool:
    """Whether any relay can exist: relays on, hierarchical dispatch with a known top-k, more
    than one node and more than one GPU per node."""
    return bool(config.relay and config.dispatch == "hierarchical" and config.top_k > 0 and topology.num_nodes > 1
                and topology.gpus_per_node > 1)


def _source_tokens_MS(loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """int64 ``[M, S]``: each source's tokens as the relays count them, its first layer's
    pairs // top_k (every layer of a step carries the same tokens)."""
    return loads_MLSE[:, 0].to(torch.int64).sum(-1) // config.top_k


def relay_bound_ML(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None) -> torch.Tensor:
    """float64 ``[M, L]``: the most :func:`relay_savings` can find per (micro-batch, layer),
    from the plan's pairs per (source, GPU) alone (no estimate): an upper bound of its priced
    all-to-all (:func:`~relibra_torch.planning.gain_bound.hierarchical_rows_bound`: each
    estimated count at most its pairs and its source's tokens), less a lower bound of any
    relayed one's inter-node part (a relay moves rows inside its node, so a node's inter-node
    rows sent and received stay, and its busiest GPU carries at least their mean; the estimate
    gives a source at least ``T (1 - exp(-P / T))`` tokens on a remote node it sends ``P``
    pairs, one minus its chance of none), less the relays' latency; at least 0. Not the busiest
    source's send: a relay also spreads what one GPU *receives* from every other node
    (``tests/test_relay.py``). ``split_MLSGJ``: the plan's token splits when already computed
    (0 on empty slots, as ``token_split`` gives them). Zeros where no relay exists (top-k
    unknown, one node)."""
    topo = plan.topology
    N, g = topo.num_nodes, topo.gpus_per_node
    M, L, S, _ = loads_MLSE.shape
    if config.top_k <= 0 or N < 2:
        return torch.zeros(M, L, dtype=torch.float64)
    tokens_MS = _source_tokens_MS(loads_MLSE, config)   # relay_savings' tokens
    remote_SN = (torch.arange(S) // g).view(S, 1) != torch.arange(N).view(1, N)
    out = torch.empty(M, L, dtype=torch.float64)
    for m0, m1, split_BLSGJ in (split_chunks(plan, loads_MLSE) if split_MLSGJ is None else [(0, M, split_MLSGJ)]):
        flow_BLSG = split_BLSGJ.sum(-1)
        B = m1 - m0
        cap_BLS = tokens_MS[m0:m1].view(B, 1, S).expand(B, L, S)
        before = rows_seconds(*hierarchical_rows_bound(flow_BLSG, topo, cap_BLS), config)[0]
        T = cap_BLS.unsqueeze(-1).to(torch.float64)
        pairs_BLSN = flow_BLSG.view(B, L, S, N, g).sum(-1).to(torch.float64)
        low_BLSN = torch.where(T > 0, T * -torch.expm1(-pairs_BLSN / T.clamp(min=1.0)), 0.0) * remote_SN
        node_mean = torch.maximum(low_BLSN.sum(-1).view(B, L, N, g).sum(-1), low_BLSN.sum(2)) / g
        after = node_mean.amax(-1) * config.cross_node_s_per_token
        out[m0:m1] = (before - after - RELAY_COLLECTIVES * config.inter_node_latency_s).clamp(min=0.0)
    return out


def _tokens_bound_M(loads_MLSE: torch.Tensor, config, topo) -> torch.Tensor:
    """float64 ``[M]``: a bound of :func:`relay_bound_ML` from the busiest source's tokens alone
    (its first layer's pairs // top_k): a GPU's inter-node rows, sent or received, are at most
    ``N - 1`` sources' tokens, its NVLink rows ``N (g - 1)``; less the relays' latency, at least 0."""
    N, g = topo.num_nodes, topo.gpus_per_node
    most_M = _source_tokens_MS(loads_MLSE, config).amax(-1).to(torch.float64) * (
        (N - 1) * config.cross_node_s_per_token + N * (g - 1) * config.intra_node_s_per_token)
    return (most_M - RELAY_COLLECTIVES * config.inter_node_latency_s).clamp(min=0.0)


def relay_host_s(topology, micro_batches: int, config, share: int) -> float:
    """One layer's part of the relays' host time on a rank's ``share`` layers (:data:`RELAY_HOST_S`),
    on this host (times ``config.host_scale_nodes``)."""
    fixed, per_source, per_element = RELAY_HOST_S
    S, J = topology.num_gpus, topology.slots_per_gpu
    return (fixed / max(share, 1) + micro_batches * S * (per_source + per_element * S * J)) * config.host_scale_nodes


def relays_worth_L(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None,
                   total_layers: int | None = None) -> torch.Tensor:
    """bool ``[L]``: the layers whose relays may repay their host time: ``scale * B_l >=
    F_r``, ``B_l`` the bound :func:`relay_bound_ML` summed over micro-batches, ``F_r`` the
    layer's :func:`relay_host_s` and ``scale = L / ceil(L / G)`` (the guard's: every rank finds
    its share's relays at once, so one share-layer's host time buys ``scale`` layers'
    savings). Like the guard's, this assumes split planning (the hook's and the simulator's
    default): where one thread finds every layer's relays (whole-step planning: ``choose``,
    ``planning.split`` off) it underprices their host time up to ``min(G, L)``-fold, and the
    plan is the same in both modes. The overlap window is left out: a refused layer loses at
    most its bound, which ``scale`` times is less than its host time. Every layer where the guard is off
    (``plan_floor_nodes_s`` 0), none without a known top-k or across fewer than two nodes;
    ``total_layers``: the step's ``L`` when ``plan`` is a share (split planning)."""
    M, L = loads_MLSE.shape[:2]
    topo = plan.topology
    if config.top_k <= 0 or topo.num_nodes < 2:
        return torch.zeros(L, dtype=torch.bool)
    if config.plan_floor_nodes_s <= 0 or L == 0:
        return torch.ones(L, dtype=torch.bool)
    total = L if total_layers is None else total_layers
    share = -(-total // max(topo.num_gpus, 1))
    host_s = relay_host_s(topo, M, config, share)
    # first the bound from the busiest source's tokens alone: on small micro-batches it refuses
    # without the pass over the pairs (0.4-2.4 ms on 8 x 8 GPUs)
    if float(_tokens_bound_M(loads_MLSE, config, topo).sum()) * total / share < host_s:
        return torch.zeros(L, dtype=torch.bool)
    bound_L = relay_bound_ML(plan, loads_MLSE, config, split_MLSGJ).sum(0)
    return bound_L * (total / share) >= host_s


def relay_savings(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(saving_ML, relay_MLSg)``: per (micro-batch, layer) the seconds :mod:`relay`'s rule
    saves on the priced all-to-all, relay rows and their collectives' latency included
    (float64 ``[M, L]``, zero where it saves nothing), and the relays where it saves (int64
    ``[M, L, S, g]``, zero elsewhere); ``None`` when no relay can pay (relays off, flat
    dispatch, one node or one GPU per node, or sends too small to cover the latency).
    ``split_MLSGJ``: the plan's token splits when already computed (else computed here)."""
    topo = plan.topology
    g = topo.gpus_per_node
    if not _relays_possible(config, topo):
        return None
    M, L, S, _ = loads_MLSE.shape
    if not bool((_tokens_bound_M(loads_MLSE, config, topo) > 0).any()):   # sends too small to cover the latency
        return None
    tokens_MS = _source_tokens_MS(loads_MLSE, config)
    latency = RELAY_COLLECTIVES * config.inter_node_latency_s
    relay = torch.zeros(M, L, S, g, dtype=torch.int64)
    saving = torch.zeros(M, L, dtype=torch.float64)
    chunks = split_chunks(plan, loads_MLSE) if split_MLSGJ is None else [(0, M, split_MLSGJ)]  # given: one batch
    for m0, m1, split_BLSGJ in chunks:
        tok_BS = tokens_MS[m0:m1].repeat_interleave(L, 0)
        copies, cross = hierarchical_estimate(split_BLSGJ, plan.slot_expert_MLGJ[m0:m1], tokens_MS[m0:m1],
                                              config.top_k, topo)
        before = rows_seconds(*hierarchical_traffic(copies, cross, topo), config)[0]
        r = plan_relays(cross, tok_BS, g)
        c2, x2, rs, rr = relayed_counts(copies, cross, r, tok_BS, g)
        after = (rows_seconds(*hierarchical_traffic(c2, x2, topo), config)[0]
                 + torch.maximum(rs, rr).amax(-1) * config.intra_node_s_per_token)
        gain = before - after - latency
        r[~(gain > 0)] = 0
        relay[m0:m1] = r.view(m1 - m0, L, S, g)
        saving[m0:m1] = gain.clamp(min=0.0).view(m1 - m0, L)
    return saving, relay


def add_relays(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None,
               total_layers: int | None = None):
    """``plan`` with relays (``relay_MLGg``) where they make the priced all-to-all faster by
    more than their collectives' latency (:func:`relay_savings`), on the layers worth their
    host time (:func:`relays_worth_L`); ``plan`` itself when none pays. ``config``: relibra's
    (``relay``, ``dispatch``, ``top_k``, link prices, ``inter_node_latency_s`` and the guard's
    host-time fields); ``split_MLSGJ``: the plan's token splits when already computed;
    ``total_layers``: the step's layer count when ``plan`` is a share of it."""
    if not _relays_possible(config, plan.topology):
        return plan
    worth_L = relays_worth_L(plan, loads_MLSE, config, split_MLSGJ, total_layers)
    if not bool(worth_L.any()):
        return plan
    layers = None if bool(worth_L.all()) else worth_L.nonzero().flatten()
    found = (relay_savings(plan, loads_MLSE, config, split_MLSGJ) if layers is None else
             relay_savings(plan.layers(layers), loads_MLSE[:, layers], config,
                           None if split_MLSGJ is None else split_MLSGJ[:, layers]))
    if found is None or not bool(found[1].any()):
        return plan
    if layers is None:
        return replace(plan, relay_MLGg=found[1])
    relay_MLGg = plan.relays().clone()
    relay_MLGg[:, layers] = found[1]
    return replace(plan, relay_MLGg=relay_MLGg)
