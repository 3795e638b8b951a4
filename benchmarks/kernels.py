"""Kernel benchmark: relibra_torch.ops Triton kernels against torch on one CUDA GPU.

Grouped GEMM (forward, input gradient dX, weight gradient dW) against ``torch._grouped_mm``
for the expert shapes of Qwen3-30B-A3B (D 2048, F 768) and Qwen3-235B-A22B (D 4096, F 1536):
the gate/up projection (x_RD @ w_GDF) and the down projection (h_RF @ w_GFD), with 8-32 local
slots and 4K-64K routed rows, balanced and skewed group sizes. Permute (index build + row
copy) and unpermute (gather + gated top-k sum) as a fraction of the GPU's memory bandwidth
(spec sheet where the device is known, and a measured device-to-device copy).

Targets on H100/H200: grouped GEMM >= 0.9x ``torch._grouped_mm`` (TFLOP/s ratio), permute and
unpermute >= 70% of the memory bandwidth. Prints a table and writes JSON. Without CUDA it
exits with a message; ``--cpu-smoke`` instead runs tiny shapes of the torch reference path
(no Triton) so that the script itself is exercised in the test suite.

    python benchmarks/kernels.py [--json out/kernels.json] [--models qwen3-30b-a3b]
    python benchmarks/kernels.py --cpu-smoke

Shape legend: T tokens, K top-k, R routed rows (= T*K), D hidden, F expert hidden,
S slots (= weights here), x_RK / w_GKN / y_RN grouped GEMM operands.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

MODELS = {  # expert shapes; sources: the models' config.json on Hugging Face
    "qwen3-30b-a3b": {"D": 2048, "F": 768, "top_k": 8},
    "qwen3-235b-a22b": {"D": 4096, "F": 1536, "top_k": 8},
}
# Peak memory bandwidth, bytes/s, from NVIDIA's data sheets, by model name as words of
# torch.cuda.get_device_name (case-insensitive; "-" and "_" separate words too). A bare model
# name is its SXM part; variants with other memory are their own entries.
SPEC_BANDWIDTH = {
    "H100": 3.35e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12,
    "H200": 4.8e12, "H200 NVL": 4.8e12,
    "H800": 3.35e12, "H20": 4.0e12,
    "A100": 2.039e12, "A100 40GB": 1.555e12, "A100 40GB PCIe": 1.555e12, "A100 80GB PCIe": 1.935e12,
    "B200": 8.0e12,
}
# Words that name another board of the same chip (other memory, other clocks): a device name
# with one of them matches only an entry that names it too.
_BOARD_WORDS = {"pcie", "nvl"}


def _words(text: str) -> set[str]:
    return set(text.lower().replace("-", " ").replace("_", " ").split())


def spec_bandwidth(device_name: str) -> float | None:
    """Spec-sheet peak bandwidth (bytes/s) of a GPU by its name, or None if not known.

    Entries match by whole words, never substrings ("H20" is not in "NVIDIA H200"); of the
    entries whose words all occur in the name, the one with the most words wins (the most
    specific board). A board word in the name (PCIe, NVL) that the winning entry does not
    name makes the board unknown (e.g. an H800 PCIe): better the measured copy than a wrong
    spec.
    """
    words = _words(device_name)
    matches = [key for key in SPEC_BANDWIDTH if _words(key) <= words]
    if not matches:
        return None
    best = max(matches, key=lambda key: len(_words(key)))
    if (words & _BOARD_WORDS) - _words(best):
        return None
    return SPEC_BANDWIDTH[best]
GEMM_TARGET = 0.9
BANDWIDTH_TARGET = 0.7


def group_sizes(rows: int, slots: int, dist: str, seed: int = 0) -> list[int]:
    """Row count per slot summing to ``rows``: equal split, or Zipf-like with empty slots."""
    if dist == "balanced":
        base, extra = divmod(rows, slots)
        return [base + (1 if s < extra else 0) for s in range(slots)]
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, slots + 1, dtype=torch.float64) ** 1.2
    weights[torch.randperm(slots, generator=g)[: max(1, slots // 8)]] = 0.0  # some empty slots
    weights = weights[torch.randperm(slots, generator=g)]
    sizes = torch.floor(weights / weights.sum() * rows).to(torch.int64)
    sizes[int(torch.argmax(weights))] += rows - int(sizes.sum())
    return [int(v) for v in sizes]


def _timer(device: torch.device, warmup: int, iters: int):
    if device.type == "cuda":
        import triton.testing

        def bench(fn) -> float:
            return float(triton.testing.do_bench(fn, warmup=warmup, rep=iters, return_mode="median")) * 1e-3
    else:
        def bench(fn) -> float:
            fn()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return sorted(times)[1]
    return bench


def _device_bandwidth(device: torch.device, bench) -> tuple[float | None, float]:
    """(spec-sheet bandwidth or None, measured copy bandwidth) in bytes/s."""
    spec = None
    if device.type == "cuda":
        spec = spec_bandwidth(torch.cuda.get_device_name(device))
    n = (1 << 28) if device.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src))
    return spec, 2 * n / seconds


def _torch_grouped_mm_fn(a, b, offs):
    """A call of torch._grouped_mm on (a, b), with b re-laid out once (outside the timed call)
    if the given layout is refused. Returns (fn, layout note)."""
    try:
        torch._grouped_mm(a, b, offs=offs)
        return (lambda: torch._grouped_mm(a, b, offs=offs)), "as given"
    except RuntimeError:
        other = b.contiguous() if b.stride(-1) != 1 else b.transpose(-2, -1).contiguous().transpose(-2, -1)
        if a.dim() == 2 and b.dim() == 2 and a.stride(-1) != 1:
            a = a.contiguous()
        torch._grouped_mm(a, other, offs=offs)
        return (lambda: torch._grouped_mm(a, other, offs=offs)), "re-laid out"


def _gemm_rows(model: str, shape: dict, slots: int, rows: int, dist: str, dtype, device, bench,
               use_triton: bool) -> list[dict]:
    from relibra_torch.ops import reference

    kern = None
    if use_triton:
        from relibra_torch.ops import triton_kernels as kern
    sizes = group_sizes(rows, slots, dist)
    offs = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    D, F = shape["D"], shape["F"]
    out = []
    for proj, (K, N) in (("gate/up", (D, F)), ("down", (F, D))):
        x = torch.randn(rows, K, device=device, dtype=dtype)
        w = torch.randn(slots, K, N, device=device, dtype=dtype) / math.sqrt(K)
        dy = torch.randn(rows, N, device=device, dtype=dtype)
        flops = 2.0 * rows * K * N
        passes = {
            "fwd": ((x, w),
                    (lambda: kern.grouped_mm(x, w, offs, None)) if kern else
                    (lambda: reference.grouped_mm(x, w, offs, None))),
            # both sides get the same operand: the transposed view autograd hands to backward
            "dX": ((dy, w.transpose(-2, -1)),
                   (lambda: kern.grouped_mm(dy, w.transpose(1, 2), offs, None)) if kern else
                   (lambda: reference.grouped_mm(dy, w.transpose(1, 2), offs, None))),
            "dW": ((x.t(), dy),
                   (lambda: kern.grouped_mm_wgrad(x, dy, offs, None, slots)) if kern else
                   (lambda: reference.grouped_mm_wgrad(x, dy, offs, None, slots))),
        }
        for name, ((a, b), ours_fn) in passes.items():
            row = {"model": model, "proj": proj, "pass": name, "slots": slots, "rows": rows, "dist": dist,
                   "K": K, "N": N, "impl": "triton" if kern else "torch-reference"}
            try:
                torch_fn, layout = _torch_grouped_mm_fn(a, b, offs)
                want = torch_fn()
                got = ours_fn()
                err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))
                t_torch = bench(torch_fn)
                t_ours = bench(ours_fn)
                row.update(rel_err=err, torch_layout=layout, torch_tflops=flops / t_torch / 1e12,
                           ours_tflops=flops / t_ours / 1e12, ratio=t_torch / t_ours)
            except RuntimeError as e:  # keep going: one unsupported layout must not hide the rest
                row.update(error=str(e).splitlines()[0])
            out.append(row)
    return out


def _permute_rows(model: str, shape: dict, slots: int, rows: int, dist: str, dtype, device, bench,
                  bandwidth: float, use_triton: bool) -> list[dict]:
    from relibra_torch.ops import reference

    kern = None
    if use_triton:
        from relibra_torch.ops import triton_kernels as kern
    impl = kern if kern else reference
    K, D = shape["top_k"], shape["D"]
    T = rows // K
    sizes = group_sizes(T * K, slots, dist)
    slot_of_row = torch.repeat_interleave(torch.arange(slots), torch.tensor(sizes))
    g = torch.Generator().manual_seed(1)
    slots_TK = slot_of_row[torch.randperm(T * K, generator=g)].view(T, K).to(device)
    x = torch.randn(T, D, device=device, dtype=dtype)
    gates = torch.rand(T, K, device=device, dtype=torch.float32)
    row_of, _ = impl.permute_index(slots_TK, slots)
    y = impl.permute_rows(x, row_of)
    e = x.element_size()
    idx_bytes = T * K * 8 * 2  # read slot ids, write row_of
    cases = {
        "permute_index": (lambda: impl.permute_index(slots_TK, slots), idx_bytes),
        "permute_rows": (lambda: impl.permute_rows(x, row_of), T * D * e + T * K * D * e + T * K * 8),
        "permute": (lambda: impl.permute_rows(x, impl.permute_index(slots_TK, slots)[0]),
                    T * D * e + T * K * D * e + idx_bytes),
        "unpermute": (lambda: impl.unpermute(y, row_of, gates), T * K * D * e + T * D * e + T * K * 12),
    }
    out = []
    for name, (fn, nbytes) in cases.items():
        seconds = bench(fn)
        out.append({"model": model, "op": name, "slots": slots, "rows": T * K, "dist": dist, "D": D,
                    "impl": "triton" if kern else "torch-reference", "seconds": seconds,
                    "bytes": nbytes, "bandwidth": nbytes / seconds, "fraction": nbytes / seconds / bandwidth})
    return out


def _print_tables(gemm: list[dict], perm: list[dict], bw_name: str, smoke: bool) -> None:
    if smoke:
        print("\n(cpu smoke: torch reference path on tiny shapes; the GPU targets do not apply)")
    print(f"\ngrouped GEMM: TFLOP/s, ours / torch._grouped_mm (target >= {GEMM_TARGET}x)")
    print(f"{'model':16} {'proj':8} {'pass':4} {'S':>3} {'rows':>6} {'dist':9} {'torch':>8} {'ours':>8} "
          f"{'ratio':>6} {'rel_err':>8}")
    for r in gemm:
        if "error" in r:
            print(f"{r['model']:16} {r['proj']:8} {r['pass']:4} {r['slots']:3} {r['rows']:6} {r['dist']:9} "
                  f"error: {r['error']}")
            continue
        flag = "" if smoke or r["ratio"] >= GEMM_TARGET else "  < target"
        print(f"{r['model']:16} {r['proj']:8} {r['pass']:4} {r['slots']:3} {r['rows']:6} {r['dist']:9} "
              f"{r['torch_tflops']:8.1f} {r['ours_tflops']:8.1f} {r['ratio']:6.2f} {r['rel_err']:8.1e}{flag}")
    print(f"\npermute / unpermute: achieved bandwidth as a fraction of {bw_name} (target >= {BANDWIDTH_TARGET})")
    print(f"{'model':16} {'op':14} {'S':>3} {'rows':>6} {'dist':9} {'us':>9} {'GB/s':>8} {'frac':>6}")
    for r in perm:
        flag = "" if smoke or r["op"] == "permute_index" or r["fraction"] >= BANDWIDTH_TARGET else "  < target"
        print(f"{r['model']:16} {r['op']:14} {r['slots']:3} {r['rows']:6} {r['dist']:9} {r['seconds'] * 1e6:9.1f} "
              f"{r['bandwidth'] / 1e9:8.1f} {r['fraction']:6.2f}{flag}")


def _summary(gemm: list[dict], perm: list[dict]) -> dict:
    ratios = [r["ratio"] for r in gemm if "ratio" in r]
    fr = {op: [r["fraction"] for r in perm if r["op"] == op] for op in ("permute", "unpermute")}
    return {
        "gemm_ratio_min": min(ratios) if ratios else None,
        "gemm_ratio_geomean": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
        "gemm_errors": sum(1 for r in gemm if "error" in r),
        "permute_fraction_min": min(fr["permute"]) if fr["permute"] else None,
        "unpermute_fraction_min": min(fr["unpermute"]) if fr["unpermute"] else None,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--slots", nargs="+", type=int, default=[8, 16, 32])
    parser.add_argument("--rows", nargs="+", type=int, default=[4096, 16384, 65536], help="routed rows (T*K)")
    parser.add_argument("--dists", nargs="+", default=["balanced", "skewed"], choices=["balanced", "skewed"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--warmup", type=int, default=25, help="ms of warm-up per timing (CUDA)")
    parser.add_argument("--iters", type=int, default=100, help="ms of timed repeats per timing (CUDA)")
    parser.add_argument("--json", type=Path, default=Path("out/kernels.json"))
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no CUDA: run tiny shapes of the torch reference path only")
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        models = {"tiny": {"D": 64, "F": 32, "top_k": 2}}
        slots_list, rows_list = [4], [128]
        use_triton = False
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                     "use --cpu-smoke to exercise the torch reference path on tiny CPU shapes")
        device = torch.device("cuda")
        models = {m: MODELS[m] for m in args.models}
        slots_list, rows_list = args.slots, args.rows
        use_triton = True
    dtype = getattr(torch, args.dtype)
    bench = _timer(device, args.warmup, args.iters)
    spec_bw, copy_bw = _device_bandwidth(device, bench)
    bandwidth, bw_name = (spec_bw, "spec-sheet bandwidth") if spec_bw else (copy_bw, "measured copy bandwidth")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    spec_text = f"spec {spec_bw / 1e9:.0f} GB/s, " if spec_bw else "spec unknown, "
    print(f"device: {name}; bandwidth: {spec_text}measured copy {copy_bw / 1e9:.1f} GB/s")

    gemm, perm = [], []
    for model, shape in models.items():
        for slots in slots_list:
            for rows in rows_list:
                for dist in args.dists:
                    gemm += _gemm_rows(model, shape, slots, rows, dist, dtype, device, bench, use_triton)
                    perm += _permute_rows(model, shape, slots, rows, dist, dtype, device, bench, bandwidth,
                                          use_triton)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
    _print_tables(gemm, perm, bw_name, args.cpu_smoke)
    result = {
        "device": name, "dtype": args.dtype, "cpu_smoke": args.cpu_smoke,
        "bandwidth": {"spec": spec_bw, "measured_copy": copy_bw, "used": bw_name},
        "targets": {"gemm_ratio": GEMM_TARGET, "bandwidth_fraction": BANDWIDTH_TARGET},
        "summary": _summary(gemm, perm), "grouped_gemm": gemm, "permute": perm,
    }
    print("\nsummary:", json.dumps(result["summary"]))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
