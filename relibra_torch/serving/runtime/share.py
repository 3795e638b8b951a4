"""The decode share of a persistent two-phase grouped GEMM, in programs.

A thin conversion of the one per-layer rule, :func:`relibra_torch.serving.tiles.decode_share`
(the goodput model's ``decode_sm_share`` is the same rule in SMs), to a program count.
"""

from __future__ import annotations

import math

from ...checks import check_int
from ..tiles import decode_share

__all__ = ["decode_programs"]


def decode_programs(programs: int, decode_tiles: int, prefill_tiles: int, minimum: int = 1,
                    budget_tiles: float | None = None) -> int:
    """Programs (of ``programs``) that take decode tiles first, for one layer's GEMM.

    ``ceil(programs * decode_share(decode_tiles, budget_tiles, programs))``, at least
    ``minimum`` (so one decode tile never waits for more than one tile plus a check) and at
    most ``programs``; none without decode tiles. The budget is the tile times decode's layer
    lasts anyway: the model passes its weight-read time over the tile time; the runtime knows
    no bandwidth, and its default is the whole GEMM, ``decode_tiles + prefill_tiles`` (then
    decode gets ``ceil(programs * decode_tiles / (decode_tiles + prefill_tiles))`` and all
    programs without prefill tiles).

    Args:
        programs: persistent programs ``P`` (>= 1).
        decode_tiles, prefill_tiles: the phases' tile counts (``tile_footprint`` times the
            column blocks), >= 0.
        minimum: the floor of the count when decode has tiles (>= 0).
        budget_tiles: see above (default ``decode_tiles + prefill_tiles``).

    Returns:
        An int in ``[0, programs]``.
    """
    programs = check_int("programs", programs)
    decode_tiles = check_int("decode_tiles", decode_tiles, 0)
    prefill_tiles = check_int("prefill_tiles", prefill_tiles, 0)
    minimum = check_int("minimum", minimum, 0)
    if decode_tiles == 0:
        return 0
    budget = decode_tiles + prefill_tiles if budget_tiles is None else budget_tiles
    count = math.ceil(programs * decode_share(decode_tiles, budget, programs) - 1e-9)
    return min(programs, max(minimum, count))
