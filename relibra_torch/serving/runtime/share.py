"""The decode share of a persistent two-phase grouped GEMM (one pure function).

Part 1's goodput model (``relibra serve-sim``) states its own per-layer share rule from the
same tile footprint (:func:`relibra_torch.serving.tiles.tile_footprint`); this is the
runtime's, kept to one function so the two can be unified in one place.
"""

from __future__ import annotations

from ...checks import check_int

__all__ = ["decode_programs"]


def decode_programs(programs: int, decode_tiles: int, prefill_tiles: int, minimum: int = 1) -> int:
    """Programs (of ``programs``) that take decode tiles first, for one layer's GEMM.

    The share follows the tile footprint, not the token count: decode gets
    ``ceil(programs * decode_tiles / (decode_tiles + prefill_tiles))`` programs, at least
    ``minimum`` (so one decode tile never waits for more than one tile plus a check) and at
    most ``programs``; none without decode tiles, all without prefill tiles.

    Args:
        programs: persistent programs ``P`` (>= 1).
        decode_tiles, prefill_tiles: the phases' tile counts (``tile_footprint`` times the
            column blocks), >= 0.
        minimum: the floor of the share when decode has tiles (>= 0).

    Returns:
        An int in ``[0, programs]``.
    """
    programs = check_int("programs", programs)
    decode_tiles = check_int("decode_tiles", decode_tiles, 0)
    prefill_tiles = check_int("prefill_tiles", prefill_tiles, 0)
    minimum = check_int("minimum", minimum, 0)
    if decode_tiles == 0:
        return 0
    if prefill_tiles == 0:
        return programs
    share = -(-programs * decode_tiles // (decode_tiles + prefill_tiles))
    return min(programs, max(minimum, share))
