"""Smoke test of benchmarks/a2a_breakdown.py on a small cluster."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_a2a_breakdown_prices_each_counterfactual(tmp_path, capsys):
    import a2a_breakdown

    out = tmp_path / "b.json"
    result = a2a_breakdown.main(["--nodes", "2", "--gpus-per-node", "2", "--micro-batches", "2",
                                 "--micro-batch-tokens", "256", "--systems", "eplb-oracle,relibra",
                                 "--json", str(out), "--ignore-memory"])  # 30B on 4 GPUs: a what-if
    assert "ranks' token-expert pairs" in capsys.readouterr().out and out.exists()
    assert set(result["systems"]) == {"eplb-oracle", "relibra"}
    for r in result["systems"].values():
        # evening a side inside nodes never slows the exchange; evening both beats either
        assert r["if_both_even_in_node_s"] <= min(r["if_recv_even_in_node_s"], r["if_send_even_in_node_s"]) + 1e-9
        assert max(r["if_recv_even_in_node_s"], r["if_send_even_in_node_s"]) <= r["all_to_all_s"] + 1e-9
        assert r["cross_recv_imbalance"]["gpu"] >= 1.0 and r["cross_send_imbalance"]["inside_worst_node"] >= 1.0
    with pytest.raises(SystemExit, match="--dispatch flat only"):
        a2a_breakdown.main(["--dispatch", "hierarchical", "--nodes", "2", "--gpus-per-node", "2", "--ignore-memory"])
