"""`relibra inspect FILE` for routing and loads files, and its one-line errors (exit 2).

Shape legend: T tokens, L layers, K top-k, E experts, X steps, M micro-batches, S sources.
"""

from __future__ import annotations

import importlib
import re
import sys
import types

import pytest
import torch
from _replay_helpers import offsets_from_lengths, random_ids_TLK, write_raw

from relibra_torch.replay import (
    LOADS_FORMAT,
    RoutingReplay,
    batch_samples,
    save_loads,
    save_routing,
    uniform_max_over_mean,
)
from relibra_torch.replay.baseline import mean_over_token_counts
from relibra_torch.replay.cli import BASELINE_TRIALS


@pytest.fixture
def cli_main(monkeypatch):
    """relibra_torch.cli.main; stubs the simulator's subcommand only while that module does not exist yet."""
    try:
        importlib.import_module("relibra_torch.sim.cli")
    except ModuleNotFoundError as exc:
        if exc.name != "relibra_torch.sim.cli":
            raise
        stub = types.ModuleType("relibra_torch.sim.cli")
        stub.HELP, stub.add_arguments, stub.run = "stub", (lambda parser: None), (lambda args: 0)
        monkeypatch.setitem(sys.modules, "relibra_torch.sim.cli", stub)
    from relibra_torch.cli import main

    return main


def _table_rows(out: str, ncols: int) -> list[list[str]]:
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == ncols and parts[0].isdigit():
            rows.append(parts)
    return rows


def test_inspect_routing(tmp_path, capsys, cli_main):
    T, L, K, E = 400, 3, 2, 8
    ids = random_ids_TLK(T, L, K, E, seed=5, skew=1.0)
    path = tmp_path / "r.safetensors"
    save_routing(path, ids, offsets_from_lengths([100, 120, 180]), E, model="toy", sample_step=[0, 1, 1], sample_task=[0, 0, 0])
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "relibra.routing/1" in out and "model        toy" in out
    assert re.search(r"samples\s+3 \(steps 2, tasks 1\)", out)
    assert re.search(r"tokens\s+400 \(per sample min 100, mean 133.3, max 180\)", out)
    assert re.search(r"layers\s+3\n", out) and re.search(r"experts\s+8\n", out) and re.search(r"top-k\s+2\n", out)
    base = uniform_max_over_mean(T, E, K, trials=BASELINE_TRIALS)
    assert f"at {T} tokens = {base:.4f} (exact simulation, {BASELINE_TRIALS} trials)" in out
    rows = _table_rows(out, 5)
    assert len(rows) == L
    counts_LE = torch.zeros(L, E, dtype=torch.int64)
    for layer in range(L):
        counts_LE[layer] = torch.bincount(ids[:, layer].reshape(-1), minlength=E)
    mean = T * K / E
    for layer, row in enumerate(rows):
        assert int(row[0]) == layer
        assert int(row[1]) == int(counts_LE[layer].max())
        assert float(row[2]) == pytest.approx(mean)
        assert float(row[3]) == pytest.approx(int(counts_LE[layer].max()) / mean, abs=5e-4)
        assert float(row[4]) == pytest.approx(base, abs=5e-4)
    # the skewed routing is visibly worse than uniform
    assert all(float(row[3]) > base for row in rows)


