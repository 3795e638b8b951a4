"""The count-level estimate of hierarchical dispatch's rows, shared by the simulator
(:mod:`relibra_torch.sim.dispatch`, whose module docstring states the rule) and relibra's
own pricing (:mod:`relibra_torch.planning.price`), so that the planner prices a plan's
hierarchical all-to-all exactly as the simulator charges it on count-only loads.

Legend: L layers, S source ranks, P pieces (nodes or GPUs), E experts, G GPUs, N nodes.
"""

from __future__ import annotations

import torch

from .topology import Topology

__all__ = ["approx_need", "approx_need_batched", "approx_need_columns", "approx_need_pieces", "hierarchical_traffic"]


def approx_need(flow_LSPE: torch.Tensor, tokens_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """float64 ``[L, S, P]``: expected tokens of ``s`` with a pair in piece ``p``, from the
    pairs of each expert of the piece (last dim; zeros for absent experts), by the rule of
    :mod:`relibra_torch.sim.dispatch` (the smaller of two no-pair chances, clipped to
    always-true bounds). :func:`approx_need_columns` with the experts first."""
    return approx_need_columns(flow_LSPE.movedim(-1, 0), tokens_S, top_k)


def approx_need_columns(flow_KLSP: torch.Tensor, tokens_S: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`approx_need` of ``flow_KLSP`` (the experts of each piece first, ``K`` of them):
    sums over ``K`` contiguous slices rather than a short last dim, a few times faster."""
    T = tokens_S.to(torch.float64).view(1, -1, 1)
    # no tokens: no pairs either, so each share is 0 (flow / inf)
    T_div = torch.where(T > 0, T.clamp(min=1.0), torch.full_like(T, float("inf")))
    p = (flow_KLSP.to(torch.float64) / T_div).clamp_(0.0, 1.0)
    none_indep = torch.log1p(-p).sum(0).exp()
    # K successive draws without replacement, draw probabilities r = p / K: the next draw
    # hits piece n with n's mass over the mass left, after i draws elsewhere have each
    # removed rho (the expected mass of an item drawn from the other pieces).
    r = p / top_k
    return _need(none_indep, r.sum(0).clamp(max=1.0), (r * r).sum(0), top_k, p.amax(0), p.sum(0)) * T


def approx_need_batched(flow_BKLSP: torch.Tensor, tokens_BS: torch.Tensor, top_k: int) -> torch.Tensor:
    """float64 ``[B, L, S, P]``: :func:`approx_need_columns` of ``B`` flows at once (flow
    ``b`` of ``K`` experts first, ``tokens_BS[b]`` its sources' tokens), each bit-identical
    to its own call: every op is elementwise or reduces within one ``b``, and the sums over
    ``K`` run on each ``b``'s own contiguous ``[K, L S P]`` block (a float sum's order
    depends on the block it reduces, so ``flow_BKLSP`` must be contiguous and ``K`` each
    flow's own: zero columns added to one would change its rounding)."""
    B, S = tokens_BS.shape
    T = tokens_BS.to(torch.float64).view(B, 1, 1, S, 1)
    T_div = torch.where(T > 0, T.clamp(min=1.0), torch.full_like(T, float("inf")))
    p = (flow_BKLSP.contiguous().to(torch.float64) / T_div).clamp_(0.0, 1.0)
    none_indep = torch.log1p(-p).sum(1).exp()
    r = p / top_k
    return _need(none_indep, r.sum(1).clamp(max=1.0), (r * r).sum(1), top_k, p.amax(1), p.sum(1)) * T.view(B, 1, S, 1)


def _need(none_indep: torch.Tensor, mass: torch.Tensor, sq: torch.Tensor, top_k: int, p_max: torch.Tensor,
          p_sum: torch.Tensor) -> torch.Tensor:
    """P(a token needs a piece): the larger of the independent and the without-replacement
    estimates (their chances of needing none, ``none_indep`` and the draws' from each
    piece's draw ``mass`` and sum of squares ``sq``), kept within the always-true bounds: at
    least the most-chosen expert's share ``p_max``, at most the expected pairs ``p_sum``."""
    rest = (1.0 - mass).clamp(min=1e-12)
    rho = ((sq.sum(-1, keepdim=True) - sq) / rest).clamp(min=0.0)
    none_draws = torch.ones_like(mass)
    for i in range(top_k):
        left = (1.0 - i * rho).clamp(min=1e-12)
        none_draws = none_draws * (1.0 - mass / left).clamp(0.0, 1.0)
    need = 1.0 - torch.minimum(none_indep, none_draws)
    return torch.minimum(torch.maximum(need, p_max), p_sum)


def hierarchical_traffic(copies_LSG: torch.Tensor, cross_tokens_LSN: torch.Tensor, topo: Topology
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-GPU ``(cross_send, cross_recv, intra_send, intra_recv)`` ``[L, G]`` of one
    micro-batch under hierarchical dispatch, in rows (the layer's units).

    Args:
        copies_LSG: tokens of source ``s`` with a pair on GPU ``g`` (one NVLink row per
            (token, GPU) unless ``g`` is the row's landing GPU or the source itself).
        cross_tokens_LSN: tokens of source ``s`` that cross to remote node ``n``.
    Cross-node rows: one per (token, remote node), sent by the source, received by the
    landing GPU (the source's local index on that node). NVLink rows: one per (token, GPU
    of the source's node other than the source), sent by the source, and one per (token,
    GPU of a remote node other than the landing GPU), sent by the landing GPU.
    """
    L, S, G = copies_LSG.shape
    g, N = topo.gpus_per_node, topo.num_nodes
    node_S, local_S = torch.arange(S) // g, torch.arange(S) % g
    dtype = cross_tokens_LSN.dtype
    cross_send = cross_tokens_LSN.sum(-1)
    land_SN = torch.arange(N).view(1, N) * g + local_S.view(S, 1)  # landing GPU of (source, node)
    cross_recv = torch.zeros(L, G, dtype=dtype).scatter_add_(
        1, land_SN.reshape(1, S * N).expand(L, S * N), cross_tokens_LSN.reshape(L, S * N))
    same_node = node_S.view(S, 1) == node_S.view(1, G)
    dst_G = torch.arange(G)
    local = copies_LSG * (same_node & (torch.arange(S).view(S, 1) != dst_G.view(1, G)))
    land_SG = (dst_G // g).view(1, G) * g + local_S.view(S, 1)
    fwd = copies_LSG * (~same_node & (land_SG != dst_G.view(1, G)))
    intra_send = local.sum(2).to(dtype).scatter_add_(
        1, land_SG.reshape(1, S * G).expand(L, S * G), fwd.reshape(L, S * G).to(dtype))
    intra_recv = (local.sum(1) + fwd.sum(1)).to(dtype)
    return cross_send, cross_recv, intra_send, intra_recv


def approx_need_pieces(loads_LSE: torch.Tensor, piece_LSE: torch.Tensor, pieces: int, tokens_S: torch.Tensor,
                       top_k: int) -> torch.Tensor:
    """:func:`approx_need` where every (source, expert)'s pairs go to one piece: float64
    ``[L, S, P]`` from ``loads_LSE`` and the piece each goes to, ``piece_LSE`` (int64, in
    ``[0, pieces)``), without the ``[L, S, P, E]`` flow: per-piece sums by scatter. The same
    rule, the same values up to float rounding (``tests/test_fill_spread.py``). ``tokens_S``
    may be ``[L, S]``, each row's own sources' tokens (rows of several micro-batches at once:
    every op is elementwise or reduces within a row, so each row's values are its own call's)."""
    L, S, E = loads_LSE.shape
    T = tokens_S.to(torch.float64).reshape(-1, S, 1)
    T_div = torch.where(T > 0, T.clamp(min=1.0), torch.full_like(T, float("inf")))
    p = (loads_LSE.to(torch.float64) / T_div).clamp_(0.0, 1.0)

    def per_piece(x: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
        out = torch.zeros(L, S, pieces, dtype=torch.float64)
        return out.scatter_add_(2, piece_LSE, x) if reduce == "sum" else out.scatter_reduce_(2, piece_LSE, x, reduce)

    log_none = per_piece(torch.log1p(-p))        # -inf where some p == 1: exp gives 0, as the product
    none_indep = log_none.exp()
    r = p / top_k
    return _need(none_indep, per_piece(r).clamp(max=1.0), per_piece(r * r), top_k, per_piece(p, "amax"),
                 per_piece(p)) * T
