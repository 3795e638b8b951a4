"""relibra_torch.gpu_check on a machine without CUDA.

The GPU run itself needs a GPU; here: the no-torch and no-CUDA exits (one line, status 0),
the float64 references and the comparison rule it judges the kernels by (against the loop
oracles and the torch reference ops, and that they catch wrong, unwritten and non-finite
outputs), output poisoning, config pinning, the declared-range check, the report files;
and the layer, benchmark and EP parts themselves on tiny CPU shapes (the benchmark part with
the interpreted kernels, the EP check on 2 gloo ranks). Budget: ~35 s (the EP run spawns
two processes).

Shape legend: R sorted rows, S slots, G weights, T tokens, K top-k, D hidden; grouped GEMM
operands x_RK / w_GKN / y_RN (K reduction dim, N output dim).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relibra_torch.gpu_check import ep, kernels, runner
from relibra_torch.gpu_check import reference as ref
from relibra_torch.gpu_check.report import Report, Skip
from relibra_torch.ops import oracle
from relibra_torch.ops import reference as torch_ref

ROOT = Path(__file__).resolve().parents[1]
CASES = [  # (sizes_S, slot_to_weight_S or None, G, Kd, N, tail rows)
    ([0, 5, 0, 17, 1], None, 5, 9, 7, 0),
    ([3, 0, 11, 4], [2, 0, 2, 1], 4, 16, 24, 3),  # weight 3 unused: its gradient is exactly 0
    ([0, 0, 0], [1, 1, 0], 2, 5, 4, 2),  # no rows in any slot
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_no_torch_prints_one_line_and_exits_0(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ModuleNotFoundError
    assert runner.main(["--out", str(tmp_path / "o")]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no torch in ")
    assert not (tmp_path / "o").exists()


def test_no_cuda_prints_one_line_and_exits_0(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "relibra_torch.gpu_check", "--out", str(tmp_path / "o")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "sees no CUDA device" in lines[0], proc.stdout
    assert not (tmp_path / "o").exists()


def test_bad_gpu_check_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("GPU_CHECK", "fast")
    with pytest.raises(SystemExit):
        runner._parse([])
    monkeypatch.setenv("GPU_CHECK", "full")
    assert runner._parse([]).mode == "full"


@pytest.mark.parametrize("sizes,s2w,G,Kd,N,tail", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_references_match_the_oracle_and_accept_the_torch_ops(sizes, s2w, G, Kd, N, tail, dtype):
    offs = ref.offsets_of(sizes, "cpu")
    s2w_t = None if s2w is None else torch.tensor(s2w)
    R = sum(sizes) + tail
    x = ref.randn((R, Kd), dtype, "cpu", _gen(1))
    w = ref.randn((G, Kd, N), dtype, "cpu", _gen(2))
    dy = ref.randn((R, N), dtype, "cpu", _gen(3))
    exact, bound = ref.grouped_mm_f64(x, w, offs, s2w_t)
    want, want_bound = oracle.grouped_mm(x, w, offs, s2w_t)
    torch.testing.assert_close(exact, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bound, want_bound, rtol=1e-12, atol=1e-12)
    assert ref.within(torch_ref.grouped_mm(x, w, offs, s2w_t), exact, bound, dtype, "y") <= 1.0
    dw, dw_bound = ref.grouped_mm_wgrad_f64(x, dy, offs, s2w_t, G)
    want, want_bound = oracle.grouped_mm_wgrad(x, dy, offs, s2w_t, G)
    torch.testing.assert_close(dw, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dw_bound, want_bound, rtol=1e-12, atol=1e-12)
    assert ref.within(torch_ref.grouped_mm_wgrad(x, dy, offs, s2w_t, G), dw, dw_bound, dtype, "dw") <= 1.0
    if s2w is not None and G - 1 not in s2w:
        assert torch.equal(dw[G - 1], torch.zeros(Kd, N, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unpermute_references_match_the_oracle_and_accept_the_torch_ops(dtype):
    T, K, D, S = 13, 3, 10, 5
    slots_TK = torch.randint(0, S, (T, K), generator=_gen(4))
    row_of, _ = torch_ref.permute_index(slots_TK, S)
    y = ref.randn((T * K, D), dtype, "cpu", _gen(5))
    gates = torch.rand(T, K, generator=_gen(6))
    exact, bound = ref.unpermute_f64(y, row_of, gates)
    want, want_bound = oracle.unpermute(y, row_of, gates)
    torch.testing.assert_close(exact, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bound, want_bound, rtol=1e-12, atol=1e-12)
    assert ref.within(torch_ref.unpermute(y, row_of, gates), exact, bound, dtype, "out") <= 1.0
    dout = ref.randn((T, D), dtype, "cpu", _gen(7))
    (dy, dy_bound), (dg, dg_bound) = ref.unpermute_backward_f64(dout, y, row_of, gates)
    got_dy, got_dg = torch_ref.unpermute_backward(dout, y, row_of, gates)
    ref.within(got_dy, dy, dy_bound, dtype, "dy")
    ref.within(got_dg, dg, dg_bound, torch.float32, "dgates")


def test_within_catches_wrong_unwritten_and_nonfinite_outputs():
    offs = ref.offsets_of([4, 0, 6], "cpu")
    x = ref.randn((10, 8), torch.bfloat16, "cpu", _gen(8))
    w = ref.randn((3, 8, 5), torch.bfloat16, "cpu", _gen(9))
    exact, bound = ref.grouped_mm_f64(x, w, offs, None)
    good = torch_ref.grouped_mm(x, w, offs, None)
    ref.within(good, exact, bound, torch.bfloat16, "good")
    off = good.clone()
    allowed = oracle.TOL[torch.bfloat16] * bound[7, 2] + oracle.ABS_FLOOR[torch.bfloat16]
    off[7, 2] = float(exact[7, 2] + 3 * allowed + 0.1)  # well beyond the bound (bf16 rounding included)
    with pytest.raises(AssertionError, match=r"1 of 50 elements off \(0 not finite\); first at flat index 37"):
        ref.within(off, exact, bound, torch.bfloat16, "off")
    with ref.poisoned_outputs():  # a "kernel" that forgets the last slot's rows
        partial = torch.empty(10, 5, dtype=torch.bfloat16)
        partial[:4] = good[:4]
    with pytest.raises(AssertionError, match=r"30 of 50 elements off \(30 not finite\)"):
        ref.within(partial, exact, bound, torch.bfloat16, "partial")
    with pytest.raises(AssertionError, match="shape"):
        ref.within(good[:9], exact, bound, torch.bfloat16, "short")


def test_poisoned_outputs_fill_new_tensors_and_restore_torch():
    empty, empty_like = torch.empty, torch.empty_like
    with ref.poisoned_outputs():
        assert bool(torch.empty(3, 4).isnan().all())
        assert bool(torch.empty_like(torch.zeros(2, dtype=torch.bfloat16)).isnan().all())
        assert torch.empty(5, dtype=torch.int64).tolist() == [ref._POISON_INT] * 5
        assert torch.empty(2, dtype=torch.int32).tolist() == [ref._POISON_INT] * 2
    assert torch.empty is empty and torch.empty_like is empty_like


def test_kernel_cases_pass_on_the_torch_reference_ops():
    # the checks' own logic (fresh inputs, poisoning, fp64 comparison) on the CPU reference ops
    import relibra_torch.ops as ops

    gen = _gen(10)
    with ops.use_backend("torch"), ref.poisoned_outputs():
        edges = kernels._grouped_edges(torch.device("cpu"), gen)
        assert len(edges) == 10 and all(v <= 1.0 for case in edges.values() for v in case.values())
        kernels._permute_index(torch.device("cpu"), gen)


def test_pinned_swaps_one_config_and_restores_it():
    from relibra_torch.ops import triton_kernels as tk  # the interpreter's fixed-config kernels

    kernel = tk._grouped_mm_kernel
    before = kernel._relibra_fixed_config
    other = object()
    with kernels.pinned(kernel, other):
        assert kernel._relibra_fixed_config is other
    assert kernel._relibra_fixed_config is before

    class FakeAutotuner:
        configs = ["a", "b"]

    with kernels.pinned(FakeAutotuner, "b"):
        assert FakeAutotuner.configs == ["b"]
    assert FakeAutotuner.configs == ["a", "b"]


@pytest.mark.parametrize("version,requirement,want", [
    ("2.11.0+cu130", "torch>=2.11,<2.14", True), ("2.13.0+cpu", "torch>=2.11,<2.14", True),
    ("2.10.1", "torch>=2.11,<2.14", False), ("2.14.0", "torch>=2.11,<2.14", False),
    ("3.6.0", "triton>=3.6,<3.10", True), ("3.10.1", "triton>=3.6,<3.10", False),
    ("3.12.3", ">=3.11", True), ("3.10.14", ">=3.11", False), (None, ">=3.11", None),
])
def test_declared_range_check(version, requirement, want):
    assert runner._in_range(version, requirement) is want


def test_declared_ranges_come_from_pyproject():
    ranges = runner._declared_ranges()
    assert ranges["torch"].startswith("torch>=") and ranges["triton"].startswith("triton>=")
    assert runner._in_range("2.11.0", ranges["torch"]) and runner._in_range("3.6.0", ranges["triton"])


def test_report_records_every_outcome_and_writes_json_and_markdown(tmp_path, capsys):
    report = Report("default")
    report.env = {"gpu_name": "NVIDIA H200", "torch": "2.11.0+cu130"}
    assert report.check("p", "fine", lambda: {"x": 1}) == {"x": 1}
    assert report.check("p", "broken", lambda: 1 / 0) is None

    def skip():
        raise Skip("one GPU")

    report.check("p", "n/a", skip)
    assert [c["status"] for c in report.checks] == ["ok", "failed", "skipped"]
    assert report.counts() == {"ok": 1, "failed": 1, "skipped": 1} and len(report.failed) == 1
    json_path, md_path = report.write(tmp_path / "o", ["a figure"])
    data = json.loads(json_path.read_text())
    assert data["checks"][1]["error"].startswith("ZeroDivisionError") and "Traceback" in data["checks"][1]["traceback"]
    md = md_path.read_text()
    assert "NVIDIA H200" in md and "- a figure" in md and "| p | n/a | skipped |" in md
    assert "[failed ] p: broken" in capsys.readouterr().out


def test_report_with_an_out_dir_keeps_what_a_cut_short_run_measured(tmp_path):
    report = Report("default", tmp_path / "o")
    report.check("p", "first", lambda: 1)
    data = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert data["partial"] is True and [c["name"] for c in data["checks"]] == ["first"]
    assert "partial" in (tmp_path / "o" / "summary.md").read_text()
    report.check("p", "second", lambda: 2)
    assert len(json.loads((tmp_path / "o" / "gpu_check.json").read_text())["checks"]) == 2
    report.write(tmp_path / "o", [])
    final = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert final["partial"] is False and "partial" not in (tmp_path / "o" / "summary.md").read_text()


@pytest.mark.slow
def test_ep_check_runs_on_two_gloo_ranks():
    result = ep.run_ranks(2, seed=1, device_type="cpu")
    assert result["ranks"] == 2 and result["mesh"] == [1, 2]
    assert all(v <= ep.TOL for v in result["max_rel_err"].values()), result
    assert sum(result["expert_rows_per_gpu"]) == 2 * 64 * 4  # every (token, k) of both ranks ran once


def test_layer_checks_run_on_cpu_with_small_shapes(monkeypatch):
    # the layer part's own logic, on the CPU (both sides of the "CUDA vs CPU" check are the
    # CPU here); poisoned allocations included
    from relibra_torch.gpu_check import layer

    monkeypatch.setitem(layer.SHAPE, "D", 32)
    monkeypatch.setitem(layer.SHAPE, "F", 24)
    monkeypatch.setitem(layer.SHAPE, "E", 8)
    monkeypatch.setitem(layer.SHAPE, "K", 2)
    monkeypatch.setitem(layer.SHAPE, "T", 64)
    cpu, gen = torch.device("cpu"), _gen(11)
    errs = layer._pinned_and_poisoned(layer._cuda_vs_cpu, cpu, gen)()
    assert errs["float32"]["out"] == 0.0 and 0 < errs["bfloat16"]["out"] <= layer.TOL[torch.bfloat16]
    assert set(layer._pinned_and_poisoned(layer._planned_vs_local, cpu, gen)()) == {"out", "dx", "dgate.weight"}
    load = layer._load_bench_moe_layer

    def tiny_bench():
        mod = load()
        mod.CONFIGS["qwen3-30b-a3b"] = {"D": 32, "F": 16, "E": 8, "K": 2, "T": 32}
        return mod

    monkeypatch.setattr(layer, "_load_bench_moe_layer", tiny_bench)
    titan = layer._vs_torchtitan(cpu, gen)
    assert max(titan["max_rel_err"].values()) <= 5e-2 and titan["ratio_relibra_over_torchtitan"] > 0


def test_bench_part_runs_the_kernel_benchmark_in_the_interpreter(monkeypatch):
    # the benchmark part end to end on tiny shapes: the Triton kernels (interpreted) against
    # torch._grouped_mm, the agreement check, the summary and its highlight lines
    from relibra_torch.gpu_check import bench

    load = bench.load_kernels_benchmark

    def tiny():
        mod = load()
        mod.MODELS["tiny"] = {"D": 32, "F": 16, "top_k": 2}
        return mod

    monkeypatch.setattr(bench, "load_kernels_benchmark", tiny)
    report = Report("default")
    lines = bench.run(report, torch.device("cpu"), False,
                      {"model": "tiny", "slots": [4], "rows": [64], "dists": ["skewed"]})
    assert [c["status"] for c in report.checks] == ["ok"] * 3, report.checks
    summary = report.checks[-1]["detail"]
    assert summary["gemm_fwd"]["ratio_geomean"] > 0 and summary["permute"]["GBps_max"] > 0
    assert any(line.startswith("grouped GEMM dW: ours / torch._grouped_mm") for line in lines)
    assert any(line.startswith("unpermute: ") for line in lines)


def test_main_runs_the_parts_in_order_and_fails_only_on_a_failed_check(monkeypatch, tmp_path, capsys):
    from relibra_torch.gpu_check import bench, expertplex, layer

    calls = []
    # main() clears TRITON_INTERPRET and sets the ops backend: restored after the test
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("RELIBRA_OPS_BACKEND", "auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(runner, "environment", lambda torch: {"gpu_name": "NVIDIA H200", "gpu_count": 1})

    def part(name, fail=False):
        def run(report, *args):
            calls.append((name, args))
            report.check(name, "stub", (lambda: 1 / 0) if fail else (lambda: "fine"))
            return [f"{name} figure"] if name == "bench" else [] if name == "expertplex" else None
        return run

    for mod, name in ((kernels, "kernels"), (layer, "layer"), (bench, "bench"), (expertplex, "expertplex"),
                      (ep, "ep")):
        monkeypatch.setattr(mod, "run", part(name))
    monkeypatch.setattr(layer, "run_full", part("layer_full"))
    assert runner.main(["--out", str(tmp_path / "a"), "--seed", "5"]) == 0
    assert [c[0] for c in calls] == ["kernels", "layer", "bench", "expertplex", "ep"]
    assert calls[0][1][1:] == (False, 5)  # kernels: device, full, seed
    data = json.loads((tmp_path / "a" / "gpu_check.json").read_text())
    assert data["mode"] == "default" and data["env"]["seed"] == 5 and data["highlights"] == ["bench figure"]
    calls.clear()
    monkeypatch.setattr(ep, "run", part("ep", fail=True))
    monkeypatch.setenv("GPU_CHECK", "full")
    assert runner.main(["--out", str(tmp_path / "b")]) == 1
    assert [c[0] for c in calls] == ["kernels", "layer", "bench", "expertplex", "ep", "layer_full"]
    assert "1 failed" in capsys.readouterr().out.strip().splitlines()[-1]


def test_kernel_configs_benchmark_runs_its_three_parts_in_the_interpreter(tmp_path):
    # benchmarks/kernel_configs.py is what took the H200 findings apart (index build, GEMM
    # configs by rows, the persistent kernel and its controls): keep it runnable without a GPU.
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "kc.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_configs.py"), "--cpu-smoke",
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert {"permute_index", "gemm", "persistent"} <= set(data)
    assert all(r["static_us"] > 0 and r["persistent_us"] > 0 for r in data["persistent"])
    assert {r["pass"] for r in data["gemm"]} == {"fwd", "dW"}
