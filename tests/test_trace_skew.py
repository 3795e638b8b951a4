"""``TraceConfig.skew`` (``--set trace.skew=X``): the exponent on the trace's expert weights.

Small shapes (2 layers x 16 experts, top-2, 4 GPUs) so each case takes well under a second
after the trace model's one-off calibration. Legend: X steps, M micro-batches, L layers,
S source ranks, E experts, A tasks.
"""

from __future__ import annotations

import json

import pytest
import torch

from relibra_torch.cli import main
from relibra_torch.sim.report import static_imbalance
from relibra_torch.sim.traces import TraceConfig, generate_load_trace
from relibra_torch.sim.traces.model import task_inclusion_ALE

SMALL = dict(num_layers=2, num_experts=16, top_k=2)


def _static(skew: float) -> float:
    cfg = TraceConfig(**SMALL, skew=skew)
    trace = generate_load_trace(cfg, 4, 4, 2048, steps=1)
    return static_imbalance(trace.loads_XMLSE, 4)


def test_skew_zero_makes_every_expert_equally_likely():
    pi_ALE = task_inclusion_ALE(TraceConfig(**SMALL, skew=0.0))
    torch.testing.assert_close(pi_ALE, torch.full_like(pi_ALE, 2 / 16), rtol=0, atol=1e-9)


def test_skew_one_is_the_calibrated_trace_and_skew_orders_static_imbalance():
    base = generate_load_trace(TraceConfig(**SMALL), 4, 4, 2048, steps=1).loads_XMLSE
    same = generate_load_trace(TraceConfig(**SMALL, skew=1.0), 4, 4, 2048, steps=1).loads_XMLSE
    assert torch.equal(base, same)
    values = [_static(s) for s in (0.0, 0.5, 1.0, 2.0)]
    assert values == sorted(values) and values[-1] > values[0] + 0.2, values


def test_static_imbalance_definition_by_hand():
    loads_XMLSE = torch.zeros(1, 2, 1, 2, 4, dtype=torch.int64)
    loads_XMLSE[0, 0, 0, 0] = torch.tensor([3, 1, 0, 0])  # GPU 0: 4, GPU 1: 0 -> 2.0
    loads_XMLSE[0, 0, 0, 1] = torch.tensor([0, 0, 0, 0])
    # micro-batch 1 is empty: left out, not counted as 1.0
    assert static_imbalance(loads_XMLSE, 2) == pytest.approx(2.0)
    loads_XMLSE[0, 1, 0, 1] = torch.tensor([1, 0, 2, 1])  # GPU 0: 1, GPU 1: 3 -> 1.5
    assert static_imbalance(loads_XMLSE, 2) == pytest.approx((2.0 + 1.5) / 2)


ARGS = ["simulate", "--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--systems", "static",
        "--micro-batches", "2", "--micro-batch-tokens", "256", "--steps", "1", "--ignore-memory"]  # full-size model on a few GPUs: a memory what-if


def test_cli_skew_reaches_the_trace_and_the_json(tmp_path, capsys):
    out = {}
    for skew in ("0", "1.5"):
        path = tmp_path / f"s{skew}.json"
        assert main([*ARGS, "--set", f"trace.skew={skew}", "--json", str(path)]) == 0
        doc = json.loads(path.read_text())
        assert doc["config"]["trace_skew"] == float(skew)
        out[skew] = doc["config"]["static_imbalance"]
        assert doc["systems"]["static"]["imbalance_mean"] == pytest.approx(out[skew], rel=1e-6)
    assert out["1.5"] > out["0"]
    assert "static imbalance" in capsys.readouterr().out


@pytest.mark.parametrize("setting, message", [
    ("trace.skew=abc", "trace.skew='abc'; allowed: a number in [0, 4]"),
    ("trace.skew=5", "--set trace.skew = 5.0; allowed"),
    ("trace.sharpness=2", "unknown trace field; allowed: trace.skew"),
])
def test_cli_bad_skew_is_one_line(setting, message, capsys):
    assert main([*ARGS, "--set", setting]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err and "Traceback" not in err
