"""The measured tile time of ``make gpu-check`` for the serving model's override.

``make gpu-check`` (part ``expertplex``) writes the persistent kernel's tile time under
``gpu_check.json["expertplex"]["tile_time_us"]``: the time one program spends on one output
tile (``tile_m x tile_n`` outputs over ``K = dim``, bf16) of its grouped GEMM, with the tile
shape, ``dim`` and the program count beside it. :func:`tile_time_us` reads it back;
:func:`kernel_flops` turns it into the rate the kernel reached over the whole GPU
(``2 tile_m tile_n dim`` FLOPs a tile, ``programs`` tiles at once), which is what carries to
another model's expert: the serving model's own tile is a row tile through a whole expert.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["GPU_CHECK_KEY", "kernel_flops", "tile_time_us"]

GPU_CHECK_KEY = ("expertplex", "tile_time_us")


def tile_time_us(path: str | Path) -> float:
    """The tile time (microseconds, > 0) recorded in a ``gpu_check.json`` (file or its folder)."""
    return _record(path)[1]


def kernel_flops(path: str | Path) -> float:
    """The bf16 FLOP/s the measured kernel reached on the whole GPU: ``2 tile_m tile_n dim``
    FLOPs a tile, ``programs`` tiles in flight, ``tile_time_us`` each."""
    p, value, part = _record(path)
    tile, dim, programs = part.get("tile"), part.get("dim"), part.get("programs")
    if not (isinstance(tile, list) and len(tile) >= 2 and all(_positive(x) for x in tile[:2])
            and _positive(dim) and _positive(programs)):
        raise ValueError(f"tile time: {p} has no tile shape, dim and program count beside "
                         f"{'.'.join(GPU_CHECK_KEY)} (got tile={tile!r}, dim={dim!r}, programs={programs!r}); "
                         f"rerun `make gpu-check` with this version")
    return 2.0 * tile[0] * tile[1] * dim * programs / (value * 1e-6)


def _positive(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _record(path: str | Path) -> tuple[Path, float, dict]:
    """``(file, tile_time_us, the expertplex record)`` of a ``gpu_check.json``, or a one-line error."""
    p = Path(path)
    if p.is_dir():
        p = p / "gpu_check.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tile time: cannot read {p} ({type(e).__name__}: {e}); allowed: the gpu_check.json "
                         f"that `make gpu-check` writes (default out/gpu-check/)") from None
    part = data.get(GPU_CHECK_KEY[0]) if isinstance(data, dict) else None  # null or a note when it was skipped
    value = part.get(GPU_CHECK_KEY[1]) if isinstance(part, dict) else part
    if not _positive(value):
        raise ValueError(f"tile time: {p} has no positive {'.'.join(GPU_CHECK_KEY)} (got {value!r}); it is written "
                         f"when `make gpu-check` ran its expertplex part on a CUDA GPU")
    return p, float(value), part
