"""benchmarks/moe_layer.py: the --smoke run (tiny shapes, one repeat) and its agreement check.

The timing run itself is not a test. Budget: ~10 s (mostly importing torchtitan)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "moe_layer.py"


def _load():
    spec = importlib.util.spec_from_file_location("relibra_bench_moe_layer", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    torch.set_num_threads(1)
    return _load()


def test_smoke_agrees_and_writes_both_systems(bench, tmp_path, capsys):
    out = tmp_path / "moe_layer.json"
    result = bench.main(["--smoke", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "titan ms" in printed and "relibra ms" in printed and "tiny" in printed
    saved = json.loads(out.read_text())
    assert saved["smoke"] is True and saved["threads"] == 1
    assert saved["systems"] == ["torchtitan", "relibra"]
    assert [r["dtype"] for r in saved["results"]] == ["float32", "bfloat16"]
    for r in saved["results"]:
        assert set(r["systems"]) == {"torchtitan", "relibra"}
        for s in r["systems"].values():
            assert s["fwd_bwd_s"] > 0 and s["cpu_s"] > 0 and len(s["samples_fwd_bwd_s"]) == 1
        assert set(r["max_rel_err"]) == {"out", "dx", "dgate", "dw1_EFD", "dw2_EDF", "dw3_EFD"}
        # tolerances per dtype: fp32 1e-5 (same GEMMs, only the combine order may differ);
        # bf16 5e-2 (torchtitan's bf16 router scores and bf16 combine)
        assert max(r["max_rel_err"].values()) <= {"float32": 1e-5, "bfloat16": 5e-2}[r["dtype"]], r["max_rel_err"]
        assert r["agree"] is True
        times = {name: s["fwd_bwd_s"] for name, s in r["systems"].items()}
        assert r["ratio"] == pytest.approx(times["relibra"] / times["torchtitan"])
    assert saved["summary"]["all_agree"] is True
    assert result["summary"] == saved["summary"]


def test_agreement_detects_a_difference(bench):
    torch.set_num_threads(1)
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    pair = bench.Pair(dict(bench.SMOKE_CONFIG["tiny"]), torch.float32)
    assert max(pair.agreement().values()) <= bench.TOLERANCE["float32"]
    pair.ours.route_scale = 1.01  # relibra alone scales its gates by 1.01
    errs = pair.agreement()
    assert errs["out"] > 1e-3 and errs["dx"] > 1e-3
    assert min(errs[f"d{n}"] for n in ("w1_EFD", "w2_EDF", "w3_EFD")) > 1e-3


def test_bad_arguments_are_refused(bench, tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--repeats", "0", "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit):
        bench.main(["--tokens", "0", "--json", str(tmp_path / "x.json")])


def test_bf16_rows_are_skipped_with_a_note_on_a_cpu_without_fast_bf16(bench, tmp_path, capsys, monkeypatch):
    assert bench.slow_bf16_reason("AVX512") is None and bench.slow_bf16_reason("AMX") is None
    assert "AVX2, not AVX-512/AMX" in bench.slow_bf16_reason("AVX2")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    out = tmp_path / "m.json"
    # no rows are timed: the only requested dtype is skipped (a real run would take minutes)
    result = bench.main(["--configs", "small", "--dtypes", "bfloat16", "--json", str(out)])
    printed = capsys.readouterr().out
    assert "note: bf16 rows skipped: torch's CPU kernels here are AVX2" in printed and "--force-bf16" in printed
    assert result["results"] == [] and result["skipped"][0]["dtype"] == "bfloat16"
    assert json.loads(out.read_text())["skipped"] == result["skipped"]
