"""Compile every Triton kernel ahead of time for a CUDA architecture, without a GPU.

``python -m relibra_torch.ops.aot [--arch 90] [--all-configs]`` runs Triton's frontend and
backend (down to a cubin with the ptxas bundled in the triton wheel) on each kernel with the
argument specialisations the JIT would see for the Qwen3 expert shapes (16-byte aligned
pointers, unit inner strides, other strides and K, N multiples of 16). It prints, per
kernel, the shared memory and whether the K loop of the GEMMs was software-pipelined
(asynchronous global->shared copies), and exits non-zero on any failure.

This catches what the interpreter cannot: code that the interpreter runs but the compiler
rejects, and GEMM loops that compile without a pipeline. It must run in a process without
``TRITON_INTERPRET=1`` (``triton.jit`` picks the interpreter at decoration time).
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def compile_kernel(kernel, label: str, types: dict, consts: dict, aligned: list, arch: int = 90,
                   num_warps: int = 4, num_stages: int = 3, gemm: bool = False, uniform: bool = False) -> dict:
    """Compile one kernel for ``sm_<arch>``; the row printed and checked (``ok``, ``error``).

    ``gemm``: record whether its K loop was software-pipelined. ``uniform``: the kernel
    branches on control words, which it must read by scalar atomics (Triton runs those in
    one thread and broadcasts the value through shared memory behind a barrier); a volatile
    load is per thread, a branch on it can split the program at that barrier (it did, with an
    illegal instruction on an H200), so one fails the row.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    fn = kernel
    while not isinstance(fn, triton.runtime.jit.JITFunction):
        fn = fn.fn  # through autotune / heuristics wrappers
    names = fn.arg_names
    signature = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    t0 = time.perf_counter()
    row = {"kernel": fn.__name__, "variant": label}
    try:
        out = triton.compile(triton.compiler.ASTSource(fn, signature, consts, attrs),
                             target=GPUTarget("cuda", arch, 32),
                             options={"num_warps": num_warps, "num_stages": num_stages})
        ttgir = out.asm["ttgir"]
        row.update(ok=True, shared=out.metadata.shared, seconds=time.perf_counter() - t0,
                   pipelined=("async_copy_global_to_local" in ttgir or "async_tma_copy" in ttgir
                              or "descriptor_load" in ttgir) if gemm else None)
        if uniform and "isVolatile = true" in ttgir:
            row.update(ok=False, error="branches on a control word read by a volatile load; read it with an atomic")
    except Exception as e:  # report every kernel, fail at the end
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return row


