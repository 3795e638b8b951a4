"""ExpertPlex's kernel microbenchmark: a decode injected into a running prefill, three ways.

The case (ExpertPlex, arXiv 2607.18002, its kernel microbenchmark): a prefill of 8,192 rows
and a decode of 128 rows over 8 active experts (balanced: 1,024 and 16 rows each), one
grouped GEMM ``[rows, 2048] @ [8, 2048, 1536]`` in bf16 (Qwen3-30B-A3B's gate+up
projection). The decode is injected 10 us (host clock) after the prefill launch:

* ``plain``: two launches of the existing grouped GEMM (``relibra_torch.ops``), the decode on
  a second stream of the same priority;
* ``priority``: the same with the decode on a high-priority stream;
* ``persistent``: one launch of the persistent two-phase kernel
  (:mod:`relibra_torch.ops.persistent_gemm`) with the prefill table published and the decode
  table written but unpublished; the injection is a one-program kernel on a high-priority
  stream raising the decode count, and a second one waits until the decode tiles are done.

Figures (median of the repetitions, CUDA events): decode latency from its injection to its
completion against the decode alone (the paper: +8% under its kernel, 13.79x slower with
priority streams), prefill time against the prefill alone (the paper: 1.12x slower), and
the **tile time** (the persistent prefill alone x programs / prefill tiles), written to
``gpu_check.json`` under ``expertplex.tile_time_us`` for the serving model's override.
Timings are figures; a check fails only on wrong outputs or a decode that was never served.
Without CUDA the measuring check is skipped with a reason; the case, the output check and
the summary run anywhere (tests run them in the interpreter on tiny shapes).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from relibra_torch.gpu_check.report import Report, Skip

PART = "expertplex"
KEY = "expertplex"  # top-level key of gpu_check.json; the tile time is KEY.tile_time_us
MAX_REL_ERR = 2e-2  # bf16 outputs of fp32-accumulating GEMMs (as the bench part)


@dataclass(frozen=True)
class Shape:
    """The microbenchmark's sizes and tile config (defaults: the paper's case)."""

    prefill_rows: int = 8192
    decode_rows: int = 128
    experts: int = 8
    dim: int = 2048
    cols: int = 1536
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    inject_us: float = 10.0
    reps: int = 20


def make_case(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """Operands, per-phase offsets and tile tables: decode rows first, then prefill rows."""
    from relibra_torch.ops import persistent_gemm as pg

    g = torch.Generator().manual_seed(seed)
    E = shape.experts
    dec_E = torch.full((E,), shape.decode_rows // E, dtype=torch.int64)
    dec_E[: shape.decode_rows % E] += 1
    pre_E = torch.full((E,), shape.prefill_rows // E, dtype=torch.int64)
    pre_E[: shape.prefill_rows % E] += 1
    R = shape.decode_rows + shape.prefill_rows
    x = (torch.randn(R, shape.dim, generator=g) * 0.5).to(dtype).to(device)
    w = (torch.randn(E, shape.dim, shape.cols, generator=g) / shape.dim ** 0.5).to(dtype).to(device)
    kw = dict(tile_m=shape.tile_m, n_cols=shape.cols, tile_n=shape.tile_n)
    return {"x": x, "w": w, "dec_E": dec_E, "pre_E": pre_E,
            "off_dec": dec_E.cumsum(0).to(torch.int32).to(device),
            "off_pre": pre_E.cumsum(0).to(torch.int32).to(device),
            "tab_dec": pg.tile_table(dec_E, **kw).to(device),
            "tab_pre": pg.tile_table(pre_E, row_base=shape.decode_rows, **kw).to(device)}


def reference(case: dict[str, Any]) -> torch.Tensor:
    """fp32 ``y_RN`` of both phases by per-expert matmuls (the check's reference)."""
    x, w = case["x"].float(), case["w"].float()
    y = torch.empty(x.shape[0], w.shape[2], device=x.device)
    start = 0
    for rows in (case["dec_E"], case["pre_E"]):
        for e, r in enumerate(rows.tolist()):
            y[start:start + r] = x[start:start + r] @ w[e]
            start += r
    return y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_persistent(case: dict[str, Any], shape: Shape, programs: int, control=None, y=None) -> torch.Tensor:
    """One persistent launch over both tables (published per ``control``, default: both)."""
    from relibra_torch.ops import persistent_gemm as pg
    from relibra_torch.serving.runtime.share import decode_programs

    share = decode_programs(programs, case["tab_dec"].shape[0], case["tab_pre"].shape[0])
    return pg.two_phase_grouped_mm(case["x"], case["w"], case["tab_dec"], case["tab_pre"], tile_m=shape.tile_m,
                                   tile_n=shape.tile_n, tile_k=shape.tile_k, programs=programs,
                                   decode_programs=share, control=control, y_RN=y, max_idle_polls=1 << 18,
                                   num_warps=shape.num_warps, num_stages=shape.num_stages)


def summarize(t: dict[str, list[float]], n_prefill_tiles: int, programs: int) -> dict[str, Any]:
    """Figures from per-repetition times in ms (keys as :func:`_measure` writes them)."""
    med = {k: statistics.median(v) for k, v in t.items() if v}
    out: dict[str, Any] = {"median_ms": med, "programs": programs, "prefill_tiles": n_prefill_tiles}
    out["tile_time_us"] = med["persistent_prefill_alone"] * 1e3 * programs / max(n_prefill_tiles, 1)
    for way in ("plain", "priority", "persistent"):
        out[way] = {"decode_latency_over_alone": med[f"{way}_decode"] / med["plain_decode_alone"],
                    "prefill_time_over_alone": med[f"{way}_prefill"] / med["plain_prefill_alone"]}
    return out


def highlights(s: dict[str, Any]) -> list[str]:
    ways = "; ".join(f"{w}: decode x{s[w]['decode_latency_over_alone']:.2f}, prefill x{s[w]['prefill_time_over_alone']:.2f}"
                     for w in ("plain", "priority", "persistent"))
    return [f"ExpertPlex microbenchmark (decode 128 injected 10 us into prefill 8192, 8 experts): {ways} "
            f"(paper: decode +8%, prefill x1.12); tile time {s['tile_time_us']:.2f} us over {s['programs']} programs"]


def _spin_us(us: float) -> None:
    t0 = time.perf_counter()
    while (time.perf_counter() - t0) * 1e6 < us:
        pass


def _measure(case: dict[str, Any], shape: Shape, device: torch.device) -> tuple[dict[str, list[float]], dict]:
    import relibra_torch.ops as ops
    from relibra_torch.ops import persistent_gemm as pg

    # Two SMs are left to the one-program publish / wait kernels: if the persistent programs
    # filled every SM, the publisher could not start until they left.
    programs = max(1, torch.cuda.get_device_properties(device).multi_processor_count - 2)
    x, w = case["x"], case["w"]
    nd = shape.decode_rows
    x_dec, x_pre = x[:nd], x[nd:]
    n_dec, n_pre = case["tab_dec"].shape[0], case["tab_pre"].shape[0]
    lo, same, hi = torch.cuda.Stream(device), torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1)
    t: dict[str, list[float]] = {}

    def ev():
        return torch.cuda.Event(enable_timing=True)

    def timed(name, stream, fn):
        a, b = ev(), ev()
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        return name, a, b

    for _ in range(3):  # warm-up: autotuning of the plain kernel, compilation of the persistent one
        ops.grouped_gemm(x_pre, w, case["off_pre"])
        ops.grouped_gemm(x_dec, w, case["off_dec"])
        run_persistent(case, shape, programs)
    torch.cuda.synchronize()
    y_mixed = None
    ctrl_last = None
    for _ in range(shape.reps):
        pairs = [timed("plain_prefill_alone", lo, lambda: ops.grouped_gemm(x_pre, w, case["off_pre"]))]
        pairs.append(timed("plain_decode_alone", lo, lambda: ops.grouped_gemm(x_dec, w, case["off_dec"])))
        pre_only = pg.control_words(0, n_pre, device=device)
        pairs.append(timed("persistent_prefill_alone", lo, lambda: run_persistent(case, shape, programs, pre_only)))
        torch.cuda.synchronize()
        for way, s2 in (("plain", same), ("priority", hi)):
            pairs.append(timed(f"{way}_prefill", lo, lambda: ops.grouped_gemm(x_pre, w, case["off_pre"])))
            _spin_us(shape.inject_us)
            pairs.append(timed(f"{way}_decode", s2, lambda: ops.grouped_gemm(x_dec, w, case["off_dec"])))
            torch.cuda.synchronize()
        ctrl = pg.control_words(0, n_pre, closed=False, device=device)
        y_mixed = torch.full((x.shape[0], w.shape[2]), float("nan"), dtype=x.dtype, device=device)
        pairs.append(timed("persistent_prefill", lo, lambda: run_persistent(case, shape, programs, ctrl, y_mixed)))
        _spin_us(shape.inject_us)
        pairs.append(timed("persistent_decode", hi, lambda: (pg.publish(ctrl, pg.DECODE, n_dec, close=True),
                                                             pg.wait_done(ctrl, pg.DECODE, n_dec, 1 << 24))))
        torch.cuda.synchronize()
        ctrl_last = ctrl.tolist()
        for name, a, b in pairs:
            t.setdefault(name, []).append(a.elapsed_time(b))
    done = {"control": ctrl_last, "programs": programs, "n_decode_tiles": n_dec, "n_prefill_tiles": n_pre}
    if ctrl_last[5] != n_dec or ctrl_last[6] != n_pre or ctrl_last[7]:
        raise AssertionError(f"persistent run did not serve every tile: control {ctrl_last} (want done_dec={n_dec}, "
                             f"done_pre={n_pre}, idle_exits=0): the decode publication was not seen in time")
    err = rel_err(y_mixed, reference(case))
    if not err <= MAX_REL_ERR:
        raise AssertionError(f"persistent mixed run: relative error {err:.3g} > {MAX_REL_ERR} against fp32 matmuls")
    done["rel_err_mixed"] = err
    return t, done


