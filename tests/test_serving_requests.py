"""Request traces: the readers, their one-line errors, windows, scaling and Poisson arrivals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from relibra_torch.serving.requests import (Requests, load_trace, poisson_requests, read_azure_csv,
                                            read_mooncake_jsonl)
from relibra_torch.serving.tiles import decode_sm_share
from relibra_torch.sim.data_refs import shared_data_dir

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_azure_csv_reads_times_with_seven_fractional_digits(tmp_path):
    path = _write(tmp_path, "t.csv", AZURE + "2023-11-16 18:15:46.6805900,374,44\n"
                                            "2023-11-16 18:15:50.9951690,396,109\n")
    r = read_azure_csv(path)
    assert r.arrival_N.tolist() == pytest.approx([0.0, 4.314579])
    assert r.prompt_N.tolist() == [374, 396] and r.output_N.tolist() == [44, 109]


def test_azure_2024_stamps_iso_stamps_and_the_machines_time_zone(tmp_path, monkeypatch):
    """2024's offsets, ISO ``T``/``Z`` and a stamp without a fraction read as the same UTC
    instants; a naive stamp is UTC on any machine (a DST change in New York is no gap)."""
    import time

    rows = ["2024-05-10 00:00:00.009930+00:00,5,2", "2024-05-10T00:00:01Z,5,2", "2024-05-10 02:00:01.5+02:00,5,2",
            "2024-05-09 22:00:02.0000001-02:00,5,2"]
    path = _write(tmp_path, "2024.csv", AZURE + "\n".join(rows) + "\n")
    assert read_azure_csv(path).arrival_N.tolist() == pytest.approx([0.0, 0.99007, 1.49007, 1.9900701])
    path = _write(tmp_path, "late.csv", AZURE + rows[0] + "\n2024-05-10 00:00:01+01:00,5,2\n")
    with pytest.raises(ValueError, match=r"row 3: its time is earlier"):   # 23:00:01 UTC the day before
        read_azure_csv(path)
    dst = [f"2023-03-12 0{h}:{m}0:00.0,5,2" for h in (1, 2, 3) for m in range(6)]  # spring forward in New York
    path = _write(tmp_path, "dst.csv", AZURE + "\n".join(dst) + "\n")
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    try:
        r = read_azure_csv(path)
    finally:
        monkeypatch.delenv("TZ")
        time.tzset()
    assert np.allclose(np.diff(r.arrival_N), 600.0)


@pytest.mark.parametrize("name,data,match", [
    ("gz.csv", b"\x1f\x8b\x08\x00rest", r"^gz.csv: gzip-compressed; decompress it first \(gunzip\)$"),
    ("latin.csv", AZURE.encode() + "2023-11-16 18:15:46.1,5,4 \xe9\n".encode("latin-1"),
     r"^latin.csv: not UTF-8 text; allowed: a UTF-8"),
    ("latin.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1, "x": "\xe9"}\n'.encode("latin-1"),
     r"^latin.jsonl: not UTF-8 text"),
    ("quote.csv", (AZURE + "2023-11-16 18:15:46.1,5,4\n\"2023-11-16 18:15:47.1,5,4\n"
                   + "2023-11-16 18:15:48.1,5,4\n" * 6000).encode(),
     r"^quote.csv line 3: not a well-formed CSV row \(field larger than field limit"),
    ("pretty.json", json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}, indent=2).encode(),
     r"^pretty.json line 1: a JSON document over several lines, not one object per line"),
])
def test_files_that_are_not_well_formed_text_name_the_file(tmp_path, name, data, match):
    p = tmp_path / name
    p.write_bytes(data)
    with pytest.raises(ValueError, match=match):
        load_trace(str(p))


def test_mooncake_jsonl_uses_milliseconds(tmp_path):
    rows = [{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]},
            {"timestamp": 1500, "input_length": 7, "output_length": 1}]
    path = _write(tmp_path, "t.jsonl", "\n".join(json.dumps(x) for x in rows) + "\n")
    r = load_trace(path)
    assert r.arrival_N.tolist() == [0.0, 1.5] and r.prompt_N.tolist() == [10, 7]
    assert np.array_equal(read_mooncake_jsonl(path).output_N, r.output_N)


@pytest.mark.parametrize("name,text,match", [
    ("neg.csv", AZURE + "2023-11-16 18:15:46.1,-5,44\n", r"neg.csv row 2: ContextTokens = '-5'; allowed: a whole number >= 1"),
    ("zero.csv", AZURE + "2023-11-16 18:15:46.1,5,0\n", r"zero.csv row 2: GeneratedTokens = '0'"),
    ("order.csv", AZURE + "2023-11-16 18:15:47.1,5,4\n2023-11-16 18:15:46.1,5,4\n",
     r"order.csv row 3: its time is earlier than the previous row's; allowed: rows sorted by time"),
    ("empty.csv", "", r"empty.csv: the file is empty"),
    ("header.csv", AZURE, r"header.csv: the file holds no requests"),
    ("cols.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.1,5\n", r"missing column\(s\) GeneratedTokens"),
    ("stamp.csv", AZURE + "yesterday,5,4\n", r"stamp.csv row 2: TIMESTAMP = 'yesterday'"),
    ("neg.jsonl", '{"timestamp": 0, "input_length": -1, "output_length": 3}\n', r"neg.jsonl line 1: input_length = -1"),
    ("keys.jsonl", '{"timestamp": 0, "input_length": 4}\n', r"keys.jsonl line 1: missing key\(s\) output_length"),
    ("order.jsonl", '{"timestamp": 5, "input_length": 4, "output_length": 1}\n'
                    '{"timestamp": 1, "input_length": 4, "output_length": 1}\n', r"order.jsonl line 2: its time is earlier"),
    ("empty.jsonl", "\n", r"empty.jsonl: the file holds no requests"),
    ("bad.jsonl", "{nope\n", r"bad.jsonl line 1: not valid JSON"),
])
def test_bad_traces_fail_with_one_line_naming_file_and_row(tmp_path, name, text, match):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError, match=match) as info:
        load_trace(path)
    assert "\n" not in str(info.value)


def test_unknown_suffix_and_missing_file():
    with pytest.raises(ValueError, match=r"unknown format; allowed: .csv \(Azure\) or .jsonl"):
        load_trace("trace.parquet")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_trace("/nonexistent/t.csv")


def _row(**fields) -> str:
    row = {"timestamp": 0, "input_length": 4, "output_length": 2}
    row.update(fields)
    return json.dumps(row) + "\n"


BIG = 10 ** 30  # 31 digits: past int64 (an OverflowError in _finish before)
LENGTHS = r"allowed: a whole number >= 1 and <= 2147483647$"
MS = r"allowed: a finite number of milliseconds"


@pytest.mark.parametrize("name,text,match", [
    ("big.jsonl", _row() + _row(input_length=BIG), rf"^big.jsonl line 2: input_length = {BIG}; {LENGTHS}"),
    ("e30.jsonl", _row(output_length=1e30), rf"^e30.jsonl line 1: output_length = 1e\+30; {LENGTHS}"),
    ("e30.csv", AZURE + "2023-11-16 18:15:46.1,1e30,4\n", rf"^e30.csv row 2: ContextTokens = '1e30'; {LENGTHS}"),
    ("big.csv", AZURE + f"2023-11-16 18:15:46.1,5,{BIG}\n", rf"^big.csv row 2: GeneratedTokens = '{BIG}'; {LENGTHS}"),
    ("just.jsonl", _row(input_length=2 ** 31), rf"^just.jsonl line 1: input_length = 2147483648; {LENGTHS}"),
    ("bool.jsonl", _row(output_length=True), rf"^bool.jsonl line 1: output_length = true; {LENGTHS}"),
    ("boolts.jsonl", _row(timestamp=True), rf"^boolts.jsonl line 1: timestamp = true; {MS}$"),
    ("ts.jsonl", _row(timestamp=1e30),
     rf"^ts.jsonl line 1: timestamp = 1e\+30; {MS} in \[-9223372036854775807, 9223372036854775807\]$"),
    ("hugets.jsonl", _row(timestamp=10 ** 400), rf"^hugets.jsonl line 1: timestamp = 1000+\.\.\.; {MS} in "),
])
def test_lengths_and_times_past_their_range_and_booleans_are_refused(tmp_path, name, text, match):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


@pytest.mark.parametrize("name,text,match", [
    ("inf.jsonl", _row() + _row(timestamp=math.inf), rf"^inf.jsonl line 2: timestamp = inf; {MS}$"),
    ("ninf.jsonl", _row(timestamp=-math.inf), rf"^ninf.jsonl line 1: timestamp = -inf; {MS}$"),
    ("nan.jsonl", _row(timestamp=math.nan), rf"^nan.jsonl line 1: timestamp = nan; {MS}$"),
    ("nanlen.jsonl", _row(input_length=math.nan), rf"^nanlen.jsonl line 1: input_length = nan; {LENGTHS}"),
    ("inf.csv", AZURE + "2023-11-16 18:15:46.1,inf,4\n", rf"^inf.csv row 2: ContextTokens = 'inf'; {LENGTHS}"),
    ("stamp.csv", AZURE + "2023-11-16 18:15:46.5e999,5,4\n",
     r"^stamp.csv row 2: TIMESTAMP = '2023-11-16 18:15:46.5e999'; allowed: 'YYYY-MM-DD HH:MM:SS\[\.fffffff\]\[\+HH:MM or Z\]' \(no offset: UTC\)$"),
])
def test_non_finite_numbers_are_refused(tmp_path, name, text, match):
    path = _write(tmp_path, name, text)
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_requests_refuse_non_finite_arrival_times():
    with pytest.raises(ValueError, match=r"^x: request 1 arrives at nan s; allowed: finite times$"):
        Requests(np.array([0.0, math.nan]), np.array([5, 6]), np.array([1, 2]), "x")


def test_csv_header_with_a_byte_order_mark_and_spaces_is_read(tmp_path):
    rows = "2023-11-16 18:15:46.1,374,44\n2023-11-16 18:15:47.1, 396, 109\n"
    p = tmp_path / "bom.csv"
    p.write_bytes(b"\xef\xbb\xbf" + ("TIMESTAMP, ContextTokens ,GeneratedTokens\r\n" + rows).encode())
    r = load_trace(str(p))
    assert r.arrival_N.tolist() == pytest.approx([0.0, 1.0]) and r.prompt_N.tolist() == [374, 396]
    assert r.output_N.tolist() == [44, 109]
    bom = _write(tmp_path, "bom.jsonl", "\ufeff" + _row())
    assert load_trace(bom).prompt_N.tolist() == [4]


@pytest.mark.parametrize("text", ["[" + _row().strip() + "]\n", "[\n  " + _row() + "]\n"])
def test_a_json_array_says_one_object_per_line_is_expected(tmp_path, text):
    path = _write(tmp_path, "trace.json", text)
    with pytest.raises(ValueError, match=r"^trace.json line 1: a JSON array, not a JSON object; allowed: one JSON "
                                         r"object per line \(JSONL, the Mooncake format\) with timestamp, "
                                         r"input_length, output_length$"):
        load_trace(path)


def test_scaling_divides_inter_arrival_times_and_windows_shift_to_zero():
    r = Requests(np.array([0.0, 1.0, 3.0, 6.0]), np.array([5, 6, 7, 8]), np.array([1, 2, 3, 4]), "x")
    assert r.scaled(2.0).arrival_N.tolist() == [0.0, 0.5, 1.5, 3.0]
    assert r.scaled(2.0).rate == pytest.approx(2 * r.rate)
    w = r.window(1.0, 3.0)
    assert w.arrival_N.tolist() == [0.0, 2.0] and w.prompt_N.tolist() == [6, 7]
    with pytest.raises(ValueError, match="no request in the window"):
        r.window(100.0, 1.0)
    with pytest.raises(ValueError, match=r"--window-start 1e\+09 s, --window 300 s; the trace spans 6 s; "
                                         r"allowed: a window starting before 6 s"):
        r.window(1e9, 300.0)


def test_poisson_arrivals_have_the_rate_and_draw_lengths_from_the_trace():
    lengths = Requests(np.array([0.0, 1.0]), np.array([11, 22]), np.array([3, 4]), "x")
    r = poisson_requests(50.0, 4000, lengths, seed=1)
    assert r.rate == pytest.approx(50.0, rel=0.05)
    assert set(r.prompt_N.tolist()) == {11, 22} and set(zip(r.prompt_N.tolist(), r.output_N.tolist())) == {(11, 3), (22, 4)}
    assert np.array_equal(r.arrival_N, poisson_requests(50.0, 4000, lengths, seed=1).arrival_N)


def test_the_shared_azure_conversation_trace_loads():
    r = read_azure_csv(str(shared_data_dir() / "azure-llm-inference-2023-conv.csv"))
    assert len(r) == 19366 and int(np.median(r.prompt_N)) == 1020 and int(np.median(r.output_N)) == 129


def test_decode_share_is_the_tile_time_over_the_weight_read_time():
    # 15 tiles x 2 us on the whole GPU vs 120 us of weight reads: a quarter of the SMs suffices
    assert decode_sm_share(15, 2e-6, 120e-6, 132) == pytest.approx(0.25)
    assert decode_sm_share(0, 2e-6, 120e-6, 132) == 0.0
    assert decode_sm_share(1000, 2e-6, 120e-6, 132) == 1.0  # compute-bound decode takes the GPU
    assert decode_sm_share(0.01, 2e-6, 120e-6, 132) == pytest.approx(1 / 132)  # at least one SM
    with pytest.raises(ValueError, match="tile_time_s = 0"):
        decode_sm_share(3, 0.0, 1e-4, 132)
    # one share per layer, the same rule elementwise
    per_layer = decode_sm_share(np.array([15.0, 0.0, 1000.0]), 2e-6, np.array([120e-6, 1e-4, 1e-4]), 132)
    assert per_layer.tolist() == pytest.approx([0.25, 0.0, 1.0])


def test_routing_and_loads_files_give_inclusion_probabilities(tmp_path):
    import torch

    from relibra_torch import replay
    from relibra_torch.serving.routing import popularity_from_file

    # 3 tokens, 2 layers, top-2 of 4 experts; expert 0 is in every token's top-2 of layer 0
    ids_TLK = torch.tensor([[[0, 1], [2, 3]], [[0, 2], [2, 1]], [[0, 3], [3, 0]]], dtype=torch.int32)
    path = tmp_path / "r.safetensors"
    replay.save_routing(str(path), ids_TLK, torch.tensor([0, 3]), 4)
    pi = popularity_from_file(str(path), 2, 4, 2)
    assert pi[0].tolist() == pytest.approx([1.0, 1 / 3, 1 / 3, 1 / 3])
    assert pi.sum(-1).tolist() == pytest.approx([2.0, 2.0])
    loads = tmp_path / "l.safetensors"
    replay.save_loads(str(loads), torch.tensor([[[[[3, 1, 1, 1]], [[1, 1, 2, 2]]]]]), 2)
    assert torch.allclose(popularity_from_file(str(loads), 2, 4, 2), pi)
    with pytest.raises(ValueError, match=r"has \(layers, experts, top_k\) = \(2, 4, 2\) but the model has"):
        popularity_from_file(str(path), 3, 4, 2)
    # the fix names the fields that differ, the layer count keeping the model's dense layers
    with pytest.raises(ValueError, match=r"or --set model.num_moe_layers=2 --set model.top_k=2 "
                                         r"--set model.num_layers=3 \(keeps the model's other dims\)$"):
        popularity_from_file(str(path), 3, 4, 8, dense_layers=1)


def test_the_model_and_the_runtime_share_one_decode_rule():
    from relibra_torch.serving.runtime.share import decode_programs
    from relibra_torch.serving.tiles import decode_share

    # the model's SM share is decode_share with a budget of weight-read time / tile time
    assert decode_sm_share(15, 2e-6, 120e-6, 132) == pytest.approx(decode_share(15, 60.0, 132))
    # the runtime's program count is the same share, rounded up to programs
    assert decode_programs(132, 15, 0, budget_tiles=60.0) == 33  # ceil(132 x 15 / 60)
    assert decode_programs(132, 8, 512) == 3 == math.ceil(132 * decode_share(8, 520, 132))


def test_sharegpt_and_loogle_lengths_reproduce_their_published_means_and_filters():
    from relibra_torch.serving.lengths import LENGTH_MODELS, LOOGLE_MAX_PROMPT

    rng = np.random.default_rng(11)
    p, o = LENGTH_MODELS["sharegpt"].draw(100_000, rng)
    # bench_serving's ShareGPT V3 sample: 676,842 / 613,123 tokens over 3,000 prompts
    assert p.mean() == pytest.approx(676842 / 3000, rel=0.03) and o.mean() == pytest.approx(613123 / 3000, rel=0.03)
    assert p.min() >= 4 and o.min() >= 4 and p.max() <= 1024 and (p + o).max() <= 2048
    p, o = LENGTH_MODELS["loogle"].draw(100_000, rng)
    assert p.mean() == pytest.approx(24000, rel=0.03)  # LooGLE: "over 24k tokens per document"
    assert p.max() == LOOGLE_MAX_PROMPT and set(np.unique(o).tolist()) == {50, 300, 500}


def test_poisson_lengths_are_deterministic_per_seed_and_have_the_rate():
    from relibra_torch.serving.lengths import poisson_lengths

    a = poisson_lengths("sharegpt", 8.0, 4000, seed=3)
    b = poisson_lengths("sharegpt", 8.0, 4000, seed=3)
    c = poisson_lengths("sharegpt", 8.0, 4000, seed=4)
    assert np.array_equal(a.arrival_N, b.arrival_N) and np.array_equal(a.prompt_N, b.prompt_N)
    assert np.array_equal(a.output_N, b.output_N) and not np.array_equal(a.prompt_N, c.prompt_N)
    assert a.rate == pytest.approx(8.0, rel=0.05)
    fixed = poisson_lengths("loogle", 1.0, 50, seed=3, fixed_output=2048)
    assert (fixed.output_N == 2048).all() and "every output 2048" in fixed.source
    with pytest.raises(ValueError, match="--lengths 'wiki'; allowed: trace, sharegpt, loogle"):
        poisson_lengths("wiki", 1.0, 5)


def test_a_short_trace_is_repeated_back_to_back_up_to_the_minimum_span_at_the_same_rate():
    r = Requests(np.array([0.0, 1.0, 3.0, 6.0]), np.array([5, 6, 7, 8]), np.array([2, 3, 4, 5]), "t")
    s = r.scaled(2.0, min_span_s=10.0)  # spans 3 s: 4 copies, each shifted by 3 s
    assert len(s) == 16 and s.arrival_N[4:8].tolist() == [3.0, 3.5, 4.5, 6.0]
    assert s.rate == pytest.approx(r.scaled(2.0).rate) and s.prompt_N.tolist() == [5, 6, 7, 8] * 4
    assert np.all(np.diff(s.arrival_N) >= 0) and "x4 back to back" in s.source
    assert len(r.scaled(2.0, min_span_s=2.0)) == 4  # long enough already
    assert len(r.scaled(2.0, min_span_s=10.0, max_requests=9)) == 8  # the request cap: 2 copies
    assert len(r.scaled(math.inf, min_span_s=10.0)) == 4  # a burst stays a burst


def test_header_case_duplicate_columns_and_keys(tmp_path):
    """Header names match whatever their case; a column or JSON key given twice is refused
    (the readers would otherwise keep the last silently); another trace's header is named."""
    lower = _write(tmp_path, "lower.csv", "timestamp,contexttokens,generatedtokens\n2023-11-16 18:15:46.1,5,4\n"
                                          "2023-11-16 18:15:47.1,6,4\n")
    assert read_azure_csv(lower).prompt_N.tolist() == [5, 6]
    twice = _write(tmp_path, "twice.csv", "TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens\n"
                                          "2023-11-16 18:15:46.1,5,4,999999\n")
    with pytest.raises(ValueError, match=r"^twice.csv: column\(s\) ContextTokens appear more than once"):
        read_azure_csv(twice)
    key = _write(tmp_path, "key.jsonl", '{"timestamp": 0, "input_length": 5, "input_length": 700000, '
                                        '"output_length": 1}\n')
    with pytest.raises(ValueError, match=r"^key.jsonl line 1: not valid JSON \(key 'input_length' appears more "):
        read_mooncake_jsonl(key)
    burst = _write(tmp_path, "burstgpt.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                                             "5,ChatGPT,472,18,490,Conversation log\n")
    with pytest.raises(ValueError, match=r"missing column\(s\) ContextTokens, GeneratedTokens \(header: Timestamp,"
                                         r"Model,Request tokens"):
        read_azure_csv(burst)


def test_span_notes_flag_a_goodput_past_the_request_cap_and_a_trace_in_seconds():
    from relibra_torch.serving.compare import span_notes
    from relibra_torch.serving.constants import DEFAULT_CONSTANTS

    ms = Requests(np.array([0.0, 0.001, 0.002]), np.array([5, 5, 5]), np.array([1, 1, 1]), "mooncake:x.jsonl")
    notes = span_notes(ms, {"a": {"goodput": 2000.0}, "b": {"goodput": None}, "c": {"goodput": 10.0}},
                       DEFAULT_CONSTANTS)
    assert len(notes) == 2 and notes[0].startswith("a: at its goodput (2,000 req/s) a run's 50,000 requests")
    assert "read as milliseconds" in notes[1]
    slow = Requests(np.array([0.0, 1.0]), np.array([5, 5]), np.array([1, 1]), "mooncake:x.jsonl")
    assert span_notes(slow, {"c": {"goodput": 10.0}}, DEFAULT_CONSTANTS) == []
