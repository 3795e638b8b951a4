"""The guard's gain bound ``U_l`` (:mod:`~relibra_torch.planning.worth`, whose module docstring
derives it): what any plan can save on a layer against keeping its placement without copies,
from integer counts only, and a cheaper bound of it on one node.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, N nodes, g GPUs per node.
"""

from __future__ import annotations

import torch

from .price import exchange_latency_s, flat_rows, rows_seconds
from .topology import Topology

__all__ = ["gain_bound_L", "owner_loads", "quick_bound_L"]


def _pair_flows(loads_MLSE: torch.Tensor, owner_LE: torch.Tensor, G: int) -> torch.Tensor:
    """int64 ``[M, L, S, G]``: token-expert pairs each source sends to each GPU when every
    expert sits on its owner ``owner_LE`` (int64 ``[L, E]``) only."""
    M, L, S, E = loads_MLSE.shape
    return torch.zeros(M, L, S, G, dtype=torch.int64).scatter_add_(
        3, owner_LE.view(1, L, 1, E).expand(M, L, S, E), loads_MLSE.to(torch.int64))


def _a2a_rows(flow_MLSG: torch.Tensor, topology: Topology, hierarchical: bool) -> tuple[torch.Tensor, ...]:
    """Per-GPU ``(cross send, cross receive, intra send, intra receive)`` ``[M, L, G]`` of the
    kept placement: exact pairs under flat dispatch (:func:`planning.price.a2a_parts_ML`);
    under hierarchical dispatch bounds of its rows (``hier_estimate.hierarchical_traffic``),
    whose counts are expected tokens, each at most its pairs:

    * cross send of ``s``: one row per (token, remote node) <= pairs to remote nodes;
    * cross receive of landing GPU ``(n, i)``: the rows of the sources of local index ``i``
      on other nodes for node ``n`` <= their pairs to node ``n``;
    * intra send of ``q``: its pairs to the other GPUs of its node, plus what it forwards as
      a landing GPU <= the pairs its remote sources send to its node's other GPUs;
    * intra receive of ``q``: at most every pair sent to it by another GPU."""
    M, L, S, G = flow_MLSG.shape
    N, g = topology.num_nodes, topology.gpus_per_node
    cs, cr, is_, ir = flat_rows(flow_MLSG, topology)
    if not hierarchical:
        return cs, cr, is_, ir
    node_G = torch.arange(G) // g
    node_MLSN = flow_MLSG.view(M, L, S, N, g).sum(-1)                     # pairs to each node
    land_SN = torch.arange(N).view(1, N) * g + (torch.arange(S) % g).view(S, 1)
    at_land = flow_MLSG.gather(3, land_SN.view(1, 1, S, N).expand(M, L, S, N))
    remote_SN = node_G.view(S, 1) != torch.arange(N).view(1, N)

    def by_landing(x_MLSN: torch.Tensor) -> torch.Tensor:
        """``[M, L, G]``: per landing GPU ``(n, i)``, the sum over remote sources of index ``i``."""
        per = (x_MLSN * remote_SN).view(M, L, N, g, N).sum(2)              # [M, L, i, n]
        return per.transpose(2, 3).reshape(M, L, G)

    cr = by_landing(node_MLSN)
    forwarded = by_landing(node_MLSN - at_land)
    ir = flow_MLSG.sum(2) - flow_MLSG.diagonal(dim1=2, dim2=3)
    return cs, cr, is_ + forwarded, ir


def gain_bound_L(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``([L], [L])``: the bound ``U_l`` on what any plan saves per layer against
    ``placement_LE`` without copies, and that plan's forward estimate (module docstring),
    both summed over micro-batches, in the planner's price (``config``: a ``ReLibraConfig``)."""
    flow_MLSG = _pair_flows(loads_MLSE, placement_LE // topology.experts_per_gpu, topology.num_gpus)
    # price.a2a_parts_ML's rule; on one node the flat rows bound the hierarchical ones too
    cs, cr, is_, ir = _a2a_rows(flow_MLSG, topology, _hierarchical(config) and topology.num_nodes > 1)
    return _gain_and_forward_L(flow_MLSG.sum(2), rows_seconds(cs, cr, is_, ir, config)[0], topology, config)


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
