"""Smoke test of examples/grpo_toy.py on 4 gloo ranks with tiny settings.

Checks what the example claims: training uses exactly the rollout's experts (agreement
100%), the layer counters measure exactly the imbalance the planner predicted, and the
replay files on disk hold one sample per generated sequence.
Budget: ~30 s (4 spawned ranks).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import grpo_toy  # noqa: E402

from relibra_torch.replay.routing import load_routing  # noqa: E402
from relibra_torch.testing import run_on_ranks  # noqa: E402


@pytest.mark.slow
def test_grpo_toy_runs_with_exact_replay(tmp_path):
    args = dataclasses.replace(grpo_toy.Args(), steps=2, prompts_per_rank=2, group_size=3, sft_steps=3,
                               explore=True, out=str(tmp_path))
    sft = str(tmp_path / "warm_start.pt")
    grpo_toy.warm_start(args, sft)
    per_rank = run_on_ranks(grpo_toy.rank_main, 4, dataclasses.asdict(args), sft, timeout_s=240)
    rows = per_rank[0]
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert all(strip(other) == strip(rows) for other in per_rank)  # every rank reports global numbers
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["agree_replay"] == 1.0
        assert r["agree_free"] < 1.0  # exploration on: the router alone would route elsewhere
        for measured, predicted in zip(r["imb_relibra_L"], r["imb_predicted_L"]):
            assert measured == pytest.approx(predicted, rel=1e-12)
        assert all(s >= 1.0 for s in r["imb_static_L"])
    for step in range(2):
        for rank in range(4):
            replay = load_routing(tmp_path / f"step{step:03d}_rank{rank}.routing.safetensors")
            assert replay.num_samples == 6 and replay.num_layers == 2 and replay.top_k == 2
            assert replay.sample_step.tolist() == [step] * 6
    line = grpo_toy.summary(rows, args, 1.0)
    assert "replay agreement 100.0% (min)" in line