def _compile_all(arch: int, all_configs: bool) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("relibra_torch.ops.aot needs TRITON_INTERPRET unset (the kernels would be "
                           "interpreter functions)")
    from relibra_torch.ops import triton_kernels as tk

    results = []

    def compile_one(kernel, label, types, consts, aligned, num_warps=4, num_stages=3, gemm=False, uniform=False):
        row = compile_kernel(kernel, label, types, consts, aligned, arch, num_warps, num_stages, gemm, uniform)
        results.append(row)
        status = "ok" if row["ok"] else f"FAILED {row['error']}"
        extra = "" if row.get("pipelined") is None else f" pipelined={row['pipelined']}"
        shared = f" shared={row['shared']}" if row["ok"] else ""
        print(f"{row['kernel']:28} {label:34} {status}{shared}{extra}", flush=True)

    compile_one(tk._slot_histogram_kernel, "S<=64", {"slot_ptr": "*i64", "counts_SB_ptr": "*i32"},
                {"BLOCK": tk.PERMUTE_BLOCK, "S_PAD": 64}, ["slot_ptr", "counts_SB_ptr"])
    compile_one(tk._slot_scan_kernel, "", {"counts_SB_ptr": "*i32", "totals_ptr": "*i32"},
                {"CHUNK": tk.SCAN_CHUNK}, ["counts_SB_ptr", "totals_ptr"])
    compile_one(tk._slot_scatter_kernel, "S<=64", {"slot_ptr": "*i64", "base_SB_ptr": "*i32", "totals_ptr": "*i32",
                                                   "offsets_ptr": "*i32", "row_of_ptr": "*i64"},
                {"BLOCK": tk.PERMUTE_BLOCK, "S_PAD": 64},
                ["slot_ptr", "base_SB_ptr", "totals_ptr", "offsets_ptr", "row_of_ptr"])
    bt, k_pad, bd = tk._row_tiles(8, 4096)
    tiles = {"BT": bt, "K_PAD": k_pad, "BD": bd}
    compile_one(tk._permute_rows_kernel, "bf16 K=8", {"x_ptr": "*bf16", "row_of_ptr": "*i64", "out_ptr": "*bf16"},
                {**tiles, "sxd": 1, "sod": 1}, ["x_ptr", "row_of_ptr", "out_ptr", "D", "sxt", "sor"])
    compile_one(tk._unpermute_kernel, "bf16 K=8",
                {"y_ptr": "*bf16", "row_of_ptr": "*i64", "gates_ptr": "*fp32", "out_ptr": "*bf16"},
                {**tiles, "HAS_GATES": True, "FIX_BF16": False, "syd": 1, "sod": 1},
                ["y_ptr", "row_of_ptr", "gates_ptr", "out_ptr", "D", "syr", "sot"])
    compile_one(tk._unpermute_bwd_kernel, "bf16 K=8",
                {"dout_ptr": "*bf16", "y_ptr": "*bf16", "row_of_ptr": "*i64", "gates_ptr": "*fp32",
                 "dy_ptr": "*bf16", "dgates_ptr": "*fp32"},
                {**tiles, "FIX_BF16": False, "sdd": 1, "syd": 1, "sdyd": 1},
                ["dout_ptr", "y_ptr", "row_of_ptr", "gates_ptr", "dy_ptr", "dgates_ptr", "D", "sdt", "syr", "sdyr"])

    gemm_cfgs = tk._gemm_configs() if all_configs else tk._gemm_configs()[:1]
    wgrad_cfgs = tk._wgrad_configs() if all_configs else tk._wgrad_configs()[:1]
    for dt in ("bf16", "fp16", "fp32"):
        if dt != "bf16" and not all_configs:
            cfgs_g, cfgs_w = gemm_cfgs[:1], wgrad_cfgs[:1]
        else:
            cfgs_g, cfgs_w = gemm_cfgs, wgrad_cfgs
        types = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "y_ptr": f"*{dt}", "offs_ptr": "*i32", "s2w_ptr": "*i64"}
        base = {"HAS_S2W": True, "S_PAD": 32, "UPCAST": False, "IEEE": dt == "fp32", "FIX_BF16": False,
                "EVEN_K": True}
        for cfg in cfgs_g:
            tag = f"{dt} {cfg.kwargs['BM']}x{cfg.kwargs['BN']}x{cfg.kwargs['BK']} w{cfg.num_warps}s{cfg.num_stages}"
            # forward: w row-major [G, K, N]; dX: w is a transposed view (unit stride along K)
            compile_one(tk._grouped_mm_kernel, "fwd " + tag, types,
                        {**base, **cfg.kwargs, "TRANS_W": False, "sxk": 1, "swn": 1, "syn": 1},
                        ["x_ptr", "w_ptr", "y_ptr", "offs_ptr", "s2w_ptr", "N", "K", "sxm", "swg", "swk", "sym"],
                        cfg.num_warps, cfg.num_stages, gemm=True)
            compile_one(tk._grouped_mm_kernel, "dX " + tag, types,
                        {**base, **cfg.kwargs, "TRANS_W": True, "sxk": 1, "swk": 1, "syn": 1},
                        ["x_ptr", "w_ptr", "y_ptr", "offs_ptr", "s2w_ptr", "N", "K", "sxm", "swg", "swn", "sym"],
                        cfg.num_warps, cfg.num_stages, gemm=True)
        wtypes = {"x_ptr": f"*{dt}", "dy_ptr": f"*{dt}", "dw_ptr": f"*{dt}", "offs_ptr": "*i32", "s2w_ptr": "*i64"}
        for cfg in cfgs_w:
            tag = f"{dt} {cfg.kwargs['BM']}x{cfg.kwargs['BN']}x{cfg.kwargs['BK']} w{cfg.num_warps}s{cfg.num_stages}"
            compile_one(tk._grouped_mm_wgrad_kernel, "dW " + tag, wtypes,
                        {"HAS_S2W": True, "UPCAST": False, "IEEE": dt == "fp32", "FIX_BF16": False,
                         **cfg.kwargs, "sxk": 1, "sdn": 1, "swn": 1},
                        ["x_ptr", "dy_ptr", "dw_ptr", "offs_ptr", "s2w_ptr", "K", "N", "sxm", "sdm", "swg", "swk"],
                        cfg.num_warps, cfg.num_stages, gemm=True)
    # ExpertPlex's persistent two-phase grouped GEMM (plain and SwiGLU-gated) and its
    # publish / wait kernels (relibra_torch.ops.persistent_gemm)
    from relibra_torch.ops import persistent_gemm as pg

    for dt in ("bf16", "fp32") if all_configs else ("bf16",):
        ptypes = {"x_ptr": f"*{dt}", "w1_ptr": f"*{dt}", "w3_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                  "tab_ptr": "*i32", "ctrl_ptr": "*i32"}
        for gated in (False, True):
            compile_one(pg._two_phase_kernel, f"{'gated' if gated else 'plain'} {dt} 128x128x64 w8s3", ptypes,
                        {"GATED": gated, "UPCAST": False, "IEEE": dt == "fp32", "FIX_BF16": False,
                         "BM": 128, "BN": 128, "BK": 64, "sxk": 1, "swn": 1, "syn": 1},
                        ["x_ptr", "w1_ptr", "w3_ptr", "y_ptr", "tab_ptr", "ctrl_ptr", "N", "K", "sxm", "swg",
                         "swk", "sym"], 8, 3, gemm=True, uniform=True)
    compile_one(pg._publish_kernel, "", {"ctrl_ptr": "*i32"}, {}, ["ctrl_ptr"], 1, 1)
    compile_one(pg._wait_done_kernel, "", {"ctrl_ptr": "*i32"}, {}, ["ctrl_ptr"], 1, 1, uniform=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    parser.add_argument("--all-configs", action="store_true", help="every autotune config and dtype")
    args = parser.parse_args(argv)
    results = _compile_all(args.arch, args.all_configs)
    failed = [r for r in results if not r["ok"]]
    unpipelined = [r for r in results if r.get("pipelined") is False]
    print(f"{len(results)} kernels compiled for sm_{args.arch}: {len(failed)} failed, "
          f"{len(unpipelined)} GEMM loops not pipelined")
    return 1 if failed or unpipelined else 0


if __name__ == "__main__":
    sys.exit(main())
