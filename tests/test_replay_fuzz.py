"""Fuzz the readers: random corruptions of valid routing and loads files.

Whatever the corruption (byte flips, truncation, header-length edits, JSON header edits,
metadata edits, appended bytes), ``load_routing``, ``load_loads`` and ``relibra inspect``
either succeed on a file that is still valid or raise ``ValueError``: no other exception,
no crash, no hang (every call must finish within a few seconds).

Shape legend: T tokens, L layers, K top-k, E experts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import struct
import time

import pytest
import torch
from _replay_helpers import join_file, offsets_from_lengths, random_ids_TLK, split_file
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from relibra_torch.replay import (
    LOADS_FORMAT,
    ROUTING_FORMAT,
    RoutingReplay,
    batch_samples,
    load_loads,
    load_routing,
    save_loads,
    save_routing,
    validate_loads,
    validate_routing,
)
from relibra_torch.replay import cli as replay_cli

# RELIBRA_FUZZ_EXAMPLES=5000 for a deeper run by hand; the default keeps CI fast.
FUZZ = settings(max_examples=int(os.environ.get("RELIBRA_FUZZ_EXAMPLES", "1000")), deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_SECONDS = 5.0  # one small file; anything slower than this is a hang

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=8,
)
metadata_keys = st.sampled_from(["format", "num_experts", "top_k", "num_layers", "model", "extra"]) | st.text(max_size=8)
metadata_values = st.sampled_from(
    [ROUTING_FORMAT, LOADS_FORMAT, "0", "1", "2", "3", "8", "-1", "08", "1e3", "99999999999999999999", "", "x\ny"]
) | st.text(max_size=12)


@pytest.fixture(scope="module")
def valid_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fuzz")
    T, L, K, E = 24, 2, 2, 6
    lengths = [4, 9, 11]
    routing = folder / "routing.safetensors"
    save_routing(routing, random_ids_TLK(T, L, K, E, seed=0), offsets_from_lengths(lengths), E,
                 model="toy", sample_step=[0, 0, 1], sample_task=[1, 0, 1])
    replay = RoutingReplay(random_ids_TLK(T, L, K, E, seed=1), offsets_from_lengths(lengths), E)
    loads = folder / "loads.safetensors"
    save_loads(loads, replay.counts(batch_samples(replay.sample_lengths, 2, num_micro_batches=2))[None], K)
    return {"routing": routing.read_bytes(), "loads": loads.read_bytes(), "folder": folder}


def _mutate(data: st.DataObject, raw: bytes) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "header_len", "header_json", "metadata", "append", "header_text"]))
    header_len = struct.unpack("<Q", raw[:8])[0]
    if kind == "flip":
        out = bytearray(raw)
        # Half of the flips land in the header, where the structure lives.
        for _ in range(data.draw(st.integers(1, 6))):
            hi = 8 + header_len - 1 if data.draw(st.booleans()) else len(raw) - 1
            pos = data.draw(st.integers(0, hi))
            out[pos] ^= data.draw(st.integers(1, 255))
        return bytes(out)
    if kind == "truncate":
        return raw[: data.draw(st.integers(0, len(raw) - 1))]
    if kind == "header_len":
        value = data.draw(st.integers(0, 2**64 - 1) | st.integers(max(0, header_len - 16), header_len + 16))
        return struct.pack("<Q", value) + raw[8:]
    if kind == "append":
        return raw + data.draw(st.binary(min_size=1, max_size=16))
    if kind == "header_text":
        text = bytearray(raw[8 : 8 + header_len])
        pos = data.draw(st.integers(0, len(text) - 1))
        text[pos] = ord(data.draw(st.sampled_from(list('{}[]":,0123456789-abcXYZ '))))
        return raw[:8] + bytes(text) + raw[8 + header_len :]
    header, body = split_file(raw)
    if kind == "metadata":
        meta = header.setdefault("__metadata__", {})
        for _ in range(data.draw(st.integers(1, 3))):
            key = data.draw(metadata_keys)
            if data.draw(st.booleans()) and meta:
                meta.pop(data.draw(st.sampled_from(sorted(meta))))
            else:
                meta[key] = data.draw(metadata_values)
        return join_file(header, body)
    # header_json: edit one entry of one tensor (or the metadata) to an arbitrary JSON value
    name = data.draw(st.sampled_from(sorted(header)))
    entry = header[name]
    op = data.draw(st.sampled_from(["replace_entry", "field", "nudge", "drop_field", "add_tensor"]))
    if op == "replace_entry":
        header[name] = data.draw(json_values)
    elif op == "add_tensor":
        header[data.draw(st.text(max_size=8))] = data.draw(json_values)
    elif isinstance(entry, dict) and entry:
        field = data.draw(st.sampled_from(sorted(entry)))
        if op == "field":
            entry[field] = data.draw(json_values)
        elif op == "drop_field":
            del entry[field]
        elif isinstance(entry[field], list) and entry[field] and all(isinstance(v, int) for v in entry[field]):
            i = data.draw(st.integers(0, len(entry[field]) - 1))
            entry[field][i] += data.draw(st.integers(-3, 3))
    return join_file(header, body)


def _check(path, reader, validate) -> str:
    start = time.monotonic()
    try:
        result = reader(path)
        outcome = "ok"
    except ValueError as exc:
        assert str(exc), "empty error message"
        outcome = "error"
    else:
        validate(result)  # whatever loads must still be valid
    assert time.monotonic() - start < MAX_SECONDS
    event(f"{reader.__name__}: {outcome}")  # shown by --hypothesis-show-statistics
    return outcome


def _inspect(path) -> None:
    start = time.monotonic()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            assert replay_cli.run(argparse.Namespace(file=str(path))) == 0
        except ValueError as exc:
            # cli.main prints this message as the single error line.
            assert "\n" not in str(exc)
    assert time.monotonic() - start < MAX_SECONDS


def _validate_replay(replay):
    validate_routing(replay.routed_experts_TLK, replay.sample_offsets, replay.num_experts,
                     sample_step=replay.sample_step, sample_task=replay.sample_task)


def _validate_loads(loads):
    validate_loads(loads.loads_XMLSE, loads.top_k)


@FUZZ
@given(data=st.data())
def test_fuzz_routing_reader(valid_files, data):
    path = valid_files["folder"] / "mutated_routing.safetensors"
    path.write_bytes(_mutate(data, valid_files["routing"]))
    _check(path, load_routing, _validate_replay)
    _check(path, load_loads, _validate_loads)  # the other reader must refuse it cleanly too
    _inspect(path)


@FUZZ
@given(data=st.data())
def test_fuzz_loads_reader(valid_files, data):
    path = valid_files["folder"] / "mutated_loads.safetensors"
    path.write_bytes(_mutate(data, valid_files["loads"]))
    _check(path, load_loads, _validate_loads)
    _check(path, load_routing, _validate_replay)
    _inspect(path)


def test_fuzz_inputs_are_valid(valid_files, tmp_path):
    # The unmutated files load: the fuzz tests start from valid files, so rejections are
    # caused by the corruptions.
    (tmp_path / "r.safetensors").write_bytes(valid_files["routing"])
    (tmp_path / "l.safetensors").write_bytes(valid_files["loads"])
    assert load_routing(tmp_path / "r.safetensors").num_tokens == 24
    assert load_loads(tmp_path / "l.safetensors").top_k == 2
    header, _ = split_file(valid_files["routing"])
    assert json.loads(json.dumps(header)) == header  # split/join round-trips
    assert join_file(*split_file(valid_files["loads"])) != b""
    assert torch.equal(
        load_loads(tmp_path / "l.safetensors").loads_XMLSE.sum(dim=-1)[:, :, 0],
        load_loads(tmp_path / "l.safetensors").loads_XMLSE.sum(dim=-1)[:, :, 1],
    )
