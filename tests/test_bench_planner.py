"""Smoke test of benchmarks/planner.py: every system plans, the figures and the split time are reported."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_planner_benchmark_reports_every_system_and_the_split_time(tmp_path, capsys):
    import planner

    out = tmp_path / "p.json"
    threads = torch.get_num_threads()
    try:  # the benchmark pins one thread (its target is one core); later tests keep theirs
        result = planner.main(["--nodes", "2", "--gpus-per-node", "2", "--experts", "8", "--top-k", "2",
                               "--layers", "3", "--micro-batches", "2", "--tokens", "64", "--warmup", "1",
                               "--repeats", "2", "--json", str(out)])
    finally:
        torch.set_num_threads(threads)
    text = capsys.readouterr().out
    assert "token split of one micro-batch, all 3 layers" in text
    rows = result["systems"]
    assert set(rows) == {"static", "eplb", "eplb-oracle", "relibra", "lower-bound"}
    assert rows["relibra"]["token_split_ms_per_micro_batch"] > 0
    assert rows["relibra"]["rank_share_s"] > 0 and rows["relibra"]["plan_s"] > 0
    # relibra never balances worse than static placement on the same loads
    assert rows["relibra"]["imbalance_mean"] <= rows["static"]["imbalance_mean"]
    assert out.exists()
    small = result["relibra_no_copy_case"]
    assert small["fast_path"] and small["replicas"] == 0 and small["migrated_experts"] == 0
    assert "relibra on small micro-batches" in text
    assert len(result["relibra_no_copy_cases"]) == len(planner.NO_COPY_CASES)
    assert all(r["plan_s"] > 0 for r in result["relibra_no_copy_cases"])
