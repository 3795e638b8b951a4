"""Which relays relibra keeps: :mod:`relibra_torch.planning.relay`'s rule where the priced
all-to-all pays for it (the planner's pricing, :mod:`relibra_torch.planning.price`).

Legend (shape suffixes): M micro-batches, L MoE layers, B rows (micro-batch, layer), S source
ranks (= G), N nodes, g GPUs per node.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .hier_estimate import hierarchical_traffic
from .price import hierarchical_estimate, rows_seconds, split_chunks
from .relay import RELAY_COLLECTIVES, plan_relays, relayed_counts

__all__ = ["add_relays", "relay_savings"]


def relay_savings(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(saving_ML, relay_MLSg)``: per (micro-batch, layer) the seconds :mod:`relay`'s rule
    saves on the priced all-to-all, relay rows and their collectives' latency included
    (float64 ``[M, L]``, zero where it saves nothing), and the relays where it saves (int64
    ``[M, L, S, g]``, zero elsewhere); ``None`` when no relay can pay (relays off, flat
    dispatch, one node or one GPU per node, or sends too small to cover the latency).
    ``split_MLSGJ``: the plan's token splits when already computed (else computed here)."""
    topo = plan.topology
    N, g = topo.num_nodes, topo.gpus_per_node
    if not (config.relay and config.dispatch == "hierarchical" and config.top_k > 0 and N > 1 and g > 1):
        return None
    M, L, S, _ = loads_MLSE.shape
    tokens_MS = loads_MLSE[:, 0].to(torch.int64).sum(-1) // config.top_k
    latency = RELAY_COLLECTIVES * config.inter_node_latency_s
    # the most a relay can save: the busiest source's whole inter-node send
    most_ML = (tokens_MS.amax(-1) * min(config.top_k, N - 1)).to(torch.float64) * config.cross_node_s_per_token
    if not bool((most_ML > latency).any()):
        return None
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


def add_relays(plan, loads_MLSE: torch.Tensor, config, split_MLSGJ: torch.Tensor | None = None):
    """``plan`` with relays (``relay_MLGg``) where they make the priced all-to-all faster by
    more than their collectives' latency (:func:`relay_savings`); ``plan`` itself when none
    pays. ``config``: relibra's (``relay``, ``dispatch``, ``top_k``, link prices and
    ``inter_node_latency_s``); ``split_MLSGJ``: the plan's token splits when already computed."""
    found = relay_savings(plan, loads_MLSE, config, split_MLSGJ)
    if found is None or not bool(found[1].any()):
        return plan
    return replace(plan, relay_MLGg=found[1])
