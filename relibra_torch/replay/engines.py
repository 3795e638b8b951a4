"""Routing replay from serving-engine and RL-framework responses (``relibra convert``).

Each converter takes the decoded JSON records (one response, or one sample, each) and
returns one :class:`EngineSample` per sample: the index of the record it starts in and its
:class:`~relibra_torch.replay.engine_ids.Piece` s, the ``[T, L, K]`` ids of the **MoE
layers only, real tokens only**, each with the field, rows and engine layers it came from
(so errors name the user's data). ``EngineSample.ids`` is ready for
:func:`relibra_torch.replay.from_per_sample`.

Layouts followed (checked against the engines' sources and docs, see docs/replay.md):

* **SGLang** ``/generate`` with ``return_routed_experts``: ``meta_info["routed_experts"]``
  is base64 of a flat int32 buffer, reshaped ``[tokens, num_hidden_layers, top_k]``. The
  layer dim counts every transformer layer (dense layers hold placeholder zeros), and the
  rows cover positions ``[routed_experts_start_len, prompt_tokens + completion_tokens - 1)``
  (the last generated token is never forwarded). A response with ``routed_experts_start_len
  > 0`` continues the sample of the records before it (multi-turn appended chunks).
  SGLang's OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` carry the same
  payload as the response-level ``sglext["routed_experts"]`` (of the first choice), with
  the counts in ``usage`` (or the choice's ``prompt_token_ids`` / ``token_ids``).
* **slime**: a sample's ``rollout_routed_experts`` (or ``routed_experts``) ``[len(tokens) -
  1, layers, top_k]``, as nested lists or as SGLang's base64 string (its rows follow from
  ``tokens``); the layer dim counts dense layers. Another row count is refused unless an
  ``attention_mask`` or ``length`` marks pad rows.
* **vLLM** (``--enable-return-routed-experts``), MoE layers only, int16 ids as nested
  lists, a base64 ``.npy`` buffer, or ``{"encoding": "base64", "dtype", "shape", "data"}``.
  A choice's ``routed_experts`` covers the whole sequence (``prompt + generated - 1`` rows,
  the prompt's first) or, with a response-level ``prompt_routed_experts`` ``[prompt_tokens,
  L, K]``, the generated tokens only (``generated`` or ``generated - 1`` rows). Without
  ``prompt_routed_experts``, generated-only rows lack the prompt's: refused unless
  ``completion_only`` is allowed (the sample is then marked). ``outputs`` (offline
  ``RequestOutput``) is read like ``choices``. One sample per choice.
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

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .engine_ids import (LIST_IDS_ALLOWED, LayerIndices, Piece, check_pieces, decode_ids, from_per_layer,
                         json_ints, parse_layer_spec, select_layers, select_moe_layers)

__all__ = ["ENGINES", "EngineSample", "LayerIndices", "Piece", "check_pieces", "decode_ids", "from_per_layer",
           "parse_layer_spec", "select_moe_layers", "sglang_samples", "slime_samples", "vllm_samples",
           "verl_samples"]

ENGINES = ("verl", "slime", "sglang", "vllm")


@dataclass
class EngineSample:
    """One sample: the record it starts in and its pieces, in token order.

    ``missing_prompt`` is the number of prompt tokens whose rows the engine did not send
    (vLLM generated-only rows accepted with ``completion_only``; -1 when unknown).
    """

    record: int
    pieces: list[Piece]
    completion_only: bool = False
    missing_prompt: int = 0
    _ids: torch.Tensor | None = field(default=None, repr=False)

    @property
    def ids(self) -> torch.Tensor:
        """int64 ``[T, L, K]``: the pieces joined."""
        if self._ids is None:
            self._ids = torch.cat([p.ids_TLK for p in self.pieces])
        return self._ids

    @property
    def num_rows(self) -> int:
        return sum(p.ids_TLK.shape[0] for p in self.pieces)

    def __iter__(self):  # (record, ids), as the converters returned before pieces existed
        return iter((self.record, self.ids))


def _int(d, key: str) -> int | None:
    v = d.get(key) if isinstance(d, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _mask(value, what: str, shape: tuple[int, ...], allowed: str) -> torch.Tensor:
    """A 0/1 ``attention_mask`` of ``shape`` from JSON; the error names the bad entry or the shape."""
    mask = json_ints(value, f"{what}: attention_mask", f"0 or 1 in {allowed}")
    if tuple(mask.shape) != shape:
        raise ValueError(f"{what}: attention_mask has shape {list(mask.shape)}; allowed: {allowed} of 0 or 1")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        idx = ", ".join(str(int(i)) for i in bad.nonzero()[0])
        raise ValueError(f"{what}: attention_mask[{idx}] = {int(mask[tuple(bad.nonzero()[0])])}; allowed: 0 or 1 "
                         f"(1 = real token, 0 = pad)")
    return mask.bool()


def _kept_rows(n: int, record: dict, what: str) -> torch.Tensor:
    """The rows of ``n`` that are real tokens (``attention_mask`` 1, or before ``length``)."""
    keep = torch.arange(n)
    if record.get("attention_mask") is not None:
        keep = keep[_mask(record["attention_mask"], what, (n,), f"[{n}] (one per row)")]
    if record.get("length") is not None:
        m = record["length"]
        if isinstance(m, bool) or not isinstance(m, int) or not 0 < m <= keep.numel():
            raise ValueError(f"{what}: length = {m!r}; allowed: an int in [1, {keep.numel()}] (the real rows)")
        keep = keep[:m]
    return keep


def _piece(ids_THK, record: dict, i: int, fld: str, moe_map, row_name: str, base: int = 0,
           layers: tuple[int, ...] | None = None) -> Piece:
    if layers is None:
        ids_THK, layers = select_layers(ids_THK, moe_map, f"record {i}: {fld}")
    keep = _kept_rows(ids_THK.shape[0], record, f"record {i}")
    return Piece(ids_THK[keep], i, fld, keep, layers, row_name, base)


def _sglang_payload(rec: dict, i: int):
    """``(field, value, start, prompt tokens, generated tokens)`` of a /generate or OpenAI response."""
    meta, ext = rec.get("meta_info"), rec.get("sglext")
    if isinstance(meta, dict) and meta.get("routed_experts") is not None:
        return ("meta_info.routed_experts", meta["routed_experts"], _int(meta, "routed_experts_start_len") or 0,
                _int(meta, "prompt_tokens"), _int(meta, "completion_tokens"))
    choices = rec.get("choices")
    if isinstance(ext, dict) and ext.get("routed_experts") is not None:
        if isinstance(choices, list) and len(choices) > 1:
            raise ValueError(f"record {i}: sglext.routed_experts holds the routing of choice 0 only (SGLang sends "
                             f"the first of the {len(choices)} choices); send one request per sample (n = 1), "
                             f"or use /generate")
        c0 = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
        P = len(c0["prompt_token_ids"]) if isinstance(c0.get("prompt_token_ids"), list) else _int(usage, "prompt_tokens")
        C = len(c0["token_ids"]) if isinstance(c0.get("token_ids"), list) else _int(usage, "completion_tokens")
        return "sglext.routed_experts", ext["routed_experts"], _int(rec, "routed_experts_start_len") or 0, P, C
    if "choices" in rec or "object" in rec:
        raise ValueError(f"record {i} is an OpenAI-style response without sglext.routed_experts; send "
                         f"return_routed_experts=true in the request (server started with "
                         f"--enable-return-routed-experts)")
    raise ValueError(f"record {i} has no meta_info.routed_experts (nor sglext.routed_experts); start SGLang with "
                     f"--enable-return-routed-experts and send return_routed_experts=true")


def sglang_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None,
                   **_) -> list[EngineSample]:
    """Samples from SGLang ``/generate`` or OpenAI-compatible responses (see the module docstring)."""
    samples: list[EngineSample] = []
    for i, rec in enumerate(records):
        fld, value, start, P, C = _sglang_payload(rec, i)
        rows = P + C - 1 - start if P is not None and C is not None else None
        ids = decode_ids(value, f"record {i}: {fld}", flat_shape=(num_layers, top_k), rows=rows)
        if rows is not None and ids.shape[0] != rows:
            raise ValueError(f"record {i}: {fld} has {ids.shape[0]} rows but prompt_tokens {P} + completion_tokens "
                             f"{C} - 1 - routed_experts_start_len {start} = {rows}")
        piece = _piece(ids, rec, i, fld, moe_map, "token position", start)
        if start == 0:
            samples.append(EngineSample(i, [piece]))
            continue
        if not samples or start > samples[-1].num_rows:
            have = samples[-1].num_rows if samples else 0
            raise ValueError(f"record {i}: routed_experts_start_len = {start} but the sample before it has "
                             f"{have} rows; an appended chunk must follow the records of its sample")
        kept, left = [], start
        for p in samples[-1].pieces:  # the previous rows up to start, then this chunk
            if left > 0:
                kept.append(p.head(min(left, p.ids_TLK.shape[0])))
                left -= kept[-1].ids_TLK.shape[0]
        samples[-1] = EngineSample(samples[-1].record, kept + [piece])
    return samples


def _ids_of(rec: dict, keys: Sequence[str], what: str, moe_map, hint: str = "", **decode):
    """``(field, [T, L, K] ids, kept engine layers)`` of the first of ``keys`` a record has."""
    for key in keys:
        if rec.get(key) is not None:
            ids, layers = select_layers(decode_ids(rec[key], f"{what}: {key}", **decode), moe_map, f"{what}: {key}")
            return key, ids, layers
    if rec.get("routed_experts_by_layer") is not None:
        ids, layers = from_per_layer(rec["routed_experts_by_layer"], moe_map, f"{what}: routed_experts_by_layer")
        return "routed_experts_by_layer", ids, layers
    raise ValueError(f"{what} has none of the fields {list(keys) + ['routed_experts_by_layer']}{hint}")


def slime_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None,
                  **_) -> list[EngineSample]:
    """Samples from slime ``Sample`` dicts (``rollout_routed_experts`` per sample)."""
    out = []
    for i, rec in enumerate(records):
        tokens = rec.get("tokens")
        rows = len(tokens) - 1 if isinstance(tokens, list) and tokens else None  # slime: tokens - 1
        fld, ids, layers = _ids_of(rec, ("rollout_routed_experts", "routed_experts"), f"record {i}", moe_map,
                                   flat_shape=(num_layers, top_k), rows=rows or None)
        padded = rec.get("attention_mask") is not None or rec.get("length") is not None
        if rows is not None and ids.shape[0] != rows and not padded:  # as SGLang's prompt + completion - 1
            raise ValueError(f"record {i}: {fld} has {ids.shape[0]} rows but len(tokens) {len(tokens)} - 1 = "
                             f"{rows}; allowed: {rows} rows (one per token but the last), or pad rows marked by "
                             f"attention_mask or length")
        out.append(EngineSample(i, [_piece(ids, rec, i, fld, moe_map, "token position", layers=layers)]))
    return out


def _vllm_choice(rec: dict, i: int, j: int, choice: dict, prompt: Piece | None, P: int | None,
                 n_choices: int, moe_map, completion_only: bool) -> EngineSample:
    what = f"record {i}: choices[{j}]"
    fld, ids, layers = _ids_of(choice, ("routed_experts",), what, moe_map,
                               hint="; start vLLM with --enable-return-routed-experts")
    usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
    tokens = choice.get("token_ids")
    C = len(tokens) if isinstance(tokens, list) else (_int(usage, "completion_tokens") if n_choices == 1 else None)
    R = ids.shape[0]
    gen = {C, C - 1} if C is not None else set()
    field_name = f"choices[{j}].{fld}"
    if prompt is not None:  # split layout: prompt rows at the response level
        if C is not None and R not in gen:
            raise ValueError(f"{what}: {fld} has {R} rows for {C} generated tokens; allowed: {sorted(gen)}")
        if prompt.ids_TLK.shape[1:] != ids.shape[1:]:
            raise ValueError(f"{what}: [layers, top_k] {list(ids.shape[1:])} differs from prompt_routed_experts' "
                             f"{list(prompt.ids_TLK.shape[1:])}")
        body = _piece(ids, choice, i, field_name, moe_map, "completion row", layers=layers)
        return EngineSample(i, [prompt, body])
    if P is None or C is None:
        raise ValueError(f"{what}: {fld} has {R} rows, and the response has no prompt_routed_experts and not both "
                         f"counts (prompt_token_ids or usage.prompt_tokens; token_ids, or usage.completion_tokens "
                         f"with one choice) to tell whether the rows include the prompt's; request "
                         f"return_token_ids=true")
    if R in (P + C - 1, P + C):  # whole sequence: the prompt's rows first
        return EngineSample(i, [_piece(ids, choice, i, field_name, moe_map, "token position", layers=layers)])
    if R in gen:
        if not completion_only:
            raise ValueError(f"{what}: {fld} covers the {C} generated tokens only; the {P} prompt tokens have no "
                             f"rows (no prompt_routed_experts in the response), and training replay needs them: "
                             f"have vLLM return the prompt's routing, or pass --completion-only to keep the "
                             f"generated tokens' rows (the file is then marked coverage=completion-only)")
        body = _piece(ids, choice, i, field_name, moe_map, "completion row", layers=layers)
        return EngineSample(i, [body], completion_only=True, missing_prompt=P)
    raise ValueError(f"{what}: {fld} has {R} rows; allowed: {P + C - 1} or {P + C} (prompt {P} + generated {C}, "
                     f"the whole sequence) or {C - 1} or {C} (generated only)")


def vllm_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None,
                 completion_only: bool = False, **_) -> list[EngineSample]:
    """Samples from vLLM responses: one per choice (prompt rows, then its generated tokens' rows)."""
    out = []
    for i, rec in enumerate(records):
        choices = rec.get("choices", rec.get("outputs"))
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise ValueError(f"record {i} has no choices (or outputs); allowed: a vLLM completion "
                             f"or chat completion response")
        usage = rec.get("usage") if isinstance(rec.get("usage"), dict) else {}
        P = len(rec["prompt_token_ids"]) if isinstance(rec.get("prompt_token_ids"), list) else _int(usage, "prompt_tokens")
        prompt = None
        if rec.get("prompt_routed_experts") is not None:
            ids = decode_ids(rec["prompt_routed_experts"], f"record {i}: prompt_routed_experts")
            if P is not None and ids.shape[0] != P:
                raise ValueError(f"record {i}: prompt_routed_experts has {ids.shape[0]} rows but the prompt has "
                                 f"{P} tokens (prompt_token_ids / usage.prompt_tokens)")
            prompt = _piece(ids, {}, i, "prompt_routed_experts", moe_map, "prompt row")
        for j, choice in enumerate(choices):
            c_prompt = prompt
            if choice.get("prompt_routed_experts") is not None:  # /v1/completions: per choice
                ids = decode_ids(choice["prompt_routed_experts"], f"record {i}: choices[{j}].prompt_routed_experts")
                c_prompt = _piece(ids, {}, i, f"choices[{j}].prompt_routed_experts", moe_map, "prompt row")
            c_P = len(choice["prompt_token_ids"]) if isinstance(choice.get("prompt_token_ids"), list) else P
            out.append(_vllm_choice(rec, i, j, choice, c_prompt, c_P, len(choices), moe_map, completion_only))
    return out


def verl_samples(records: Sequence[dict], moe_map, num_layers: int | None, top_k: int | None,
                 **_) -> list[EngineSample]:
    """Samples from verl: padded batches ``[B, P, L, K]`` + mask/lengths, or one row per record."""
    out = []
    for i, rec in enumerate(records):
        what = f"record {i}"
        raw = rec.get("routed_experts")
        arr = json_ints(raw, f"{what}: routed_experts", LIST_IDS_ALLOWED) if isinstance(raw, list) else None
        if arr is not None and arr.dim() == 4:
            B, P = arr.shape[:2]
            if rec.get("attention_mask") is not None:
                mask = _mask(rec["attention_mask"], what, (B, P), f"[B, P] = [{B}, {P}] (routed_experts' batch)")
            elif rec.get("lengths") is not None:
                allowed = f"{B} ints in [1, {P}] (one per batch row, routed_experts' [B, P] = [{B}, {P}])"
                lengths = json_ints(rec["lengths"], f"{what}: lengths", allowed)
                if lengths.dim() != 1 or lengths.numel() != B:
                    raise ValueError(f"{what}: lengths has shape {list(lengths.shape)}; allowed: {allowed}")
                for b, m in enumerate(lengths.tolist()):
                    if m > P:
                        raise ValueError(f"{what}: lengths[{b}] = {m} > {P} positions of its row; allowed: {allowed}")
                    if m < 1:
                        raise ValueError(f"{what}: lengths[{b}] = {m}; allowed: {allowed}")
                mask = torch.arange(P)[None, :] < lengths[:, None]
            else:
                raise ValueError(f"{what}: a padded batch needs attention_mask [B, P] or lengths [B] "
                                 f"(no pad row may count as expert 0)")
            for b in range(B):
                keep = mask[b].bool().nonzero().flatten()
                if keep.numel() == 0:
                    raise ValueError(f"{what}: batch row {b} has no real token")
                ids, layers = select_layers(arr[b][keep], moe_map, f"{what}: routed_experts[{b}]")
                out.append(EngineSample(i, [Piece(ids, i, f"routed_experts[{b}]", keep, layers, "position")]))
        else:  # one row per record [P, L, K] (arr: the list already read), or routed_experts_by_layer
            fld, ids, layers = _ids_of(rec if arr is None else {"routed_experts": arr}, ("routed_experts",), what,
                                       moe_map)
            out.append(EngineSample(i, [_piece(ids, rec, i, fld, moe_map, "position", layers=layers)]))
    return out
