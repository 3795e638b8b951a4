"""Routing and loads files: round trips and every validation rule, on files and in memory.

Shape legend: T tokens, L layers, K top-k, E experts, N samples, X steps, M micro-batches,
S source ranks.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from _replay_helpers import join_file, offsets_from_lengths, random_ids_TLK, split_file, write_raw

from relibra_torch.replay import (
    LOADS_FORMAT,
    ROUTING_FORMAT,
    LoadsFile,
    RoutingReplay,
    load_loads,
    load_routing,
    save_loads,
    save_routing,
    validate_expert_ids,
    validate_loads,
    validate_routing,
)

T, L, K, E = 30, 3, 2, 8
LENGTHS = [5, 10, 15]


def good_tensors():
    return {
        "routed_experts": random_ids_TLK(T, L, K, E, seed=1).to(torch.int16),
        "sample_offsets": offsets_from_lengths(LENGTHS),
        "sample_step": torch.tensor([0, 0, 1]),
        "sample_task": torch.tensor([2, 0, 1]),
    }


def good_meta():
    return {"format": ROUTING_FORMAT, "num_experts": str(E), "top_k": str(K), "num_layers": str(L), "model": "toy-moe"}


# ---------------------------------------------------------------- round trips


def test_routing_round_trip(tmp_path):
    t = good_tensors()
    path = tmp_path / "r.safetensors"
    save_routing(path, t["routed_experts"].long(), t["sample_offsets"], E, model="toy-moe",
                 sample_step=t["sample_step"], sample_task=t["sample_task"].int())
    replay = load_routing(path)
    assert replay.routed_experts_TLK.dtype == torch.int16  # E <= 32768 is stored as int16
    assert torch.equal(replay.routed_experts_TLK.long(), t["routed_experts"].long())
    assert torch.equal(replay.sample_offsets, t["sample_offsets"])
    assert torch.equal(replay.sample_step, t["sample_step"])
    assert torch.equal(replay.sample_task, t["sample_task"])
    assert (replay.num_samples, replay.num_tokens, replay.num_layers, replay.top_k, replay.num_experts) == (3, T, L, K, E)
    assert replay.model == "toy-moe"
    assert torch.equal(replay.sample_lengths, torch.tensor(LENGTHS))
    assert torch.equal(replay.sample(1), t["routed_experts"][5:15])
    assert torch.equal(replay[-1], t["routed_experts"][15:30])
    with pytest.raises(ValueError, match=r"sample index = 3; allowed: an int in \[-3, 2\]"):
        replay.sample(3)


def test_routing_round_trip_int32_for_many_experts(tmp_path):
    ids = torch.tensor([[[40000, 1]], [[2, 39999]]])
    path = tmp_path / "big.safetensors"
    save_routing(path, ids, torch.tensor([0, 2]), 40001)
    replay = load_routing(path)
    assert replay.routed_experts_TLK.dtype == torch.int32
    assert torch.equal(replay.routed_experts_TLK.long(), ids)
    assert replay.model is None and replay.sample_step is None and replay.sample_task is None


def test_replay_save_method_and_select(tmp_path):
    t = good_tensors()
    replay = RoutingReplay(t["routed_experts"], t["sample_offsets"], E, sample_step=t["sample_step"])
    sub = replay.select([2, 0])
    assert torch.equal(sub.routed_experts_TLK, torch.cat([t["routed_experts"][15:30], t["routed_experts"][0:5]]))
    assert sub.sample_offsets.tolist() == [0, 15, 20]
    assert sub.sample_step.tolist() == [1, 0]
    sub.save(tmp_path / "sub.safetensors")
    again = load_routing(tmp_path / "sub.safetensors")
    assert torch.equal(again.routed_experts_TLK, sub.routed_experts_TLK)
    with pytest.raises(ValueError, match=r"sample_ids contains 3; allowed: \[0, 3\)"):
        replay.select([3])
    steps = replay.split_by_step()
    assert list(steps) == [0, 1]
    assert torch.equal(steps[0].routed_experts_TLK, t["routed_experts"][:15])
    assert torch.equal(steps[1].routed_experts_TLK, t["routed_experts"][15:])
    assert steps[0].sample_offsets.tolist() == [0, 5, 15]
    with pytest.raises(ValueError, match="sample_step is absent"):
        RoutingReplay(t["routed_experts"], t["sample_offsets"], E).split_by_step()


def test_loads_round_trip(tmp_path):
    loads = torch.zeros(2, 1, 2, 2, 4, dtype=torch.int32)
    loads[0, 0, :, 0] = torch.tensor([1, 1, 1, 1])  # 2 tokens with top-2
    loads[1, 0, :, 1] = torch.tensor([3, 0, 2, 1])  # 3 tokens
    save_loads(tmp_path / "l.safetensors", loads, 2, model="m")
    got = load_loads(tmp_path / "l.safetensors")
    assert isinstance(got, LoadsFile)
    assert torch.equal(got.loads_XMLSE, loads) and got.top_k == 2 and got.model == "m"
    arr, top_k = got  # unpacks as (loads, top_k)
    assert arr is got.loads_XMLSE and top_k == 2
    assert got.tokens().tolist() == [[[2, 0]], [[0, 3]]]


# ---------------------------------------------------------------- bad routing files


def _bad_routing_cases():
    """(name, tensors edit, metadata edit, regex the message must match)."""
    cases = []

    def add(name, tensors=None, meta=None, match=""):
        cases.append(pytest.param(tensors, meta, match, id=name))

    add("float ids", {"routed_experts": lambda t: t.float()}, None, r"routed_experts has dtype float32; allowed: int16 or int32")
    add("int64 ids", {"routed_experts": lambda t: t.long()}, None, r"routed_experts has dtype int64; allowed: int16 or int32")
    add("int32 offsets", {"sample_offsets": lambda t: t.int()}, None, r"sample_offsets has dtype int32; allowed: int64")
    add("2-d ids", {"routed_experts": lambda t: t[:, 0]}, None, r"routed_experts has shape \[30, 2\]; allowed: \[total_tokens, num_layers=3, top_k=2\]")
    add("layers mismatch", None, {"num_layers": "4"}, r"routed_experts has shape \[30, 3, 2\]; allowed: \[total_tokens, num_layers=4, top_k=2\]")
    add("top_k mismatch", None, {"top_k": "3"}, r"routed_experts has shape \[30, 3, 2\]; allowed: \[total_tokens, num_layers=3, top_k=3\]")
    add("negative id", {"routed_experts": lambda t: _set(t, (4, 1, 0), -1)}, None, r"routed_experts\[4, 1, 0\] = -1 is out of range; allowed: expert ids in \[0, 8\)")
    add("id == E", {"routed_experts": lambda t: _set(t, (7, 2, 1), 8)}, None, r"routed_experts\[7, 2, 1\] = 8 is out of range; allowed: expert ids in \[0, 8\)")
    add("duplicate in top-k", {"routed_experts": lambda t: _dup(t, 9, 1)}, None, r"routed_experts\[9, 1\] = \[(\d), \1\] repeats an expert; allowed: distinct")
    add("offsets start", {"sample_offsets": lambda t: torch.tensor([1, 10, 15, 30])}, None, r"sample_offsets\[0\] = 1; allowed: 0")
    add("offsets equal", {"sample_offsets": lambda t: torch.tensor([0, 10, 10, 30])}, None, r"sample_offsets\[1:3\] = \[10, 10\] is not increasing")
    add("offsets decrease", {"sample_offsets": lambda t: torch.tensor([0, 20, 10, 30])}, None, r"sample_offsets\[1:3\] = \[20, 10\] is not increasing")
    add("offsets last", {"sample_offsets": lambda t: torch.tensor([0, 5, 15, 29])}, None, r"sample_offsets\[-1\] = 29 but routed_experts has 30 tokens")
    add("offsets too short", {"sample_offsets": lambda t: torch.tensor([0])}, None, r"sample_offsets has shape \(1,\); allowed: \[num_samples \+ 1\]")
    add("step length", {"sample_step": lambda t: t[:2]}, None, r"sample_step has shape \(2,\); allowed: \[num_samples\] = \[3\]")
    add("step negative", {"sample_step": lambda t: torch.tensor([0, -2, 1])}, None, r"sample_step\[1\] = -2; allowed: integers >= 0")
    add("task dtype", {"sample_task": lambda t: t.int()}, None, r"sample_task has dtype int32; allowed: int64")
    add("unknown tensor", {"extra": lambda t: torch.zeros(1)}, None, r"unknown tensor 'extra'; allowed: \['routed_experts', 'sample_offsets', 'sample_step', 'sample_task'\]")
    add("missing offsets", {"sample_offsets": None}, None, r"tensor 'sample_offsets' is missing")
    add("missing format", None, {"format": None}, r"metadata 'format' is missing; allowed: 'relibra.routing/1'")
    add("unknown format", None, {"format": "relibra.routing/2"}, r"metadata format = 'relibra.routing/2'; allowed: 'relibra.routing/1'")
    add("loads format", None, {"format": LOADS_FORMAT}, r"metadata format = 'relibra.loads/1'; allowed: 'relibra.routing/1'")
    add("missing num_experts", None, {"num_experts": None}, r"metadata 'num_experts' is missing")
    add("unknown metadata", None, {"color": "red"}, r"unknown metadata 'color'; allowed: \['format', 'num_experts', 'top_k', 'num_layers', 'model', 'coverage'\]")
    add("bad coverage", None, {"coverage": "half"}, r"metadata coverage = 'half'; allowed: completion-only")
    add("non-integer", None, {"num_experts": "8.0"}, r"metadata num_experts = '8.0' is not a decimal integer")
    add("spaces", None, {"top_k": " 2"}, r"metadata top_k = ' 2' is not a decimal integer")
    add("zero experts", None, {"num_experts": "0"}, r"metadata num_experts = 0; allowed: an integer in \[1, ")
    add("top_k > E", None, {"num_experts": "1"}, r"top_k = 2 exceeds num_experts = 1")
    add("fewer experts than ids", None, {"num_experts": "4"}, r"is out of range; allowed: expert ids in \[0, 4\)")
    add("model newline", None, {"model": "a\nb"}, r"metadata model = 'a\\nb'; allowed: printable one-line text")
    return cases


def _set(t, pos, value):
    t = t.clone()
    t[pos] = value
    return t


def _dup(t, token, layer):
    t = t.clone()
    t[token, layer, 1] = t[token, layer, 0]
    return t


@pytest.mark.parametrize("tensor_edit, meta_edit, match", _bad_routing_cases())
def test_bad_routing_file(tmp_path, tensor_edit, meta_edit, match):
    tensors, meta = good_tensors(), good_meta()
    for name, fn in (tensor_edit or {}).items():
        if fn is None:
            del tensors[name]
        else:
            tensors[name] = fn(tensors.get(name))
    for key, value in (meta_edit or {}).items():
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    path = tmp_path / "bad.safetensors"
    write_raw(path, tensors, meta)
    with pytest.raises(ValueError, match=match) as info:
        load_routing(path)
    assert str(path) in str(info.value)  # the message says which file


def test_good_raw_file_loads(tmp_path):
    # The bad-file cases above are edits of this file: it must load, or they prove nothing.
    write_raw(tmp_path / "good.safetensors", good_tensors(), good_meta())
    replay = load_routing(tmp_path / "good.safetensors")
    assert replay.num_tokens == T and replay.model == "toy-moe"


def _good_bytes(tmp_path) -> bytes:
    write_raw(tmp_path / "good.safetensors", good_tensors(), good_meta())
    return (tmp_path / "good.safetensors").read_bytes()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda b: b[:5], r"5 bytes is too short for a safetensors file"),
        (lambda b: b"", r"0 bytes is too short"),
        (lambda b: b'{"a": 1}', r"8 bytes is too short for a safetensors file; allowed: at least 10 bytes"),
        (lambda b: b[:9], r"9 bytes is too short for a safetensors file"),
        (lambda b: b[:-1], r"tensors cover \d+ data bytes but the file has \d+; truncated or extended file"),
        (lambda b: b + b"\0" * 8, r"tensors cover \d+ data bytes but the file has \d+"),
        (lambda b: b[: len(b) // 2], r"header length \d+ is impossible|truncated"),
        (lambda b: b"hello world, not safetensors at all", r"header length \d+ is impossible for a 35-byte file"),
        (lambda b: (2**63).to_bytes(8, "little") + b[8:], r"header length 9223372036854775808 is impossible"),
        (lambda b: b[:8] + b"[" + b[9:], r"header starts with b'\['; allowed: '\{'"),
        (lambda b: b[:8] + b"{\xff" + b[10:], r"header is not UTF-8"),
        (lambda b: b[:8] + b"{{" + b[10:], r"header is not valid JSON"),
    ],
    ids=["5 bytes", "empty", "8-byte json", "9 bytes", "cut 1 byte", "8 extra bytes", "half", "text", "huge header length", "json array", "not utf8", "bad json"],
)
def test_truncated_or_not_safetensors(tmp_path, edit, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(edit(_good_bytes(tmp_path)))
    with pytest.raises(ValueError, match=match):
        load_routing(path)
    with pytest.raises(ValueError):
        load_loads(path)


def _header_edit(fn):
    def edit(data):
        header, body = split_file(data)
        fn(header)
        return join_file(header, body)

    return edit


@pytest.mark.parametrize(
    "edit, match",
    [
        (_header_edit(lambda h: h["routed_experts"].update(dtype="F99")), r"tensor 'routed_experts': dtype \"F99\"; allowed: one of"),
        (_header_edit(lambda h: h["routed_experts"].update(shape=[30, 3, 3])), r"shape \[30, 3, 3\] of I16 needs 540 bytes but data_offsets \[\d+, \d+\] span 360"),
        (_header_edit(lambda h: h["routed_experts"].update(shape=[30, -3, 2])), r"shape \[30, -3, 2\]; allowed: a list of integers"),
        (_header_edit(lambda h: h["routed_experts"].update(shape=[30, 3.0, 2])), r"shape \[30, 3.0, 2\]; allowed: a list of integers"),
        (_header_edit(lambda h: h["sample_task"].update(data_offsets=h["sample_step"]["data_offsets"])), r"starts at data byte \d+; allowed: \d+ \(tensors must be contiguous\)"),
        (_header_edit(lambda h: h["routed_experts"].pop("dtype")), r"allowed: an object with exactly 'dtype', 'shape' and 'data_offsets'"),
        (_header_edit(lambda h: h.update(__metadata__={"format": 1})), r"__metadata__ is .*; allowed: an object of string keys and string values"),
        (_header_edit(lambda h: h.update(__metadata__=["x"])), r"__metadata__ is .*; allowed: an object"),
        (_header_edit(lambda h: h.pop("__metadata__")), r"metadata 'format' is missing"),
    ],
    ids=["dtype", "shape vs bytes", "negative dim", "float dim", "overlap", "missing dtype", "metadata int", "metadata list", "no metadata"],
)
def test_bad_headers(tmp_path, edit, match):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(edit(_good_bytes(tmp_path)))
    with pytest.raises(ValueError, match=match):
        load_routing(path)


def test_duplicate_json_key_and_nan(tmp_path):
    data = _good_bytes(tmp_path)
    header, body = split_file(data)
    raw = json.dumps(header)
    dup = raw[:-1] + ', "__metadata__": {"format": "x"}}'
    path = tmp_path / "dup.safetensors"
    path.write_bytes(len(dup).to_bytes(8, "little") + dup.encode() + body)
    with pytest.raises(ValueError, match=r"duplicate key '__metadata__'"):
        load_routing(path)
    nan = raw[:-1] + ', "x": NaN}'
    path.write_bytes(len(nan).to_bytes(8, "little") + nan.encode() + body)
    with pytest.raises(ValueError, match=r"JSON constant NaN"):
        load_routing(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_routing(tmp_path / "nope.safetensors")
    with pytest.raises(ValueError, match="is not a regular file"):
        load_loads(tmp_path)


# ---------------------------------------------------------------- in-memory validation


def test_validate_routing_in_memory():
    t = good_tensors()
    validate_routing(t["routed_experts"].long(), t["sample_offsets"], E, top_k=K, num_layers=L)
    with pytest.raises(TypeError, match="routed_experts is list; allowed: a torch.Tensor"):
        validate_routing([[1]], t["sample_offsets"], E)
    with pytest.raises(TypeError, match="num_experts is bool"):
        validate_routing(t["routed_experts"], t["sample_offsets"], True)
    with pytest.raises(ValueError, match=r"routed_experts has dtype float64; allowed: int16, int32 or int64"):
        validate_routing(t["routed_experts"].double(), t["sample_offsets"], E)
    with pytest.raises(ValueError, match=r"routed_experts has 3 layers .* but num_layers = 2"):
        validate_routing(t["routed_experts"], t["sample_offsets"], E, num_layers=2)
    with pytest.raises(ValueError, match=r"routed_experts has top-k 2 .* but top_k = 1"):
        validate_routing(t["routed_experts"], t["sample_offsets"], E, top_k=1)
    with pytest.raises(ValueError, match=r"model = 'x\\ty'"):
        RoutingReplay(t["routed_experts"], t["sample_offsets"], E, model="x\ty")


def test_validate_expert_ids_router_shape():
    validate_expert_ids(torch.tensor([[0, 3], [2, 1]]), 4)
    with pytest.raises(ValueError, match=r"ids\[1\] = \[2, 2\] repeats an expert"):
        validate_expert_ids(torch.tensor([[0, 3], [2, 2]]), 4, name="ids")
    with pytest.raises(ValueError, match=r"ids\[0, 1\] = 4 is out of range"):
        validate_expert_ids(torch.tensor([[0, 4], [2, 1]]), 4, name="ids")
    with pytest.raises(ValueError, match=r"top_k = 3 exceeds num_experts = 2"):
        validate_expert_ids(torch.tensor([[0, 1, 1]]), 2)
    # Duplicates are allowed when the caller asks only for range checks.
    validate_expert_ids(torch.tensor([[1, 1]]), 2, check_duplicates=False)


# ---------------------------------------------------------------- bad loads


def _loads_ok():
    loads = torch.zeros(1, 2, 2, 1, 4, dtype=torch.int64)
    loads[0, 0, :, 0] = torch.tensor([2, 1, 1, 0])  # 2 tokens, top-2
    loads[0, 1, 0, 0] = torch.tensor([1, 1, 0, 0])  # 1 token
    loads[0, 1, 1, 0] = torch.tensor([0, 0, 1, 1])
    return loads


@pytest.mark.parametrize(
    "make, top_k, match",
    [
        (lambda: _loads_ok().float(), 2, r"loads has dtype float32; allowed: int32 or int64"),
        (lambda: _loads_ok().short(), 2, r"loads has dtype int16; allowed: int32 or int64"),
        (lambda: _loads_ok()[0], 2, r"loads has shape \(2, 2, 1, 4\); allowed: \[steps, micro_batches, num_layers, source_ranks, num_experts\]"),
        (lambda: _loads_ok()[:, :0], 2, r"every dim >= 1"),
        (lambda: _set(_loads_ok(), (0, 1, 1, 0, 3), -1), 2, r"loads\[0, 1, 1, 0, 3\] = -1; allowed: counts in \[0, 2\*\*40\]"),
        (lambda: _set(_loads_ok(), (0, 1, 1, 0, 3), 2), 2, r"loads\[0, 1, 1, 0, :\] sums to 3, not a multiple of top_k = 2"),
        (lambda: _set(_set(_loads_ok(), (0, 1, 1, 0, 2), 2), (0, 1, 1, 0, 3), 2), 2, r"loads\[0, 1, 1, 0, :\] holds 2 tokens but layer 0 of the same \(step, micro-batch, source\) holds 1"),
        (lambda: _set(_set(_loads_ok(), (0, 0, 0, 0, 0), 3), (0, 0, 0, 0, 1), 0), 2, r"loads\[0, 0, 0, 0, 0\] = 3 exceeds the 2 tokens"),
        (lambda: _loads_ok(), 5, r"top_k = 5 exceeds num_experts = 4"),
    ],
    ids=["float", "int16", "4-d", "zero dim", "negative", "not divisible", "layers differ", "expert above tokens", "top_k > E"],
)
def test_bad_loads(tmp_path, make, top_k, match):
    loads = make()
    with pytest.raises(ValueError, match=match):
        validate_loads(loads, top_k)
    # The same problem in a file is reported with the file name.
    path = tmp_path / "bad.safetensors"
    write_raw(path, {"loads": loads}, {"format": LOADS_FORMAT, "top_k": str(top_k)})
    with pytest.raises(ValueError, match=re.escape(str(path))):
        load_loads(path)
    with pytest.raises(ValueError):
        save_loads(tmp_path / "never.safetensors", loads, top_k)
    assert not (tmp_path / "never.safetensors").exists()


def test_good_loads_and_bad_loads_metadata(tmp_path):
    validate_loads(_loads_ok(), 2)
    path = tmp_path / "l.safetensors"
    for meta, match in [
        ({"format": LOADS_FORMAT}, r"metadata 'top_k' is missing"),
        ({"format": ROUTING_FORMAT, "top_k": "2"}, r"metadata format = 'relibra.routing/1'; allowed: 'relibra.loads/1'"),
        ({"format": LOADS_FORMAT, "top_k": "2", "num_experts": "4"}, r"unknown metadata 'num_experts'; allowed: \['format', 'top_k', 'model'\]"),
        ({"format": LOADS_FORMAT, "top_k": "two"}, r"metadata top_k = 'two' is not a decimal integer"),
        (None, r"metadata 'format' is missing"),
    ]:
        write_raw(path, {"loads": _loads_ok()}, meta)
        with pytest.raises(ValueError, match=match):
            load_loads(path)
    write_raw(path, {"loads": _loads_ok(), "more": torch.zeros(1)}, {"format": LOADS_FORMAT, "top_k": "2"})
    with pytest.raises(ValueError, match=r"unknown tensor 'more'; allowed: \['loads'\]"):
        load_loads(path)
    write_raw(path, {"loads": _loads_ok()}, {"format": LOADS_FORMAT, "top_k": "2"})
    assert torch.equal(load_loads(path).loads_XMLSE, _loads_ok())


def test_failed_save_leaves_no_file(tmp_path):
    t = good_tensors()
    bad = t["routed_experts"].clone()
    bad[0, 0, 0] = 99
    with pytest.raises(ValueError, match="out of range"):
        save_routing(tmp_path / "r.safetensors", bad, t["sample_offsets"], E)
    assert list(tmp_path.iterdir()) == []



