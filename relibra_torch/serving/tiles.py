"""The tile footprint of an expert grouped GEMM, shared by the serving model and runtime.

A grouped GEMM over experts runs ``ceil(m_e / M_t)`` row tiles for expert ``e`` with
``m_e > 0`` rows (tile height ``M_t``), whatever ``m_e`` is inside a tile: its time follows
the tile count, not the token count (ExpertPlex, arXiv 2607.18002). Every column block of
the output multiplies that count by the same factor, so row tiles are the unit here.

Legend: E experts, B a batch of independent problems.
"""

from __future__ import annotations

import torch

from ..checks import check_int

__all__ = ["tile_footprint"]


def tile_footprint(rows_E: torch.Tensor, tile_m: int) -> torch.Tensor:
    """Row tiles a grouped GEMM runs: ``sum_e ceil(rows_E[..., e] / tile_m)``.

    Args:
        rows_E: ``[..., E]`` integer rows routed to each expert (``>= 0``).
        tile_m: tile height ``M_t`` (rows per tile), ``>= 1``.

    Returns:
        ``[...]`` int64 tile counts (experts without rows cost nothing).
    """
    tile_m = check_int("tile_m", tile_m, minimum=1)
    if rows_E.dtype.is_floating_point or rows_E.dtype == torch.bool:
        raise TypeError(f"rows_E has dtype {rows_E.dtype}; allowed: an integer tensor of rows per expert")
    if rows_E.numel() and int(rows_E.min()) < 0:
        raise ValueError(f"rows_E has a negative entry ({int(rows_E.min())}); allowed: rows >= 0")
    rows_E = rows_E.to(torch.int64)
    return ((rows_E + tile_m - 1) // tile_m).sum(dim=-1)
