"""A subset of ``benchmarks/kernels.py`` (loaded from the checkout), with its figures kept.

Grouped GEMM forward, dX and dW TFLOP/s against ``torch._grouped_mm`` on the same operands
(Qwen3-30B-A3B expert shapes, autotuned kernels); permute / unpermute GB/s against the
measured device-to-device copy bandwidth (and the spec sheet's, where the GPU is known).
Timings are figures, not pass/fail; a check fails only when a result disagrees with
``torch._grouped_mm`` (relative Frobenius error above :data:`MAX_REL_ERR`) or a row errors.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from relibra_torch.gpu_check.report import Report, load_benchmark

PART = "bench"
MAX_REL_ERR = 2e-2  # bf16 outputs of two fp32-accumulating GEMMs: ~4e-3 expected
DEFAULT = {"model": "qwen3-30b-a3b", "slots": [8], "rows": [16384, 65536], "dists": ["balanced", "skewed"]}
FULL = {"model": "qwen3-30b-a3b", "slots": [8, 32], "rows": [4096, 16384, 65536], "dists": ["balanced", "skewed"]}


def load_kernels_benchmark():
    return load_benchmark("kernels")


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


def summarize(gemm: list[dict], perm: list[dict], copy_bw: float, spec_bw: float | None) -> dict[str, Any]:
    """Per pass: min and geometric mean of ours / torch (time ratio); per op: GB/s and fractions."""
    out: dict[str, Any] = {"copy_GBps": copy_bw / 1e9, "spec_GBps": spec_bw / 1e9 if spec_bw else None}
    for p in ("fwd", "dX", "dW"):
        rows = [r for r in gemm if r["pass"] == p and "ratio" in r]
        out[f"gemm_{p}"] = {
            "ratio_min": min((r["ratio"] for r in rows), default=None),
            "ratio_geomean": _geomean([r["ratio"] for r in rows]),
            "ours_tflops_max": max((r["ours_tflops"] for r in rows), default=None),
            "torch_tflops_max": max((r["torch_tflops"] for r in rows), default=None),
        }
    for op in ("permute", "unpermute"):
        rows = [r for r in perm if r["op"] == op]
        bw = [r["bandwidth"] for r in rows]
        out[op] = {"GBps_min": min(bw, default=0) / 1e9, "GBps_max": max(bw, default=0) / 1e9,
                   "of_copy_min": min(bw, default=0) / copy_bw,
                   "of_spec_min": (min(bw, default=0) / spec_bw) if spec_bw else None}
    return out


def highlights(summary: dict[str, Any], targets: dict[str, float]) -> list[str]:
    lines = []
    for p in ("fwd", "dX", "dW"):
        g = summary.get(f"gemm_{p}", {})
        if g.get("ratio_geomean"):
            lines.append(f"grouped GEMM {p}: ours / torch._grouped_mm time ratio geomean {g['ratio_geomean']:.2f}, "
                         f"min {g['ratio_min']:.2f} (target >= {targets['gemm_ratio']}); best {g['ours_tflops_max']:.0f} "
                         f"vs {g['torch_tflops_max']:.0f} TFLOP/s")
    for op in ("permute", "unpermute"):
        o = summary.get(op)
        if o and o["GBps_max"]:
            spec = f", {o['of_spec_min']:.2f} of the spec sheet" if o["of_spec_min"] else ""
            lines.append(f"{op}: {o['GBps_min']:.0f}-{o['GBps_max']:.0f} GB/s, min {o['of_copy_min']:.2f} of the "
                         f"measured copy ({summary['copy_GBps']:.0f} GB/s){spec} (target >= {targets['bandwidth']})")
    return lines


def run(report: Report, device: torch.device, full: bool, sel: dict | None = None) -> list[str]:
    """Record the benchmark subset (``sel``: model, slots, rows, dists; by default
    :data:`DEFAULT` or :data:`FULL`); return its highlight lines for the summary."""
    sel = sel or (FULL if full else DEFAULT)
    state: dict[str, Any] = {}

    def setup():
        mod = load_kernels_benchmark()
        bench = mod._timer(device, 25, 100)
        spec_bw, copy_bw = mod._device_bandwidth(device, bench)
        state.update(mod=mod, bench=bench, spec_bw=spec_bw, copy_bw=copy_bw)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        return {"device": name, "spec_GBps": spec_bw / 1e9 if spec_bw else None,
                "copy_GBps": copy_bw / 1e9}

    report.check(PART, "memory bandwidth: spec sheet and measured device copy", setup)
    if "mod" not in state:
        return []
    mod, bench = state["mod"], state["bench"]
    shape = mod.MODELS[sel["model"]]
    gemm: list[dict] = []
    perm: list[dict] = []
    for slots in sel["slots"]:
        for rows in sel["rows"]:
            for dist in sel["dists"]:
                def one(slots=slots, rows=rows, dist=dist):
                    g = mod._gemm_rows(sel["model"], shape, slots, rows, dist, torch.bfloat16, device, bench, True)
                    p = mod._permute_rows(sel["model"], shape, slots, rows, dist, torch.bfloat16, device, bench,
                                          state["copy_bw"], True)
                    gemm.extend(g)
                    perm.extend(p)
                    bad = [r for r in g if "error" in r or not r.get("rel_err", math.inf) <= MAX_REL_ERR]
                    if bad:
                        raise AssertionError(f"{len(bad)} GEMM rows disagree with torch._grouped_mm or failed: "
                                             + "; ".join(f"{r['proj']} {r['pass']}: {r.get('error', r.get('rel_err'))}"
                                                         for r in bad))
                    return {"gemm": [{k: r.get(k) for k in ("proj", "pass", "torch_tflops", "ours_tflops", "ratio",
                                                            "rel_err")} for r in g],
                            "permute": [{k: r[k] for k in ("op", "seconds", "bandwidth", "fraction")} for r in p]}
                report.check(PART, f"{sel['model']} S={slots} rows={rows} {dist}: GEMM vs torch._grouped_mm, "
                                   f"permute vs copy", one)
    summary = summarize(gemm, perm, state["copy_bw"], state["spec_bw"])
    targets = {"gemm_ratio": mod.GEMM_TARGET, "bandwidth": mod.BANDWIDTH_TARGET}
    report.check(PART, "summary (figures, not pass/fail)", lambda: summary)
    return highlights(summary, targets)
