"""Loads files: already-batched token counts per (step, micro-batch, layer, source, expert).

File format ``relibra.loads/1`` (safetensors):

* tensor ``loads``: int32 or int64 ``[steps, micro_batches, num_layers, source_ranks,
  num_experts]``, all dims >= 1, values >= 0;
* metadata ``format = "relibra.loads/1"``, ``top_k`` (decimal integer), optional ``model``.

The counts must come from whole tokens, each routed to ``top_k`` distinct experts: for every
(step, micro-batch, layer, source) the sum over experts is ``top_k * tokens``, the token
count is the same in every layer of one (step, micro-batch, source), and no expert gets more
than ``tokens`` (one token counts at most once per expert). An empty (0-token) micro-batch on
a source rank is allowed.

Shape legend:
  X  steps   M  micro-batches   L  MoE layers   S  source ranks   E  logical experts
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..checks import check_int, check_tensor
from .counts import MAX_EXPERTS
from .fileio import (check_format, check_names, check_text_metadata, dtype_name, parse_int_metadata, read_header,
                     read_tensors, write_tensors)
from .routing import MAX_TOP_K

__all__ = ["LOADS_FORMAT", "LoadsFile", "validate_loads", "tokens_from_loads", "save_loads", "load_loads"]

LOADS_FORMAT = "relibra.loads/1"
_LOADS_DTYPES = (torch.int32, torch.int64)


def _pos(flat_index: int, shape) -> list[int]:
    return [int(i) for i in torch.unravel_index(torch.tensor(flat_index), tuple(shape))]


#: The most tokens one (step, micro-batch, layer, source) may send an expert: sums over
#: 2**20 experts and the step's ranks and micro-batches then stay well inside int64.
MAX_COUNT = 2**40


def validate_loads(loads_XMLSE, top_k: int) -> None:
    """Check a loads tensor int32/int64 ``[X, M, L, S, E]`` against ``top_k``.

    Raises ``ValueError`` naming the first bad (step, micro-batch, layer, source) and the
    rule it breaks (non-negative counts, sums divisible by ``top_k``, equal token counts in
    all layers, no expert above the token count); ``TypeError`` for a non-tensor.
    """
    loads_XMLSE = check_tensor("loads", loads_XMLSE)
    check_int("top_k", top_k, 1, MAX_TOP_K)
    if loads_XMLSE.dtype not in _LOADS_DTYPES:
        raise ValueError(f"loads has dtype {dtype_name(loads_XMLSE.dtype)}; allowed: int32 or int64")
    if loads_XMLSE.dim() != 5 or min(loads_XMLSE.shape) < 1:
        raise ValueError(
            f"loads has shape {tuple(loads_XMLSE.shape)}; allowed: [steps, micro_batches, num_layers, "
            "source_ranks, num_experts], every dim >= 1"
        )
    X, M, L, S, E = loads_XMLSE.shape
    if E > MAX_EXPERTS:
        raise ValueError(f"loads has {E} experts; allowed: at most {MAX_EXPERTS}")
    if top_k > E:
        raise ValueError(f"top_k = {top_k} exceeds num_experts = {E} (loads shape {tuple(loads_XMLSE.shape)}); allowed: top_k <= num_experts")
    bad = loads_XMLSE < 0
    if loads_XMLSE.dtype == torch.int64:  # (an int32 count cannot pass it; comparing one with 2**40 would wrap)
        bad |= loads_XMLSE > MAX_COUNT
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        pos = _pos(flat, loads_XMLSE.shape)
        raise ValueError(f"loads{pos} = {int(loads_XMLSE.reshape(-1)[flat])}; allowed: counts in [0, 2**40] "
                         f"(larger ones overflow the step's sums)")
    sums_XMLS = loads_XMLSE.sum(dim=-1, dtype=torch.int64)
    rem = sums_XMLS % top_k != 0
    if bool(rem.any()):
        flat = int(rem.reshape(-1).nonzero()[0, 0])
        x, m, l, s = _pos(flat, sums_XMLS.shape)
        raise ValueError(
            f"loads[{x}, {m}, {l}, {s}, :] sums to {int(sums_XMLS[x, m, l, s])}, not a multiple of top_k = {top_k}; "
            "allowed: top_k * whole tokens"
        )
    tokens_XMLS = sums_XMLS // top_k
    differ = tokens_XMLS != tokens_XMLS[:, :, :1, :]
    if bool(differ.any()):
        flat = int(differ.reshape(-1).nonzero()[0, 0])
        x, m, l, s = _pos(flat, tokens_XMLS.shape)
        raise ValueError(
            f"loads[{x}, {m}, {l}, {s}, :] holds {int(tokens_XMLS[x, m, l, s])} tokens but layer 0 of the same "
            f"(step, micro-batch, source) holds {int(tokens_XMLS[x, m, 0, s])}; allowed: the same token count in every layer"
        )
    over = loads_XMLSE > tokens_XMLS[..., None]
    if bool(over.any()):
        flat = int(over.reshape(-1).nonzero()[0, 0])
        x, m, l, s, e = _pos(flat, loads_XMLSE.shape)
        raise ValueError(
            f"loads[{x}, {m}, {l}, {s}, {e}] = {int(loads_XMLSE[x, m, l, s, e])} exceeds the {int(tokens_XMLS[x, m, l, s])} "
            "tokens of that (step, micro-batch, layer, source); allowed: at most one count per token per expert"
        )


def tokens_from_loads(loads_XMLSE, top_k: int) -> torch.Tensor:
    """int64 ``[X, M, S]`` tokens per (step, micro-batch, source) of a valid loads tensor."""
    return loads_XMLSE[:, :, 0].sum(dim=-1, dtype=torch.int64) // top_k


@dataclass(frozen=True, eq=False)
class LoadsFile:
    """A validated loads tensor with its ``top_k`` (and optional ``model``)."""

    loads_XMLSE: torch.Tensor
    top_k: int
    model: str | None = None

    def __post_init__(self):
        validate_loads(self.loads_XMLSE, self.top_k)
        if self.model is not None:
            check_text_metadata(self.model, "model", "loads")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return tuple(self.loads_XMLSE.shape)

    def tokens(self) -> torch.Tensor:
        """int64 ``[X, M, S]`` tokens per (step, micro-batch, source)."""
        return tokens_from_loads(self.loads_XMLSE, self.top_k)

    def __iter__(self):
        # Allows `loads, top_k = load_loads(path)`.
        return iter((self.loads_XMLSE, self.top_k))


def save_loads(path, loads_XMLSE, top_k: int, *, model: str | None = None) -> None:
    """Validate and write a ``relibra.loads/1`` file.

    Args:
        loads_XMLSE: int32/int64 ``[X, M, L, S, E]`` counts (a single step's ``[M, L, S, E]``
            from :meth:`RoutingReplay.counts` becomes ``loads[None]``).
        top_k: experts per token.
        model: optional printable name.
    """
    if model is not None:
        check_text_metadata(model, "model", "loads")
    validate_loads(loads_XMLSE, top_k)
    metadata = {"format": LOADS_FORMAT, "top_k": str(top_k)}
    if model is not None:
        metadata["model"] = model
    write_tensors(path, {"loads": loads_XMLSE}, metadata)


def load_loads(path) -> LoadsFile:
    """Read and validate a ``relibra.loads/1`` file; unpacks as ``loads, top_k``.

    Raises ``FileNotFoundError`` for a missing file, ``ValueError`` for anything wrong.
    """
    header = read_header(path)
    where = f"file {os.fspath(path)!r}"
    meta = header.metadata
    check_format(meta, LOADS_FORMAT, where)
    check_names(meta, ("format", "top_k"), ("model",), "metadata", where)
    check_names(header.tensors, ("loads",), (), "tensor", where)
    top_k = parse_int_metadata(meta, "top_k", where, 1, MAX_TOP_K)
    model = meta.get("model")
    if model is not None:
        check_text_metadata(model, "metadata model", where)
    if header.dtype("loads") not in _LOADS_DTYPES:
        raise ValueError(f"{where}: loads has dtype {dtype_name(header.dtype('loads'))}; allowed: int32 or int64")
    shape = header.shape("loads")
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(
            f"{where}: loads has shape {list(shape)}; allowed: [steps, micro_batches, num_layers, source_ranks, "
            "num_experts], every dim >= 1"
        )
    loads = read_tensors(header, ["loads"])["loads"]
    try:
        return LoadsFile(loads, top_k, model)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


