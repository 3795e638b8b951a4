"""Loaders for the shared reference routing data (``../shared/data`` beside the repository).

The files are the single source of truth for calibration: nothing derived from them is
copied into the package. Parsed JSON is cached per resolved path, and every accessor returns
fresh tensors, so callers may modify what they get.

Location: ``<repo root>/../shared/data``, i.e. ``Path(__file__).resolve().parents[2].parent /
"shared" / "data"`` (the package is installed editable, so ``__file__`` lives in the
checkout), unless the environment variable ``RELIBRA_SHARED_DATA`` names another folder.

Legend: L layers, E experts, D text domains.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "ENV_VAR",
    "QWEN3_HEAT_FILE",
    "OLMOE_DOMAIN_FILE",
    "HeatReference",
    "shared_data_dir",
    "qwen3_expert_heat",
    "olmoe_domain_counts",
]

ENV_VAR = "RELIBRA_SHARED_DATA"
QWEN3_HEAT_FILE = "qwen3-30b-a3b-expert-heat.json"
OLMOE_DOMAIN_FILE = "olmoe-domain-expert-counts.json"


def shared_data_dir() -> Path:
    """The folder that holds the shared reference data.

    Returns ``$RELIBRA_SHARED_DATA`` if set, else ``<repo root>/../shared/data``.
    Raises ``FileNotFoundError`` naming the path (and how to override it) if it is missing.
    """
    override = os.environ.get(ENV_VAR)
    if override:
        path = Path(override).expanduser().resolve()
        origin = f"${ENV_VAR}"
    else:
        path = Path(__file__).resolve().parents[2].parent / "shared" / "data"
        origin = "the default location <repo root>/../shared/data"
    if not path.is_dir():
        raise FileNotFoundError(
            f"shared reference data folder not found: {path} (from {origin}); clone the "
            f"project with shared/ beside the repository or set {ENV_VAR} to the folder "
            f"holding {QWEN3_HEAT_FILE}")
    return path


def _data_file(name: str) -> Path:
    path = shared_data_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"shared reference data file not found: {path}; set {ENV_VAR} "
                                f"to a folder that holds {name}")
    return path


@functools.lru_cache(maxsize=8)
def _parse_json(path: str, mtime_ns: int) -> dict:
    # mtime_ns is part of the key only so that an edited file is re-read.
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load(name: str) -> dict:
    path = _data_file(name)
    return _parse_json(str(path), path.stat().st_mtime_ns)


@dataclass(frozen=True)
class HeatReference:
    """Whole-trace expert heat of one model (``qwen3-30b-a3b-expert-heat.json``).

    Attributes:
        heat_LE: int64 ``[L, E]``, tokens whose top-k contains expert ``e`` in layer ``l``
            (each row sums to ``num_tokens * top_k``).
        num_tokens: tokens in the trace (75,773 for Qwen3-30B-A3B).
        top_k: experts per token.
        model: model name as the file states it.
    """

    heat_LE: torch.Tensor
    num_tokens: int
    top_k: int
    model: str

    def max_over_mean_L(self) -> torch.Tensor:
        """float64 ``[L]``: per-layer max/mean of the heat (README: 3.1 to 7.7, mean 5.6)."""
        h = self.heat_LE.to(torch.float64)
        return h.amax(-1) / h.mean(-1)


def qwen3_expert_heat() -> HeatReference:
    """Qwen3-30B-A3B per-layer expert heat (48 x 128, top-8, 75,773 decode tokens).

    Raises ``ValueError`` if the file's shape or totals are inconsistent.
    """
    d = _load(QWEN3_HEAT_FILE)
    L, E, K, T = int(d["num_layers"]), int(d["num_experts"]), int(d["top_k"]), int(d["num_tokens"])
    layers = sorted(d["layers"], key=lambda x: int(x["layer"]))
    heat_LE = torch.tensor([layer["heat"] for layer in layers], dtype=torch.int64)
    if tuple(heat_LE.shape) != (L, E):
        raise ValueError(f"{QWEN3_HEAT_FILE}: heat has shape {tuple(heat_LE.shape)}, "
                         f"expected (num_layers, num_experts) = ({L}, {E})")
    if (heat_LE < 0).any() or (heat_LE > T).any():
        raise ValueError(f"{QWEN3_HEAT_FILE}: heat counts must lie in [0, num_tokens={T}]")
    return HeatReference(heat_LE=heat_LE, num_tokens=T, top_k=K, model=str(d["model"]))


def olmoe_domain_counts(model: str = "olmoe", kind: str = "all_choices"
                        ) -> tuple[tuple[int, ...], dict[str, torch.Tensor]]:
    """Per-domain expert token counts from ``olmoe-domain-expert-counts.json``.

    Args:
        model: one of the file's models (``olmoe``, ``olmoe-sft``, ``olmoe-dpo``, ``mistral``).
        kind: ``all_choices`` (every top-k slot) or ``top1_only``.
    Returns:
        ``(layers, counts)``: the source layer indices and, per domain name, an int64
        ``[len(layers), E]`` tensor of counts.
    """
    d = _load(OLMOE_DOMAIN_FILE)
    models = d["models"]
    if model not in models:
        raise ValueError(f"model={model!r} is not in {OLMOE_DOMAIN_FILE}; allowed: {sorted(models)}")
    m = models[model]
    if kind not in ("all_choices", "top1_only"):
        raise ValueError(f"kind={kind!r} is invalid; allowed: 'all_choices', 'top1_only'")
    counts = {dom: torch.tensor(v, dtype=torch.int64) for dom, v in m[kind].items()}
    return tuple(int(x) for x in m["layers"]), counts
