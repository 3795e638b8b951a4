"""The tile footprint of an expert grouped GEMM, shared by the serving model and runtime.

A grouped GEMM over experts runs ``ceil(m_e / M_t)`` row tiles for expert ``e`` with
``m_e > 0`` rows (tile height ``M_t``), whatever ``m_e`` is inside a tile: its time follows
the tile count, not the token count (ExpertPlex, arXiv 2607.18002). Every column block of
the output multiplies that count by the same factor, so row tiles are the unit here.

Legend: E experts, B a batch of independent problems.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import check_int

__all__ = ["decode_share", "decode_sm_share", "tile_footprint"]


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



def decode_share(decode_tiles, budget_tiles, units: int):
    """Decode's share of a GPU's ``units`` in one MoE layer's expert GEMM: the one rule.

    ExpertPlex's per-layer rule, used by the goodput model (:func:`decode_sm_share`, units =
    SMs) and by the runtime's persistent kernel (``serving.runtime.share.decode_programs``,
    units = programs). Decode's layer lasts ``budget_tiles`` whole-GPU tile times whatever its
    share (its lower bound: the model's weight-read time, the runtime's whole GEMM); the share
    at which its ``decode_tiles`` finish exactly within that loses decode nothing, and more
    units would only idle or be taken from prefill::

        share = clip(decode_tiles / budget_tiles, 1 / units, 1)

    0 without decode tiles, 1 with a zero budget (nothing to hide the tiles behind).

    Args:
        decode_tiles: decode's row tiles (``tile_footprint``; an expectation may be
            fractional), ``>= 0``; a number or a numpy array (one entry per layer).
        budget_tiles: whole-GPU tile times decode's layer lasts anyway, ``>= 0``; same shape.
        units: SMs or persistent programs of the GPU, ``>= 1``.

    Returns:
        the share in ``[1 / units, 1]`` (0 where there is no decode tile); a float for scalar
        inputs, else an array.
    """
    units = check_int("units", units, minimum=1)
    tiles, budget = np.asarray(decode_tiles, dtype=np.float64), np.asarray(budget_tiles, dtype=np.float64)
    for name, v in (("decode_tiles", tiles), ("budget_tiles", budget)):
        if v.size and not (v >= 0).all():
            raise ValueError(f"{name} has {v[~(v >= 0)].flat[0]}; allowed: numbers >= 0")
    need = tiles / np.maximum(budget, 1e-300)
    share = np.where(budget > 0, np.clip(need, 1.0 / units, 1.0), 1.0)
    share = np.where(tiles > 0, share, 0.0)
    return float(share) if share.ndim == 0 else share


def decode_sm_share(decode_tiles, tile_time_s: float, weight_read_s, num_sms: int):
    """Decode's SM share in one MoE layer for the goodput model (:func:`decode_share`).

    Decode's expert GEMM is bandwidth-bound: it cannot end before its experts' weights have
    streamed in (``weight_read_s``, at full HBM bandwidth, which every SM reaches), so its
    budget is ``weight_read_s / tile_time_s`` tile times: ``share = decode_tiles *
    tile_time_s / weight_read_s``, clamped to ``[1 / num_sms, 1]``.

    Args:
        decode_tiles: row tiles of the layer's decode batch on this GPU, ``>= 0``; a number,
            or a numpy array of one entry per layer (then ``weight_read_s`` is one too).
        tile_time_s: one row tile through the expert on the whole GPU, seconds (``> 0``).
        weight_read_s: reading the layer's active expert weights at full bandwidth, seconds.
        num_sms: SMs of the GPU, ``>= 1``.

    Returns:
        the share in ``[1 / num_sms, 1]``, or 0 where there is no decode tile.
    """
    if not tile_time_s > 0:
        raise ValueError(f"tile_time_s = {tile_time_s}; allowed: a number > 0")
    read = np.asarray(weight_read_s, dtype=np.float64)
    if read.size and not (read >= 0).all():
        raise ValueError(f"weight_read_s has {read[~(read >= 0)].flat[0]}; allowed: numbers >= 0")
    return decode_share(decode_tiles, read / tile_time_s, num_sms)
