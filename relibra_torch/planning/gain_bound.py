"""The guard's gain bound ``U_l`` (:mod:`~relibra_torch.planning.worth`, whose module docstring
derives it): what any plan can save on a layer against keeping its placement without copies,
from integer counts only, and a cheaper bound of it on one node.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, N nodes, g GPUs per node.
"""

from __future__ import annotations

import torch

from .hier_estimate import hierarchical_traffic
from .price import exchange_latency_s, flat_rows, rows_seconds
from .topology import Topology

__all__ = ["gain_bound_L", "gain_bounds_L", "hierarchical_rows_bound", "owner_loads", "quick_bound_L"]


def _pair_flows(loads_MLSE: torch.Tensor, owner_LE: torch.Tensor, G: int) -> torch.Tensor:
    """int64 ``[M, L, S, G]``: token-expert pairs each source sends to each GPU when every
    expert sits on its owner ``owner_LE`` (int64 ``[L, E]``) only."""
    M, L, S, E = loads_MLSE.shape
    return torch.zeros(M, L, S, G, dtype=torch.int64).scatter_add_(
        3, owner_LE.view(1, L, 1, E).expand(M, L, S, E), loads_MLSE.to(torch.int64))


def hierarchical_rows_bound(flow_MLSG: torch.Tensor, topology: Topology, cap_MLS: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-GPU ``(cross send, cross receive, intra send, intra receive)`` ``[M, L, G]``: bounds
    of the kept placement's rows under hierarchical dispatch, ``hier_estimate.hierarchical_traffic``
    (the rule the planner's price applies to its count-level estimate) of upper bounds of that
    estimate's counts. Its tokens of a source with a pair on a GPU, or on a remote node, are at
    most those pairs and at most ``cap_MLS``, when that is the source's tokens."""
    M, L, S, G = flow_MLSG.shape
    N, g = topology.num_nodes, topology.gpus_per_node
    cap_MLS1 = cap_MLS.unsqueeze(-1)
    copies_MLSG = torch.minimum(flow_MLSG, cap_MLS1)
    remote_SN = (torch.arange(S) // g).view(S, 1) != torch.arange(N).view(1, N)
    cross_MLSN = torch.minimum(flow_MLSG.view(M, L, S, N, g).sum(-1), cap_MLS1) * remote_SN
    rows = hierarchical_traffic(copies_MLSG.view(M * L, S, G), cross_MLSN.view(M * L, S, N), topology)
    return tuple(r.view(M, L, G) for r in rows)


def gain_bound_L(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``([L], [L])``: the bound ``U_l`` on what any plan saves per layer against
    ``placement_LE`` without copies, and that plan's forward estimate (module docstring),
    both summed over micro-batches, in the planner's price (``config``: a ``ReLibraConfig``)."""
    gain_L, _, forward_L = gain_bounds_L(loads_MLSE, topology, placement_LE, config)
    return gain_L, forward_L


def gain_bounds_L(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                  config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``([L], [L], [L])``: :func:`gain_bound_L`'s ``U_l``, the looser bound the light
    tier admits on (``worth.Tiers.light_gain_L``: under hierarchical dispatch across nodes each
    row bounded by its pairs only; elsewhere ``U_l``), and the forward estimate."""
    flow_MLSG = _pair_flows(loads_MLSE, placement_LE // topology.experts_per_gpu, topology.num_gpus)
    gpu_MLG = flow_MLSG.sum(2)
    # price.a2a_parts_ML's rule; on one node the flat rows bound the hierarchical ones too
    if not (_hierarchical(config) and topology.num_nodes > 1):
        gain_L, forward_L = _gain_and_forward_L(gpu_MLG, rows_seconds(*flat_rows(flow_MLSG, topology), config)[0],
                                                topology, config)
        return gain_L, gain_L, forward_L
    # a token is one row per node and per GPU however many of its top-k experts sit there:
    # its source's rows there are at most its tokens, ceil(pairs / top_k) (pairs alone
    # overstated them about four-fold under top-8 routing over two nodes, and the guard
    # admitted full searches that no plan could repay, docs/results.md). The layer's own pairs:
    # every layer of a step carries the same tokens, so this is the price's count (a share's
    # first layer's pairs // top_k) or one more; it keeps the rule to the layer's own counts
    pairs_MLS = flow_MLSG.sum(-1)
    by_tokens = rows_seconds(*hierarchical_rows_bound(flow_MLSG, topology, -(-pairs_MLS // config.top_k)), config)[0]
    # the light tier's: rows bounded by pairs, an intra receive by every pair another source sends
    cs, cr, is_, _ = hierarchical_rows_bound(flow_MLSG, topology, pairs_MLS)
    by_pairs = rows_seconds(cs, cr, is_, gpu_MLG - flow_MLSG.diagonal(dim1=2, dim2=3), config)[0]
    gain_L, forward_L = _gain_and_forward_L(gpu_MLG, by_tokens, topology, config)
    return gain_L, _gain_and_forward_L(gpu_MLG, by_pairs, topology, config)[0], forward_L


def _hierarchical(config) -> bool:
    """Whether ``config`` prices hierarchical dispatch (an unknown top-k is priced flat)."""
    return config.dispatch == "hierarchical" and config.top_k > 0


def _gain_and_forward_L(gpu_MLG: torch.Tensor, a2a_ML: torch.Tensor, topology: Topology,
                        config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``([L], [L])`` ``(U_l, forward)`` from each GPU's token-expert pairs ``[M, L, G]``
    under the kept placement and that placement's all-to-all (or a bound of it) ``[M, L]``."""
    G = topology.num_gpus
    compute_ML = gpu_MLG.amax(-1).to(torch.float64) * config.compute_s_per_token
    floor_ML = ((gpu_MLG.sum(-1) + G - 1) // G).to(torch.float64) * config.compute_s_per_token
    gain_L = (compute_ML - floor_ML + a2a_ML).sum(0)
    forward_L = (compute_ML / 3 + (0.0 if _hierarchical(config) else 0.5) * a2a_ML
                 + 0.5 * exchange_latency_s(topology, config)).sum(0)
    return gain_L, forward_L


def quick_bound_L(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                  config) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gain_bound_L` on one node with each GPU's all-to-all rows bounded by all it
    sends and all it receives (its own pairs counted too), from two sums of the loads
    instead of the pairs per (source, GPU): both parts are at least :func:`gain_bound_L`'s."""
    gpu_MLG = owner_loads(loads_MLSE, topology, placement_LE)[1]
    rows_ML = torch.maximum(loads_MLSE.sum(3).amax(-1), gpu_MLG.amax(-1))
    return _gain_and_forward_L(gpu_MLG, rows_ML.to(torch.float64) * config.intra_node_s_per_token, topology, config)


def owner_loads(loads_MLSE: torch.Tensor, topology: Topology,
                placement_LE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(load_MLE, gpu_MLG)``: each expert's tokens summed over sources, and each GPU's
    with every expert on its owner under ``placement_LE`` (no copy)."""
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    M, L, E = load_MLE.shape
    gpu_MLG = torch.zeros(M, L, topology.num_gpus, dtype=torch.int64).scatter_add_(
        2, (placement_LE // topology.experts_per_gpu).expand(M, L, E), load_MLE)
    return load_MLE, gpu_MLG
