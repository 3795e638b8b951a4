"""The measured tile time of ``make gpu-check`` for the serving model's override.

``make gpu-check`` (part ``expertplex``) writes the persistent kernel's tile time under
``gpu_check.json["expertplex"]["tile_time_us"]``; :func:`tile_time_us` reads it back so a
model can take it in place of its documented default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

__all__ = ["GPU_CHECK_KEY", "tile_time_us"]

GPU_CHECK_KEY = ("expertplex", "tile_time_us")


def tile_time_us(path: str | Path) -> float:
    """The tile time (microseconds, > 0) recorded in a ``gpu_check.json`` (file or its folder)."""
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
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"tile time: {p} has no positive {'.'.join(GPU_CHECK_KEY)} (got {value!r}); it is written "
                         f"when `make gpu-check` ran its expertplex part on a CUDA GPU")
    return float(value)
