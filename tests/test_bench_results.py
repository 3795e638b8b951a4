"""Smoke tests of the scoreboard scripts: benchmarks/results.py and benchmarks/routing_file.py."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_results_lists_its_runs_and_formats_a_summary_row(capsys):
    import results
    assert results.main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(f"{name}: relibra simulate" in out for name in results.RUNS)
    doc = {"config": {"static_imbalance": 2.0},
           "systems": {"static": {"step_time_s": 4.0}, "eplb-oracle": {"step_time_s": 3.0},
                       "relibra": {"step_time_s": 2.5, "fraction_of_bound": 0.5},
                       "uniform": {"step_time_s": 1.0}, "bound": {"step_time_s": 1.25}}}
    row = results.summary_row("x", ["--a"], doc)  # references are never "the fastest baseline"
    assert "eplb-oracle 3.00 s" in row and "1.200x" in row and "1.600x" in row and "0.500" in row


def test_routing_file_writes_a_per_token_file_of_every_step(tmp_path):
    import routing_file

    from relibra_torch.replay import load_routing
    out = tmp_path / "t.safetensors"
    assert routing_file.main(["--samples", "2", "--steps", "2", "--method", "systematic", "--out", str(out)]) == 0
    r = load_routing(str(out))
    assert r.routed_experts_TLK.shape[1:] == (48, 8) and r.num_experts == 128
    assert torch.equal(r.sample_step.unique(), torch.tensor([0, 1]))