def run(report: Report, device: torch.device, shape: Shape | None = None) -> list[str]:
    """Record the microbenchmark (CUDA only; skipped elsewhere); returns its highlight lines and
    puts the figures under ``report.keys[KEY]``."""
    shape = shape or Shape()
    state: dict[str, Any] = {}

    def measure():
        if device.type != "cuda" or not torch.cuda.is_available():
            raise Skip(f"needs a CUDA device (got {device}); the kernel's numerics are covered by "
                       f"tests/test_expertplex_kernel.py in the interpreter")
        case = make_case(shape, device, torch.bfloat16)
        t, done = _measure(case, shape, device)
        s = summarize(t, done["n_prefill_tiles"], done["programs"])
        s.update(done)
        state["summary"] = s
        return s

    report.check(PART, "decode injected into a prefill: plain / priority streams / persistent two-phase", measure)
    if "summary" not in state:
        return []
    s = state["summary"]
    report.keys[KEY] = {"tile_time_us": s["tile_time_us"], "tile": [shape.tile_m, shape.tile_n, shape.tile_k],
                        "dim": shape.dim,  # a tile's K: what serving.runtime.calibration turns into a rate
                        "programs": s["programs"], **{w: s[w] for w in ("plain", "priority", "persistent")}}
    return highlights(s)
