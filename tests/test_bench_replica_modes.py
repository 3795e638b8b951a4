"""Smoke test of benchmarks/replica_modes.py: both modes run, fill, and report a table."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_replica_modes_benchmark_runs_both_modes(tmp_path, capsys):
    import json

    import replica_modes

    out = tmp_path / "r.json"
    assert replica_modes.main(["--ranks", "2", "--layers", "2", "--dim", "32", "--hidden", "16",
                               "--tokens", "32", "--iters", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "keep" in text and "refetch" in text
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2 and all(r["keep_s"] > 0 and r["refetch_s"] > 0 for r in ranks)
    # One node of 2 ranks with a skewed load: relibra replicates, so both modes really fill.
    assert sum(r["fills"] for r in ranks) > 0
    # A rank that receives fills holds replica buffers (in both modes), one that does not holds none.
    assert all((r["keep_peak"] > 0) == (r["refetch_peak"] > 0) == (r["fills"] > 0) for r in ranks)
