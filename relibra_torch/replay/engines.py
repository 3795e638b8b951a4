"""Routing replay from serving-engine and RL-framework responses (``relibra convert``).

Each converter takes the decoded JSON records (one response, or one sample, each) and
returns, per sample, ``(index of the record it starts in, [T_i, L, K] expert ids)`` of the
**MoE layers only, real tokens only**, ready for :func:`relibra_torch.replay.from_per_sample`
(a record's optional ``step`` becomes the sample's ``sample_step``).

Layouts followed (checked against the engines' sources and docs, see docs/replay.md):

* **SGLang** ``/generate`` with ``return_routed_experts``: ``meta_info["routed_experts"]``
  is base64 of a flat int32 buffer, reshaped ``[tokens, num_hidden_layers, top_k]``. The
  layer dim counts every transformer layer (dense layers hold placeholder zeros), and the
  rows cover positions ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)``
  (the last generated token is never forwarded). A response with ``routed_experts_start_len
  > 0`` continues the sample of the records before it (multi-turn appended chunks).
* **slime**: a sample's ``rollout_routed_experts`` (or ``routed_experts``) ``[tokens, layers,
  top_k]``, as nested lists or as SGLang's base64 string; the layer dim counts dense layers.
* **vLLM** (OpenAI server with ``--enable-return-routed-experts``): response-level
  ``prompt_routed_experts`` ``[prompt_tokens, num_moe_layers, top_k]`` and per choice
  ``routed_experts`` ``[completion rows, num_moe_layers, top_k]`` (int16 ids of MoE layers
  only), as nested lists, as a base64 ``.npy`` buffer, or as ``{"encoding": "base64",
  "dtype", "shape", "data"}``; ``outputs`` (offline ``RequestOutput``) is read like
  ``choices``. One sample per choice: prompt rows, then completion rows.
* **verl** (router replay R3): a padded batch ``{"routed_experts": [B, P, L, K],
  "attention_mask": [B, P]}`` (or ``"lengths": [B]`` for right padding), or one row per
  record with ``routed_experts`` ``[P, L, K]`` and ``attention_mask`` ``[P]``.

Padding never reaches a file: a record's ``attention_mask`` (0 = pad) or ``length`` drops
the pad rows before counting. A record whose layers hold different token counts
(``routed_experts_by_layer``: a list per layer of ``[T_l, K]``) is refused unless the
selected MoE layers agree, with a message saying what to do instead.

Shape legend: T tokens (rows), H engine layers (the layer dim as sent), L MoE layers, K top-k.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Iterable, Sequence

import numpy as np
import torch

__all__ = ["ENGINES", "LayerIndices", "decode_ids", "parse_layer_spec", "select_moe_layers", "from_per_layer",
           "sglang_samples", "slime_samples", "vllm_samples", "verl_samples"]

ENGINES = ("verl", "slime", "sglang", "vllm")
_NPY_MAGIC = b"\x93NUMPY"
_INT_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64")


class LayerIndices(tuple):
    """Layer indices to keep, counted in the layer dim as the engine sends it (``--moe-layers``)."""


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


def _b64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is a string but not valid base64; allowed: base64 or a nested list") from None


def _as_tensor(arr: np.ndarray, what: str) -> torch.Tensor:
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} has dtype {arr.dtype}; allowed: integer expert ids")
    return torch.from_numpy(np.ascontiguousarray(arr).astype(np.int64, copy=False))


def _decode(value, what: str, flat_shape, rows) -> torch.Tensor:
    if isinstance(value, dict):
        if value.get("encoding") != "base64" or str(value.get("dtype")) not in _INT_DTYPES:
            raise ValueError(f"{what} is an object with encoding {value.get('encoding')!r}, dtype "
                             f"{value.get('dtype')!r}; allowed: base64 of an integer dtype")
        arr = np.frombuffer(_b64(value.get("data", ""), what), dtype=np.dtype(value["dtype"]).newbyteorder("<"))
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
                raise ValueError(f"{what} is a damaged .npy buffer ({exc})") from None
        if flat_shape is None:
            raise ValueError(f"{what}: a flat base64 buffer needs its shape; allowed here: a nested "
                             f"list, a base64 .npy buffer or an encoding/dtype/shape/data object")
        if len(raw) % 4:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32 ids")
        flat = np.frombuffer(raw, dtype="<i4")
        H, K = flat_shape
        if rows and (H is None) != (K is None):
            per_row = flat.size // rows
            H, K = (per_row // K, K) if H is None else (H, per_row // H)
        if not H or not K or flat.size % (H * K):
            raise ValueError(f"{what}: a flat buffer of {flat.size} ids cannot be reshaped to "
                             f"[tokens, layers={H}, top_k={K}]; pass --model-config (or --top-k)")
        return _as_tensor(flat.reshape(-1, H, K), what)
    try:
        return torch.as_tensor(value, dtype=torch.int64)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"{what} is not a rectangular array of ints (ragged, or not numbers); "
                         f"for layers with different token counts send routed_experts_by_layer") from None


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
    """``"3-60"`` / ``"1,3,5-7"`` -> sorted layer indices (``--moe-layers``)."""
    out: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        try:
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi) if hi else int(lo)
        except ValueError:
            raise ValueError(f"--moe-layers {text!r}: {part!r} is not N or N-M; allowed: e.g. 3-60 or 1,3,5") from None
        if lo_i < 0 or hi_i < lo_i:
            raise ValueError(f"--moe-layers {text!r}: {part!r} is not an increasing range of indices >= 0")
        out.update(range(lo_i, hi_i + 1))
    if num_layers is not None and out and max(out) >= num_layers:
        raise ValueError(f"--moe-layers {text!r} names layer {max(out)} but the model has {num_layers}")
    return tuple(sorted(out))


def select_moe_layers(ids_THK: torch.Tensor, moe_map: Sequence[bool] | None, what: str) -> torch.Tensor:
    """Keep the MoE layers of ``[T, H, K]`` ids.

    With a map (one bool per transformer layer): an ``H`` equal to its length is cut to the
    MoE layers (SGLang and slime count dense layers), an ``H`` equal to the MoE count is
    kept (vLLM). :class:`LayerIndices` keep exactly those layers. Without either every
    layer is kept, but placeholder layers (all ids -1, or all 0 with top_k > 1) are
    refused: they would count as expert 0.
    """
    if moe_map is not None:
        keep = _keep(ids_THK.shape[1], moe_map, what)
        return ids_THK if keep is None else ids_THK[:, keep]
    K = ids_THK.shape[2]
    if ids_THK.shape[0]:
        placeholder = (ids_THK == -1).all(dim=(0, 2)) | ((ids_THK == 0).all(dim=(0, 2)) & (K > 1))
        if bool(placeholder.any()):
            bad = placeholder.nonzero().flatten().tolist()
            raise ValueError(f"{what}: layers {bad} hold only placeholder ids (dense layers): pass "
                             f"--model-config or --moe-layers to keep the MoE layers only")
    return ids_THK


def from_per_layer(ids_per_layer: Sequence, moe_map: Sequence[bool] | None, what: str) -> torch.Tensor:
    """``[T, L, K]`` from one ``[T_l, K]`` array per layer, when the kept layers agree on ``T``.

    Layers with different token counts (an encoder/decoder pair, MTP layers) cannot share a
    ``relibra.routing/1`` file, which routes every token through every MoE layer; the error
    says which layers differ and what to do instead.
    """
    layers = [_decode(layer, f"{what}[{i}]", None, None) for i, layer in enumerate(ids_per_layer)]
    for i, t in enumerate(layers):
        if t.dim() != 2:
            raise ValueError(f"{what}[{i}] has shape {tuple(t.shape)}; allowed: [tokens, top_k]")
    keep = _keep(len(layers), moe_map, what)
    if keep is not None:
        layers = [layers[i] for i in keep]
    if len({t.shape[1] for t in layers}) > 1:
        raise ValueError(f"{what}: the layers have top_k {sorted({t.shape[1] for t in layers})}; allowed: one top_k")
    counts = [t.shape[0] for t in layers]
    if len(set(counts)) > 1:
        groups: dict[int, list[int]] = {}
        for i, c in enumerate(counts):
            groups.setdefault(c, []).append(i)
        text = "; ".join(f"layers {_ranges(v)} hold {c} tokens" for c, v in groups.items())
        raise ValueError(f"{what}: {text}. A relibra.routing/1 file routes every token through every "
                         f"MoE layer: convert each group of layers on its own (--moe-layers, one output "
                         f"file each) and simulate them separately, or drop the tokens some layers lack")
    return torch.stack(layers, dim=1)


def _ranges(idx: list[int]) -> str:
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def _drop_pads(ids_TLK: torch.Tensor, record: dict, what: str) -> torch.Tensor:
    """Drop the pad rows a record marks (``attention_mask`` 0, or rows past ``length``)."""
    if record.get("attention_mask") is not None:
        mask = torch.as_tensor(record["attention_mask"])
        if mask.dim() != 1 or mask.numel() != ids_TLK.shape[0] or bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError(f"{what}: attention_mask must be 0/1 per row ({ids_TLK.shape[0]} rows), "
                             f"got shape {tuple(mask.shape)}")
        ids_TLK = ids_TLK[mask.bool()]
    if record.get("length") is not None:
        n = record["length"]
        if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= ids_TLK.shape[0]:
            raise ValueError(f"{what}: length = {n!r}; allowed: an int in [1, {ids_TLK.shape[0]}] (the real rows)")
        ids_TLK = ids_TLK[:n]
    return ids_TLK


def _ids_of(record: dict, keys: Iterable[str], what: str, moe_map, **decode) -> torch.Tensor:
    for key in keys:
        if record.get(key) is not None:
            return select_moe_layers(decode_ids(record[key], f"{what}.{key}", **decode), moe_map, what)
    if record.get("routed_experts_by_layer") is not None:
        return from_per_layer(record["routed_experts_by_layer"], moe_map, f"{what}.routed_experts_by_layer")
    raise ValueError(f"{what} has none of the fields {list(keys) + ['routed_experts_by_layer']}")


def _int_field(d: dict, key: str) -> int | None:
    v = d.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def sglang_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None) -> list[tuple[int, torch.Tensor]]:
    """Samples from SGLang ``/generate`` responses (see the module docstring)."""
    samples: list[torch.Tensor] = []
    for i, rec in enumerate(records):
        what = f"record {i}"
        meta = rec.get("meta_info") if isinstance(rec, dict) else None
        if not isinstance(meta, dict) or meta.get("routed_experts") is None:
            raise ValueError(f"{what} has no meta_info.routed_experts; start SGLang with "
                             f"--enable-return-routed-experts and send return_routed_experts=true")
        start = _int_field(meta, "routed_experts_start_len") or 0
        P, C = _int_field(meta, "prompt_tokens"), _int_field(meta, "completion_tokens")
        rows = P + C - 1 - start if P is not None and C is not None else None
        ids = decode_ids(meta["routed_experts"], f"{what}.meta_info.routed_experts",
                         flat_shape=(num_layers, top_k), rows=rows)
        if rows is not None and ids.shape[0] != rows:
            raise ValueError(f"{what}: routed_experts has {ids.shape[0]} rows but prompt_tokens + "
                             f"completion_tokens - 1 - routed_experts_start_len = {rows}")
        ids = _drop_pads(select_moe_layers(ids, moe_map, what), rec, what)
        if start == 0:
            samples.append((i, ids))
            continue
        if not samples or start > samples[-1][1].shape[0]:
            have = samples[-1][1].shape[0] if samples else 0
            raise ValueError(f"{what}: routed_experts_start_len = {start} but the sample before it has "
                             f"{have} rows; an appended chunk must follow the records of its sample")
        samples[-1] = (samples[-1][0], torch.cat([samples[-1][1][:start], ids]))
    return samples


def slime_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None) -> list[tuple[int, torch.Tensor]]:
    """Samples from slime ``Sample`` dicts (``rollout_routed_experts`` per sample)."""
    out = []
    for i, rec in enumerate(records):
        ids = _ids_of(rec, ("rollout_routed_experts", "routed_experts"), f"record {i}", moe_map,
                      flat_shape=(num_layers, top_k))
        out.append((i, _drop_pads(ids, rec, f"record {i}")))
    return out


def vllm_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None) -> list[tuple[int, torch.Tensor]]:
    """Samples from vLLM responses: one per choice (prompt rows, then its completion rows)."""
    out = []
    for i, rec in enumerate(records):
        choices = rec.get("choices", rec.get("outputs"))
        if not isinstance(choices, list) or not choices:
            raise ValueError(f"record {i} has no choices (or outputs); allowed: a vLLM completion "
                             f"or chat completion response")
        prompt = None
        if rec.get("prompt_routed_experts") is not None:
            prompt = select_moe_layers(decode_ids(rec["prompt_routed_experts"], f"record {i}.prompt_routed_experts"),
                                       moe_map, f"record {i}")
            n_prompt = len(rec["prompt_token_ids"]) if isinstance(rec.get("prompt_token_ids"), list) else None
            if n_prompt is not None and prompt.shape[0] != n_prompt:
                raise ValueError(f"record {i}: prompt_routed_experts has {prompt.shape[0]} rows but "
                                 f"prompt_token_ids has {n_prompt} tokens")
        for j, choice in enumerate(choices):
            what = f"record {i}.choices[{j}]"
            ids = _ids_of(choice, ("routed_experts",), what, moe_map)
            tokens = choice.get("token_ids")
            n_prompt = len(rec["prompt_token_ids"]) if isinstance(rec.get("prompt_token_ids"), list) else 0
            if isinstance(tokens, list):
                # the completion's rows: one per generated token but the last (never forwarded),
                # or, without prompt_routed_experts (earlier servers), the whole sequence
                allowed = {len(tokens), len(tokens) - 1}
                if prompt is None and n_prompt:
                    allowed |= {n_prompt + len(tokens) - 1}
                if ids.shape[0] not in allowed:
                    raise ValueError(f"{what}: routed_experts has {ids.shape[0]} rows for {len(tokens)} "
                                     f"generated tokens; allowed: {sorted(allowed)}")
            if prompt is not None:
                if prompt.shape[1:] != ids.shape[1:]:
                    raise ValueError(f"{what}: [layers, top_k] {list(ids.shape[1:])} differs from the "
                                     f"prompt's {list(prompt.shape[1:])}")
                ids = torch.cat([prompt, ids])
            out.append((i, _drop_pads(ids, choice, what)))
    return out


def verl_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None) -> list[tuple[int, torch.Tensor]]:
    """Samples from verl: padded batches ``[B, P, L, K]`` + mask/lengths, or one row per record."""
    out = []
    for i, rec in enumerate(records):
        what = f"record {i}"
        raw = rec.get("routed_experts")
        arr = _decode(raw, f"{what}.routed_experts", None, None) if raw is not None else None
        if arr is not None and arr.dim() == 4:
            B, P = arr.shape[:2]
            if rec.get("attention_mask") is not None:
                mask = torch.as_tensor(rec["attention_mask"])
            elif rec.get("lengths") is not None:
                mask = torch.arange(P)[None, :] < torch.as_tensor(rec["lengths"])[:, None]
            else:
                raise ValueError(f"{what}: a padded batch needs attention_mask [B, P] or lengths [B] "
                                 f"(no pad row may count as expert 0)")
            if tuple(mask.shape) != (B, P) or bool(((mask != 0) & (mask != 1)).any()):
                raise ValueError(f"{what}: attention_mask must be 0/1 of shape [{B}, {P}], got {tuple(mask.shape)}")
            for b in range(B):
                row = select_moe_layers(arr[b][mask[b].bool()].long(), moe_map, f"{what}[{b}]")
                if row.shape[0] == 0:
                    raise ValueError(f"{what}: batch row {b} has no real token")
                out.append((i, row))
        else:
            out.append((i, _drop_pads(_ids_of(rec, ("routed_experts",), what, moe_map), rec, what)))
    return out