def test_inspect_loads(tmp_path, capsys, cli_main):
    T, L, K, E = 300, 2, 2, 8
    replay = RoutingReplay(random_ids_TLK(T, L, K, E, seed=2), offsets_from_lengths([50, 60, 70, 120]), E)
    a = batch_samples(replay.sample_lengths, 2, num_micro_batches=3)
    loads = torch.stack([replay.counts(a), torch.zeros(3, L, 2, E, dtype=torch.int64)])  # step 1 is empty
    path = tmp_path / "l.safetensors"
    save_loads(path, loads, K)
    assert cli_main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "relibra.loads/1" in out
    assert re.search(r"steps\s+2\n", out) and re.search(r"source ranks\s+2\n", out)
    tokens_XM = loads[:, :, 0].sum(dim=(-1, -2)) // K
    nonempty = tokens_XM > 0
    n_empty = int((~nonempty).sum())
    assert re.search(rf"micro-batches\s+3 per step \({n_empty} empty\)", out)
    assert re.search(rf"tokens\s+{T} ", out)
    rows = _table_rows(out, 4)
    assert len(rows) == L
    expert_XMLE = loads.sum(dim=3)
    ratio_XML = expert_XMLE.max(dim=-1).values.double() / (tokens_XM.double() * K / E).clamp(min=1e-9)[..., None]
    ratio_NL = ratio_XML[nonempty]
    base, trials = mean_over_token_counts(tokens_XM[nonempty].tolist(), E, K, max_trials=BASELINE_TRIALS)
    assert trials == BASELINE_TRIALS  # few distinct counts: full precision
    assert f"= {base:.4f} (exact simulation, {trials} trials per distinct token count)" in out  # trials > 1 here
    # the same as averaging the one-count baseline over the micro-batches, up to Monte-Carlo
    # noise: counts 110 and 190 (per-trial sd of max/mean 0.09 / 0.07), 256 vs 4000 trials,
    # standard error of the difference ~0.004; the tolerance is 4.5 of them
    direct = sum(uniform_max_over_mean(int(t), E, K, trials=4000) for t in tokens_XM[nonempty]) / int(nonempty.sum())
    assert abs(base - direct) < 0.017, (base, direct)
    for layer, row in enumerate(rows):
        assert float(row[1]) == pytest.approx(ratio_NL[:, layer].mean().item(), abs=5e-4)
        assert float(row[2]) == pytest.approx(ratio_NL[:, layer].max().item(), abs=5e-4)
        assert float(row[3]) == pytest.approx(base, abs=5e-4)


def _assert_one_line_error(capsys, rc, *fragments):
    captured = capsys.readouterr()
    assert rc == 2
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("relibra inspect: error: ")
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_inspect_errors(tmp_path, capsys, cli_main):
    missing = tmp_path / "missing.safetensors"
    _assert_one_line_error(capsys, cli_main(["inspect", str(missing)]), "does not exist")

    text = tmp_path / "notes.txt"
    text.write_text("just some text, not a safetensors file\n")
    _assert_one_line_error(capsys, cli_main(["inspect", str(text)]), "header length", "not a safetensors file")
    text.write_bytes(b'{"a": 1}')  # 8 bytes: no room for a header after its length
    _assert_one_line_error(capsys, cli_main(["inspect", str(text)]), "8 bytes is too short for a safetensors file",
                           "at least 10 bytes")

    other = tmp_path / "other.safetensors"
    write_raw(other, {"w": torch.zeros(2)}, {"format": "pt"})
    _assert_one_line_error(capsys, cli_main(["inspect", str(other)]), "metadata format is 'pt'", "relibra.routing/1", "relibra.loads/1")
    write_raw(other, {"w": torch.zeros(2)}, None)
    _assert_one_line_error(capsys, cli_main(["inspect", str(other)]), "metadata format is missing")

    bad_loads = tmp_path / "bad_loads.safetensors"
    loads = torch.ones(1, 1, 2, 1, 4, dtype=torch.int64)
    loads[0, 0, 1, 0, 0] = 2  # layer 1 sums to 5: not a multiple of top_k = 2
    write_raw(bad_loads, {"loads": loads}, {"format": LOADS_FORMAT, "top_k": "2"})
    _assert_one_line_error(capsys, cli_main(["inspect", str(bad_loads)]), "loads[0, 0, 1, 0, :] sums to 5", "top_k = 2")

    bad_model = tmp_path / "bad_model.safetensors"
    write_raw(
        bad_model,
        {"routed_experts": torch.tensor([[[0]]], dtype=torch.int16), "sample_offsets": torch.tensor([0, 1])},
        {"format": "relibra.routing/1", "num_experts": "2", "top_k": "1", "num_layers": "1", "model": "two\nlines"},
    )
    _assert_one_line_error(capsys, cli_main(["inspect", str(bad_model)]), "metadata model")

