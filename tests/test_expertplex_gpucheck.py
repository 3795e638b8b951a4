"""`make gpu-check`'s ExpertPlex microbenchmark part (relibra_torch.gpu_check.expertplex) on CPU.

The measuring check needs CUDA and is skipped here with its reason; its case (tables from
per-expert row counts, decode rows first), the persistent launch it times (in the
interpreter, tiny shapes), its output check, the figures and the `expertplex.tile_time_us`
key of gpu_check.json are run for real.
"""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from relibra_torch.gpu_check import expertplex  # noqa: E402
from relibra_torch.gpu_check.report import Report  # noqa: E402
from relibra_torch.ops import persistent_gemm as pg  # noqa: E402

TINY = expertplex.Shape(prefill_rows=70, decode_rows=9, experts=3, dim=24, cols=20, tile_m=16, tile_n=16,
                        tile_k=16, num_warps=4, num_stages=1, reps=2)


def test_without_cuda_the_measurement_is_skipped_with_its_reason(tmp_path):
    report = Report("default")
    assert expertplex.run(report, torch.device("cpu"), TINY) == []
    [row] = report.checks
    assert row["status"] == "skipped" and "needs a CUDA device" in row["reason"]
    data = json.loads(report.write(tmp_path, [])[0].read_text())
    assert "expertplex" not in data


def test_the_timed_persistent_launch_computes_both_phases():
    case = expertplex.make_case(TINY, torch.device("cpu"), torch.float32, seed=3)
    assert case["dec_E"].tolist() == [3, 3, 3] and case["pre_E"].tolist() == [24, 23, 23]
    assert case["tab_dec"].shape[0] == 3 * 1 * 2 and case["tab_pre"].shape[0] == 3 * 2 * 2
    ctrl = pg.control_words(case["tab_dec"].shape[0], case["tab_pre"].shape[0])
    y = torch.full((79, 20), float("nan"))
    expertplex.run_persistent(case, TINY, programs=3, control=ctrl, y=y)
    assert expertplex.rel_err(y, expertplex.reference(case)) < 1e-6
    assert ctrl.tolist()[5:] == [6, 12, 0]
    # an unserved decode (never published) is caught by the output check: its rows stay NaN
    ctrl = pg.control_words(0, case["tab_pre"].shape[0])
    y = torch.full((79, 20), float("nan"))
    expertplex.run_persistent(case, TINY, programs=2, control=ctrl, y=y)
    assert not expertplex.rel_err(y, expertplex.reference(case)) <= expertplex.MAX_REL_ERR


def test_figures_tile_time_and_json_key(tmp_path):
    t = {"plain_prefill_alone": [2.0, 2.2, 2.1], "plain_decode_alone": [0.05, 0.05, 0.06],
         "persistent_prefill_alone": [2.4, 2.4, 2.5], "plain_prefill": [2.1], "plain_decode": [2.0],
         "priority_prefill": [2.3], "priority_decode": [0.6], "persistent_prefill": [2.5],
         "persistent_decode": [0.055]}
    s = expertplex.summarize(t, n_prefill_tiles=768, programs=132)
    assert abs(s["tile_time_us"] - 2.4e3 * 132 / 768) < 1e-9
    assert abs(s["plain"]["decode_latency_over_alone"] - 40.0) < 1e-9
    assert abs(s["persistent"]["prefill_time_over_alone"] - 2.5 / 2.1) < 1e-9
    [line] = expertplex.highlights(s)
    assert "persistent: decode x1.10" in line and "tile time 412.50 us" in line
    report = Report("default")
    report.keys[expertplex.KEY] = {"tile_time_us": s["tile_time_us"]}
    data = json.loads(report.write(tmp_path, [line])[0].read_text())
    assert data["expertplex"]["tile_time_us"] == s["tile_time_us"] and data["mode"] == "default"


def test_the_serving_override_reads_the_tile_time_back(tmp_path):
    import pytest

    from relibra_torch.serving.runtime.calibration import tile_time_us

    from relibra_torch.serving.runtime.calibration import kernel_flops

    report = Report("default")
    report.keys[expertplex.KEY] = {"tile_time_us": 3.25, "tile": [128, 128, 64], "dim": 2048, "programs": 4}
    report.write(tmp_path, [])
    assert tile_time_us(tmp_path) == 3.25 == tile_time_us(tmp_path / "gpu_check.json")
    assert kernel_flops(tmp_path) == pytest.approx(2 * 128 * 128 * 2048 * 4 / 3.25e-6)
    Report("default").write(tmp_path / "cpu", [])
    with pytest.raises(ValueError, match="no positive expertplex.tile_time_us"):
        tile_time_us(tmp_path / "cpu")
    with pytest.raises(ValueError, match="cannot read"):
        tile_time_us(tmp_path / "missing.json")
