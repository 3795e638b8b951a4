"""Where the kernels' time goes on one CUDA GPU: index build, GEMM tile configs, the persistent kernel.

`make gpu-check` gave three findings this script takes apart, side by side in one run:

* **permute_index** (the stable sort by slot) took ~120 us at every size. Timed three ways:
  the Triton kernels eagerly, the torch reference (argsort) eagerly, and both replayed from
  a CUDA graph (the GPU's own time, no launch cost). The gap between eager and replay is
  host launch time.
* **grouped GEMM configs by rows.** The autotune key holds N, K and the slot count, not the
  rows, so the first row count tuned fixes the config for all others. Each autotune config
  is pinned and timed at 4K, 16K and 64K rows (forward and dW): the best config per size
  and what the first size's choice costs the others.
* **the persistent two-phase kernel** (ExpertPlex) against the plain grouped GEMM pinned to
  the same tile, for several tile configs and 1-2 programs per SM, prefill alone (the
  microbenchmark's case: 8,192 rows, 8 experts, [2048 -> 1536], bf16).

    python benchmarks/kernel_configs.py [--json out/kernel_configs.json]
    python benchmarks/kernel_configs.py --cpu-smoke   # tiny shapes in the Triton interpreter

Prints tables and writes JSON. Shape legend: R routed rows, S slots, K reduction dim, N
output columns, D hidden, F expert hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timer(device: torch.device):
    """us per call: ``benchmarks/kernels.py``'s timer (``triton.testing.do_bench`` median on
    CUDA; wall clock off it, where only the path matters)."""
    from relibra_torch.gpu_check.report import load_benchmark

    seconds = load_benchmark("kernels")._timer(device, 10, 40)
    return lambda fn: seconds(fn) * 1e6


def _graph_timer(device: torch.device, bench):
    """Time ``fn`` replayed from a CUDA graph (GPU time without launch cost); None off CUDA."""
    if device.type != "cuda":
        return lambda fn: None

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return bench(g.replay)
    return timed


def index_build(device: torch.device, sizes: list[tuple[int, int, int]]) -> list[dict]:
    """permute_index, Triton vs torch reference, eager and graph-replayed, in us."""
    from relibra_torch.ops import reference as ref
    from relibra_torch.ops import triton_kernels as tk

    bench = _timer(device)
    gbench = _graph_timer(device, bench)
    rows = []
    for T, K, S in sizes:
        g = torch.Generator().manual_seed(T + S)
        slots = torch.randint(0, S, (T, K), generator=g, dtype=torch.int64).to(torch.int32).to(device)
        want = ref.permute_index(slots.cpu(), S)
        got = tk.permute_index(slots, S)
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1]), "permute_index disagrees"
        row = {"T": T, "K": K, "S": S,
               "triton_us": bench(lambda: tk.permute_index(slots, S)),
               "torch_us": bench(lambda: ref.permute_index(slots, S)),
               "triton_graph_us": gbench(lambda: tk.permute_index(slots, S)),
               "torch_graph_us": gbench(lambda: ref.permute_index(slots, S))}
        rows.append(row)
        print(f"permute_index T={T} K={K} S={S}: triton {row['triton_us']:.1f} us, torch {row['torch_us']:.1f} us; "
              f"graph-replayed: triton {row['triton_graph_us']} us, torch {row['torch_graph_us']} us", flush=True)
    return rows


def gemm_configs(device: torch.device, D: int, F: int, S: int, row_counts: list[int], dtype) -> list[dict]:
    """Every autotune config of the forward and the dW kernels, pinned, at each row count."""
    from relibra_torch.gpu_check.kernels import pinned
    from relibra_torch.ops import triton_kernels as tk

    bench = _timer(device)
    g = torch.Generator().manual_seed(0)
    w_SDF = (torch.randn(S, D, F, generator=g) / D ** 0.5).to(dtype).to(device)
    out = []
    for R in row_counts:
        base, extra = divmod(R, S)
        offs = torch.tensor([base + (s < extra) for s in range(S)]).cumsum(0).to(torch.int32).to(device)
        x_RD = torch.randn(R, D, generator=g).to(dtype).to(device)
        dy_RF = torch.randn(R, F, generator=g).to(dtype).to(device)
        passes = [("fwd", tk._grouped_mm_kernel, tk._gemm_configs(), lambda: tk.grouped_mm(x_RD, w_SDF, offs, None),
                   2 * R * D * F),
                  ("dW", tk._grouped_mm_wgrad_kernel, tk._wgrad_configs(),
                   lambda: tk.grouped_mm_wgrad(x_RD, dy_RF, offs, None, S), 2 * R * D * F)]
        for name, kernel, configs, fn, flop in passes:
            for i, cfg in enumerate(configs):
                with pinned(kernel, cfg):
                    us = bench(fn)
                out.append({"R": R, "pass": name, "config": i, "cfg": str(cfg), "us": us,
                            "tflops": flop / (us * 1e-6) / 1e12})
            best = min((r for r in out if r["R"] == R and r["pass"] == name), key=lambda r: r["us"])
            print(f"gemm {name} R={R} S={S} D={D} F={F}: best config {best['config']} ({best['us']:.1f} us, "
                  f"{best['tflops']:.0f} TFLOP/s); config 0 "
                  f"{next(r['us'] for r in out if r['R'] == R and r['pass'] == name and r['config'] == 0):.1f} us",
                  flush=True)
    return out


def _static_kernel():
    """A control: the persistent kernel's tile body in a plain ``for`` over a static share of
    the tiles (no claims, no while loop). If it matches the plain GEMM and the claimed one
    does not, the loop structure costs the time; if it is as slow, the tile body does."""
    import triton
    import triton.language as tl

    @triton.jit
    def static_kernel(x_ptr, w_ptr, y_ptr, tab_ptr, n_tiles, N, K, sxm, sxk, swg, swk, swn, sym, syn,
                      UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid = tl.program_id(0)
        P = tl.num_programs(0)
        for t in range(pid, n_tiles, P):
            entry = tab_ptr + t * 4  # n_tiles * 4 fits int32
            g = tl.load(entry).to(tl.int64)
            r0 = tl.load(entry + 1)
            r1 = tl.load(entry + 2)
            nb = tl.load(entry + 3)
            rm = r0 + tl.arange(0, BM)
            m_mask = rm < r1
            rn = nb * BN + tl.arange(0, BN)
            n_mask = rn < N
            rm64 = rm.to(tl.int64)
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                a = tl.load(x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk, mask=m_mask[:, None], other=0.0)
                b = tl.load(w_ptr + g * swg + rk[:, None] * swk + rn[None, :] * swn, mask=n_mask[None, :],
                            other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc)
            tl.store(y_ptr + rm64[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])

    return static_kernel


PERSISTENT_CONFIGS = [  # (BM, BN, BK, warps, stages)
    (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
]


def persistent(device: torch.device, small: bool) -> list[dict]:
    """The persistent kernel, prefill alone, per tile config and programs per SM, against the
    plain grouped GEMM pinned to the same tile."""
    import triton

    from relibra_torch.gpu_check import expertplex as xp
    from relibra_torch.gpu_check.kernels import pinned
    from relibra_torch.ops import persistent_gemm as pg
    from relibra_torch.ops import triton_kernels as tk

    bench = _timer(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    configs = PERSISTENT_CONFIGS[:1] if small else PERSISTENT_CONFIGS
    out = []
    for bm, bn, bk, w, st in configs:
        shape = (xp.Shape(prefill_rows=64, decode_rows=8, experts=2, dim=64, cols=64, tile_m=32, tile_n=32,
                          tile_k=32, num_warps=4, num_stages=1) if small else
                 xp.Shape(tile_m=bm, tile_n=bn, tile_k=bk, num_warps=w, num_stages=st))
        case = xp.make_case(shape, device, torch.bfloat16)
        n_pre = case["tab_pre"].shape[0]
        x_pre = case["x"][shape.decode_rows:]
        cfg = triton.Config({"BM": shape.tile_m, "BN": shape.tile_n, "BK": shape.tile_k},
                            num_warps=shape.num_warps, num_stages=shape.num_stages)
        with pinned(tk._grouped_mm_kernel, cfg):
            plain_us = bench(lambda: tk.grouped_mm(x_pre, case["w"], case["off_pre"], None))
        static = _static_kernel()
        x, wt, tab = case["x"], case["w"], case["tab_pre"]
        y = torch.empty(x.shape[0], wt.shape[2], dtype=x.dtype, device=device)
        for per_sm in (1, 2):
            programs = max(1, per_sm * (sms - 2))
            # The control block and the output are built once; each call only resets the
            # counters (one device copy), so the time is the kernel's. The H200 runs of
            # 2026-12-04 (docs/gpu/) also timed a fresh control block and a zero-filled output
            # per call.
            ctrl0 = pg.control_words(0, n_pre, device=device)
            ctrl = ctrl0.clone()
            us = bench(lambda: xp.run_persistent(case, shape, programs, ctrl.copy_(ctrl0), y))
            static_us = bench(lambda: static[(programs,)](
                x, wt, y, tab, n_pre, wt.shape[2], x.shape[1], x.stride(0), x.stride(1), wt.stride(0), wt.stride(1),
                wt.stride(2), y.stride(0), y.stride(1), UPCAST=tk.INTERPRET, BM=shape.tile_m, BN=shape.tile_n,
                BK=shape.tile_k, num_warps=shape.num_warps, num_stages=shape.num_stages))
            y.fill_(float("nan"))
            static[(programs,)](x, wt, y, tab, n_pre, wt.shape[2], x.shape[1], x.stride(0), x.stride(1),
                                wt.stride(0), wt.stride(1), wt.stride(2), y.stride(0), y.stride(1),
                                UPCAST=tk.INTERPRET, BM=shape.tile_m, BN=shape.tile_n, BK=shape.tile_k,
                                num_warps=shape.num_warps, num_stages=shape.num_stages)
            nd = shape.decode_rows
            err = xp.rel_err(y[nd:], xp.reference(case)[nd:])
            assert err <= xp.MAX_REL_ERR, f"static control kernel is wrong: relative error {err:.3g}"
            row = {"static_us": static_us, "tile": [shape.tile_m, shape.tile_n, shape.tile_k], "warps": shape.num_warps,
                   "stages": shape.num_stages, "programs": programs, "persistent_us": us, "plain_us": plain_us,
                   "persistent_over_plain": us / plain_us, "prefill_tiles": n_pre,
                   "tile_time_us": us * programs / n_pre}
            out.append(row)
            print(f"persistent tile {row['tile']} w{shape.num_warps} s{shape.num_stages} programs {programs}: "
                  f"{us:.1f} us vs plain {plain_us:.1f} us (x{row['persistent_over_plain']:.2f}), static for-loop "
                  f"{static_us:.1f} us; "
                  f"tile time {row['tile_time_us']:.1f} us", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, default=Path("out/kernel_configs.json"))
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes in the Triton interpreter (no figures)")
    p.add_argument("--parts", nargs="+", default=["persistent", "index", "gemm"],
                   choices=["persistent", "index", "gemm"])
    args = p.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("kernel_configs: needs a CUDA device (or --cpu-smoke)")
        return 0
    else:
        device = torch.device("cuda", 0)
    small = args.cpu_smoke
    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"}
    if "persistent" in args.parts:
        result["persistent"] = persistent(device, small)
    if "index" in args.parts:
        sizes = [(64, 4, 8)] if small else [(T, 8, S) for T in (512, 2048, 8192) for S in (8, 128)]
        result["permute_index"] = index_build(device, sizes)
    if "gemm" in args.parts:
        D, F, S, counts = (32, 16, 4, [64, 256]) if small else (2048, 768, 8, [4096, 16384, 65536])
        result["gemm"] = gemm_configs(device, D, F, S, counts, torch.bfloat16)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
