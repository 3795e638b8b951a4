"""Expert ids as engines send them: decoding, layer selection, and where each id came from.

:mod:`relibra_torch.replay.engines` parses each engine's records into :class:`Piece` s: a
block of ``[T, L, K]`` ids together with the record, the field, the row of that field and the
engine's layer index of every kept row and layer. :func:`check_pieces` checks the ids
before they are joined into a file, so an error names the user's data (``record 0:
choices[0].routed_experts[2, 3, 1] = 99 (completion row 2, engine layer 3)``), never a
position after dense layers and pad rows were dropped.

Shape legend: T tokens (rows), H engine layers (the layer dim as sent), L kept layers, K top-k.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

__all__ = ["LayerIndices", "Piece", "check_pieces", "decode_ids", "from_per_layer", "json_ints", "parse_layer_spec",
           "select_layers", "select_moe_layers"]

_NPY_MAGIC = b"\x93NUMPY"
_INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")


class LayerIndices(tuple):
    """Layer indices to keep, counted in the layer dim as the engine sends it (``--moe-layers``)."""


@dataclass(frozen=True)
class Piece:
    """Consecutive rows of one sample, as one field of one record sent them.

    Attributes:
        ids_TLK: int64 ``[T, L, K]`` ids of the kept rows and layers.
        record: index of the record (0-based, in file order).
        field: the field's path in the record, e.g. ``choices[0].routed_experts``.
        rows_T: int64 ``[T]``: the row of the field (as sent) of each kept row.
        layers: the engine's index of each kept layer (``len == L``).
        row_name: what a row is, for messages (``completion row``, ``token position``, ...).
        row_base: added to a row to give the position named by ``row_name``.
    """

    ids_TLK: torch.Tensor
    record: int
    field: str
    rows_T: torch.Tensor
    layers: tuple[int, ...]
    row_name: str = "row"
    row_base: int = 0

    def head(self, n: int) -> "Piece":
        """The first ``n`` rows."""
        return Piece(self.ids_TLK[:n], self.record, self.field, self.rows_T[:n], self.layers,
                     self.row_name, self.row_base)

    def at(self, t: int, layer: int, k: int | None = None) -> str:
        """``record R: FIELD[row, layer(, k)] (ROW_NAME n, engine layer l)`` of a kept position."""
        row, eng = int(self.rows_T[t]), self.layers[layer]
        idx = f"{row}, {eng}" + ("" if k is None else f", {k}")
        return (f"record {self.record}: {self.field}[{idx}] ({self.row_name} {row + self.row_base}, "
                f"engine layer {eng})")


def check_pieces(pieces: Sequence[Piece], num_experts: int) -> None:
    """Every id in ``[0, E)`` and the top-k of a row distinct; the error names the position.

    Raises:
        ValueError naming the record, field, row and engine layer of the first bad id.
    """
    for p in pieces:
        ids = p.ids_TLK
        if ids.numel() == 0:
            continue
        neg, high = ids < 0, ids >= num_experts
        if bool(neg.any()):  # sglang-jax, slime pads and dense layers mark "no expert" with -1
            t, layer, k = (int(i) for i in neg.nonzero()[0])
            raise ValueError(f"{p.at(t, layer, k)} = {int(ids[t, layer, k])} is a placeholder (no expert) in a kept "
                             f"layer; keep only the MoE layers with --moe-layers or --model-config")
        if bool(high.any()):
            t, layer, k = (int(i) for i in high.nonzero()[0])
            raise ValueError(f"{p.at(t, layer, k)} = {int(ids[t, layer, k])} is out of range; allowed: expert ids in "
                             f"[0, {num_experts}) (the expert count comes from --num-experts or --model-config)")
        srt = ids.sort(dim=2).values
        dup = (srt[:, :, 1:] == srt[:, :, :-1]).any(dim=2)
        if bool(dup.any()):
            t, layer = (int(i) for i in dup.nonzero()[0])
            row = ids[t, layer].tolist()
            raise ValueError(f"{p.at(t, layer)} = {row} repeats an expert; allowed: {ids.shape[2]} distinct ids "
                             f"per token and layer (a dense layer's placeholder zeros? keep only the MoE layers "
                             f"with --moe-layers or --model-config)")


def _holds_bool(value) -> bool:
    """Whether a nested list holds a JSON boolean (numpy and torch read ``true`` as 1)."""
    if not isinstance(value, list):
        return isinstance(value, bool)
    if value and isinstance(value[0], list):
        return any(_holds_bool(v) for v in value)
    return bool in set(map(type, value))


def _not_int(v) -> str | None:
    """Why one JSON scalar is not an integer id, or None when it is one."""
    if isinstance(v, bool):
        return f"= {json.dumps(v)} is a boolean"
    if isinstance(v, int):
        return None if -2**63 <= v < 2**63 else f"is an integer of {v.bit_length()} bits (too large)"
    if isinstance(v, float):
        if not math.isfinite(v):
            return f"= {json.dumps(v)} is not a finite number"
        if not v.is_integer():
            return f"= {v!r} is not a whole number"
        return None if abs(v) < 2**63 else f"= {v!r} is too large"
    text = json.dumps(v, default=str)
    return f"= {text if len(text) <= 40 else text[:37] + '...'} is not a number"


def _why_not_ints(value, name: str) -> str:
    """The first entry of a nested list that keeps it from being an integer array, in words."""
    def at(idx):
        return f"{name}[{', '.join(map(str, idx))}]" if idx else name

    def walk(v, idx):
        if not isinstance(v, list):
            why = _not_int(v)
            return None if why is None else f"{at(idx)} {why}"
        nested = [isinstance(c, list) for c in v]
        if any(nested) and not all(nested):
            j = nested.index(not nested[0])
            return (f"{at(idx)} mixes lists and numbers: {at(idx + (0,))} is "
                    f"{'a list' if nested[0] else 'a number'}, {at(idx + (j,))} is not")
        if v and nested[0]:
            for j, c in enumerate(v):
                if len(c) != len(v[0]):
                    return (f"{name} has rows of different lengths: {at(idx + (j,))} has {len(c)} entries but "
                            f"{at(idx + (0,))} has {len(v[0])}")
        for j, c in enumerate(v):
            why = walk(c, idx + (j,))
            if why is not None:
                return why
        return None

    return walk(value, ()) or f"{name} is not a rectangular array (its rows nest to different depths)"


def json_ints(value, what: str, allowed: str = "integer expert ids") -> torch.Tensor:
    """An int64 tensor of a JSON number or nested list of integers.

    Whole-number floats (``3.0``) are read as integers; a fraction (``1.5``), a boolean,
    NaN/Infinity, a non-number or a ragged array is refused with one line naming the first
    bad entry, e.g. ``record 0: routed_experts[0, 0, 0, 0] = 1.5 is not a whole number;
    allowed: integer expert ids``. ``what`` is ``"record i: field"``; ``allowed`` ends the
    message.
    """
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError):
        arr = None
    if arr is not None and arr.dtype.kind in "iuf":
        if arr.dtype.kind == "f":
            ok = bool(np.all(np.isfinite(arr) & (arr == np.round(arr)) & (np.abs(arr) < 2.0**63)))
        else:
            ok = arr.dtype.kind == "i" or arr.size == 0 or int(arr.max()) < 2**63
        if ok and not _holds_bool(value):
            return torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64, copy=False))
    prefix, sep, name = what.rpartition(": ")
    try:
        why = _why_not_ints(value, name)
    except RecursionError:
        why = f"{name} is nested too deeply"
    raise ValueError(f"{prefix}{sep}{why}; allowed: {allowed}")


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is a string but not valid base64; allowed: base64 or a nested list") from None


def _as_tensor(arr: np.ndarray, what: str) -> torch.Tensor:
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} has dtype {arr.dtype}; allowed: integer expert ids")
    return torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64, copy=False))


def _flat(raw: bytes, what: str, flat_shape, rows) -> torch.Tensor:
    """SGLang's flat little-endian int32 buffer as ``[rows, H, K]``."""
    if len(raw) % 4:
        raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32 ids")
    flat = np.frombuffer(raw, dtype="<i4")
    H, K = flat_shape if flat_shape is not None else (None, None)
    if H is None and K is None and not rows:
        raise ValueError(f"{what}: a flat base64 buffer of {flat.size} ids needs its [layers, top_k]; "
                         f"pass --model-config, or --top-k with records that give their token count")
    if rows and (H is None or K is None):
        if flat.size % rows:
            raise ValueError(f"{what}: {flat.size} ids are not a whole number of rows for {rows} tokens")
        per_row = flat.size // rows
        if H is None and K is None:
            raise ValueError(f"{what}: {rows} rows of {per_row} ids each: the split into layers x top_k is "
                             f"unknown; pass --top-k (or --model-config)")
        if per_row % (K or H):
            raise ValueError(f"{what}: rows of {per_row} ids are not a whole number of "
                             f"{'top_k' if K else 'layers'} = {K or H}; check --top-k / --model-config")
        H, K = (per_row // K, K) if H is None else (H, per_row // H)
    if H is None or K is None:
        raise ValueError(f"{what}: a flat buffer of {flat.size} ids needs both layers and top_k, or the token "
                         f"count; pass --model-config (or --top-k with records that give their token count)")
    if not H or not K or flat.size % (H * K):
        raise ValueError(f"{what}: a flat buffer of {flat.size} ids cannot be reshaped to "
                         f"[tokens, layers={H}, top_k={K}]; check --model-config / --top-k")
    return _as_tensor(flat.reshape(-1, H, K), what)


LIST_IDS_ALLOWED = ("a rectangular array of integer expert ids (for layers with different token counts send "
                 "routed_experts_by_layer)")


def _decode(value, what: str, flat_shape, rows, allowed: str = LIST_IDS_ALLOWED) -> torch.Tensor:
    if isinstance(value, dict):
        if value.get("encoding") != "base64" or str(value.get("dtype")) not in _INT_DTYPES:
            raise ValueError(f"{what} is an object with encoding {value.get('encoding')!r}, dtype "
                             f"{value.get('dtype')!r}; allowed: base64 of an integer dtype")
        raw = _b64(value.get("data", ""), what)
        itemsize = np.dtype(value["dtype"]).itemsize
        if len(raw) % itemsize:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of {value['dtype']} ids")
        arr = np.frombuffer(raw, dtype=np.dtype(value["dtype"]).newbyteorder("<"))
        try:
            arr = arr.reshape([int(x) for x in value.get("shape", [])])
        except (ValueError, TypeError):
            raise ValueError(f"{what}: {arr.size} ids do not fill shape {value.get('shape')}") from None
        return _as_tensor(arr, what)
    if isinstance(value, str):
        raw = _b64(value, what)
        if raw.startswith(_NPY_MAGIC):
            try:
                return _as_tensor(np.load(io.BytesIO(raw), allow_pickle=False), what)
            except (ValueError, EOFError, OSError) as exc:
                raise ValueError(f"{what} is a damaged .npy buffer ({' '.join(str(exc).split())})") from None
        return _flat(raw, what, flat_shape, rows)
    if isinstance(value, torch.Tensor):  # already read (verl_samples)
        return value
    return json_ints(value, what, allowed)


def decode_ids(value, what: str, *, flat_shape: tuple[int | None, int | None] | None = None,
               rows: int | None = None) -> torch.Tensor:
    """Expert ids ``[T, H, K]`` (int64) from any encoding the engines use.

    Args:
        value: a nested list; a base64 string of a ``.npy`` buffer; a base64 string of a
            flat little-endian int32 buffer (SGLang); or ``{"encoding": "base64", "dtype",
            "shape", "data"}``.
        what: the field's name for messages.
        flat_shape: ``(H, K)`` of a flat buffer; one may be None when ``rows`` is known.
        rows: the token rows of a flat buffer (to infer a missing ``H`` or ``K``).
    """
    ids = _decode(value, what, flat_shape, rows)
    if ids.dim() != 3:
        raise ValueError(f"{what} has shape {tuple(ids.shape)}; allowed: [tokens, layers, top_k]")
    return ids


def parse_layer_spec(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """``"3-60"`` / ``"1,3,5-7"`` -> sorted layer indices (``--moe-layers``); an empty spec and
    a layer named twice are refused."""
    out: set[int] = set()
    if not str(text).strip():
        raise ValueError(f"--moe-layers {text!r} is empty; allowed: layer indices, e.g. 3-60 or 1,3,5 (or leave "
                         f"the option out to keep every layer, or the MoE layers of --model-config)")
    for part in str(text).split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"--moe-layers {text!r}: {part!r} is not N or N-M; allowed: e.g. 3-60 or 1,3,5") from None
        if lo_i < 0 or hi_i < lo_i:
            raise ValueError(f"--moe-layers {text!r}: {part!r} is not an increasing range of indices >= 0")
        twice = out.intersection(range(lo_i, hi_i + 1))
        if twice:
            raise ValueError(f"--moe-layers {text!r} names layer {min(twice)} twice; allowed: each layer once")
        out.update(range(lo_i, hi_i + 1))
    if num_layers is not None and out and max(out) >= num_layers:
        raise ValueError(f"--moe-layers {text!r} names layer {max(out)} but the model has {num_layers}")
    return tuple(sorted(out))


def _keep(n: int, select, what: str) -> list[int] | None:
    """Indices of the ``n`` layers to keep, or None to keep all (checked against ``select``)."""
    if select is None:
        return None
    if isinstance(select, LayerIndices):
        if select and max(select) >= n:
            raise ValueError(f"{what} has {n} layers but --moe-layers names layer {max(select)}")
        return list(select)
    keep = [i for i, m in enumerate(select) if m]
    if n == len(select):
        return keep
    if n == len(keep):
        return None
    raise ValueError(f"{what} has {n} layers but the model has {len(select)} layers of which "
                     f"{len(keep)} are MoE; fix --moe-layers or --model-config")


def select_layers(ids_THK: torch.Tensor, moe_map: Sequence[bool] | None, what: str
                  ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``([T, L, K] ids of the MoE layers, the engine index of each kept layer)``.

    With a map (one bool per transformer layer): an ``H`` equal to its length is cut to the
    MoE layers (SGLang and slime count dense layers), an ``H`` equal to the MoE count is
    kept (vLLM). :class:`LayerIndices` keep exactly those layers. Without either every
    layer is kept, but placeholder layers (all ids -1, or all 0 with top_k > 1) are
    refused: they would count as expert 0.
    """
    H = ids_THK.shape[1]
    if moe_map is not None:
        keep = _keep(H, moe_map, what)
        return (ids_THK, tuple(range(H))) if keep is None else (ids_THK[:, keep], tuple(keep))
    K = ids_THK.shape[2]
    if ids_THK.shape[0]:
        placeholder = (ids_THK == -1).all(dim=(0, 2)) | ((ids_THK == 0).all(dim=(0, 2)) & (K > 1))
        if bool(placeholder.any()):
            bad = placeholder.nonzero().flatten().tolist()
            raise ValueError(f"{what}: layers {bad} hold only placeholder ids (dense layers): pass "
                             f"--model-config or --moe-layers to keep the MoE layers only")
    return ids_THK, tuple(range(H))


def select_moe_layers(ids_THK: torch.Tensor, moe_map: Sequence[bool] | None, what: str) -> torch.Tensor:
    """The ``[T, L, K]`` ids of the MoE layers (see :func:`select_layers`)."""
    return select_layers(ids_THK, moe_map, what)[0]


def from_per_layer(ids_per_layer: Sequence, moe_map: Sequence[bool] | None, what: str
                   ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``([T, L, K], engine layer of each kept layer)`` from one ``[T_l, K]`` array per layer,
    when the kept layers agree on ``T``.

    Layers with different token counts (an encoder/decoder pair, MTP layers) cannot share a
    ``relibra.routing/1`` file, which routes every token through every MoE layer; the error
    says which layers differ and what to do instead.
    """
    if not isinstance(ids_per_layer, (list, tuple)) or not ids_per_layer:
        raise ValueError(f"{what} is not a non-empty list of [tokens, top_k] arrays (one per layer)")
    layers = [_decode(layer, f"{what}[{i}]", None, None, "integer expert ids")
              for i, layer in enumerate(ids_per_layer)]
    for i, t in enumerate(layers):
        if t.dim() != 2:
            raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)}; allowed: [tokens, top_k]")
    keep = _keep(len(layers), moe_map, what)
    kept = tuple(range(len(layers))) if keep is None else tuple(keep)
    layers = [layers[i] for i in kept]
    if len({t.shape[1] for t in layers}) > 1:
        raise ValueError(f"{what}: the layers have top_k {sorted({t.shape[1] for t in layers})}; allowed: one top_k")
    counts = [t.shape[0] for t in layers]
    if len(set(counts)) > 1:
        groups: dict[int, list[int]] = {}
        for i, c in zip(kept, counts):
            groups.setdefault(c, []).append(i)
        text = "; ".join(f"layers {_ranges(v)} hold {c} tokens" for c, v in groups.items())
        raise ValueError(f"{what}: {text}. A relibra.routing/1 file routes every token through every "
                         f"MoE layer: convert each group of layers on its own (--moe-layers, one output "
                         f"file each) and simulate them separately, or drop the tokens some layers lack")
    return torch.stack(layers, dim=1), kept


def _ranges(idx: list[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
