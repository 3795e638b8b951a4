"""Compiled Triton kernels against float64 references on the GPU.

Every case draws fresh random inputs on the device, runs the public ops (backend
``triton``, so the custom ops and their autograd are exercised too) with NaN-poisoned
output allocation (:func:`reference.poisoned_outputs`), and compares with the fp64
reference of :mod:`relibra_torch.gpu_check.reference` under the oracle's error rule. The
index kernels are compared exactly with the torch reference. One tile config per kernel
is pinned for these cases (the first autotune config, so the run compiles a bounded set
of kernels); ``full`` mode then pins every autotune config once.

Shape legend: T tokens, K top-k, R sorted rows, D hidden, F expert hidden, S slots,
G weights; grouped GEMM operands x_RK / w_GKN / y_RN (K reduction dim, N output dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from relibra_torch.gpu_check import reference as ref
from relibra_torch.gpu_check.report import Report, Skip

PART = "kernels"
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
BEYOND_INT32_BYTES = 40 * 2**30  # peak of the > 2^31-element case (operands + fp64 references)


def _kernels():
    from relibra_torch.ops import triton_kernels as tk

    return tk


@contextlib.contextmanager
def pinned(kernel, config) -> Iterator[None]:
    """Run ``kernel`` (an autotuned or a fixed-config Triton kernel) with ``config`` only."""
    if hasattr(kernel, "configs"):  # triton.runtime.autotuner.Autotuner: one config skips tuning
        saved = kernel.configs
        kernel.configs = [config]
        try:
            yield
        finally:
            kernel.configs = saved
    else:
        saved = kernel._relibra_fixed_config
        kernel._relibra_fixed_config = config
        try:
            yield
        finally:
            kernel._relibra_fixed_config = saved


@contextlib.contextmanager
def first_configs() -> Iterator[None]:
    """Pin the GEMM kernels to their first config, and poison outputs, for the correctness
    cases (one config: each new shape compiles once instead of autotuning)."""
    tk = _kernels()
    with pinned(tk._grouped_mm_kernel, tk._gemm_configs()[0]), \
            pinned(tk._grouped_mm_wgrad_kernel, tk._wgrad_configs()[0]), ref.poisoned_outputs():
        yield


def grouped_case(sizes: list[int], s2w: list[int] | None, G: int, Kd: int, N: int, tail: int,
                 dtype: torch.dtype, gen: torch.Generator, device, w_transposed: bool = False) -> dict:
    """``ops.grouped_gemm`` forward and autograd backward (dX, dW) against fp64: max err ratios."""
    import relibra_torch.ops as ops

    R = sum(sizes) + tail
    offs = ref.offsets_of(sizes, device)
    s2w_t = None if s2w is None else torch.tensor(s2w, device=device)
    x = ref.randn((R, Kd), dtype, device, gen).requires_grad_()
    w_shape = (G, N, Kd) if w_transposed else (G, Kd, N)
    w = ref.randn(w_shape, dtype, device, gen, Kd ** -0.5)
    w = (w.transpose(1, 2) if w_transposed else w).requires_grad_()  # torchtitan layout: a view
    y = ops.grouped_gemm(x, w, offs, s2w_t)
    out = {"y": ref.within(y, *ref.grouped_mm_f64(x.detach(), w.detach(), offs, s2w_t), dtype, "y")}
    dy = ref.randn((R, N), dtype, device, gen)
    y.backward(dy)
    out["dx"] = ref.within(x.grad, *ref.grouped_mm_f64(dy, w.detach().transpose(1, 2), offs, s2w_t), dtype, "dx")
    out["dw"] = ref.within(w.grad, *ref.grouped_mm_wgrad_f64(x.detach(), dy, offs, s2w_t, G), dtype, "dw")
    return out


def _permute_index(device, gen) -> dict:
    import relibra_torch.ops as ops
    from relibra_torch.ops import reference as torch_ref

    checked = 0
    for S in (1, 7, 64, 300):
        for T, K in ((1, 1), (129, 1), (1000, 8), (65536, 8)):
            for kind in ("uniform", "hot"):
                slots = torch.randint(0, S, (T, K), generator=gen, device=device)
                if kind == "hot":
                    slots[torch.rand(T, K, generator=gen, device=device) < 0.7] = S - 1
                slots = slots.to((torch.int16, torch.int32, torch.int64)[checked % 3])
                row_of, offs = ops.permute_index(slots, S)
                want_row_of, want_offs = torch_ref.permute_index(slots, S)
                if not (torch.equal(row_of, want_row_of) and torch.equal(offs, want_offs)):
                    raise AssertionError(f"S={S} T={T} K={K} {kind} {slots.dtype}: differs from the torch reference")
                checked += 1
    row_of, offs = ops.permute_index(torch.zeros(0, 4, dtype=torch.int64, device=device), 5)
    if row_of.shape != (0, 4) or offs.tolist() != [0] * 5:
        raise AssertionError(f"empty input: row_of {tuple(row_of.shape)}, offsets {offs.tolist()}")
    return {"cases": checked + 1}


def _permute_unpermute(device, gen) -> dict:
    import relibra_torch.ops as ops

    out = {}
    for i, (T, K, D) in enumerate(((7, 1, 5), (33, 2, 40), (1000, 8, 2048), (513, 3, 1000))):
        dtype = (BF16, FP16, FP32, BF16)[i]
        slots = torch.randint(0, 16, (T, K), generator=gen, device=device)
        x = ref.randn((T, D), dtype, device, gen).requires_grad_()
        x_sorted, row_of, _ = ops.permute(slots, x, 16)
        inverse = torch.empty(T * K, dtype=torch.int64, device=device)
        inverse[row_of.reshape(-1)] = torch.arange(T * K, device=device)
        if not torch.equal(x_sorted, x.detach()[inverse // K]):
            raise AssertionError(f"permute {T}x{K}x{D}: a sorted row is not its token's row")
        g_sorted = ref.randn((T * K, D), dtype, device, gen)
        x_sorted.backward(g_sorted)
        ref.within(x.grad, *ref.unpermute_f64(g_sorted, row_of, None), dtype, "permute dx")
        for gates_kind in ("fp32", "same", None):
            y = ref.randn((T * K, D), dtype, device, gen).requires_grad_()
            gates = (None if gates_kind is None else
                     torch.rand(T, K, generator=gen, device=device).to(FP32 if gates_kind == "fp32" else dtype))
            if gates is not None:
                gates.requires_grad_()
            combined = ops.unpermute(y, row_of, gates)
            key = f"{T}x{K}x{D} {str(dtype)[6:]} gates={gates_kind}"
            out[key] = ref.within(combined, *ref.unpermute_f64(y.detach(), row_of, gates), dtype, "unpermute")
            dout = ref.randn((T, D), dtype, device, gen)
            combined.backward(dout)
            g_used = gates.detach() if gates is not None else torch.ones(T, K, device=device)
            (dy, dy_bound), (dg, dg_bound) = ref.unpermute_backward_f64(dout, y.detach(), row_of, g_used)
            ref.within(y.grad, dy, dy_bound, dtype, "unpermute dy")
            if gates is not None:
                ref.within(gates.grad, dg, dg_bound, gates.dtype, "unpermute dgates")
    return out


def _grouped_edges(device, gen) -> dict:
    import relibra_torch.ops as ops

    out = {}
    cases = {"empty and one-row groups": ([0, 1, 0, 5, 1, 0, 33], None, 7),
             "all rows in one group": ([0, 0, 67, 0, 0, 0, 0], None, 7),
             "replicas share weights, weight 3 unused": ([9, 0, 31, 4, 17, 0, 2], [2, 0, 2, 1, 2, 0, 1], 4)}
    for name, (sizes, s2w, G) in cases.items():
        for dtype in (FP32, FP16, BF16):
            out[f"{name} {str(dtype)[6:]}"] = grouped_case(sizes, s2w, G, 37, 41, 2, dtype, gen, device)
    out["transposed weight bf16"] = grouped_case([40, 0, 200, 0, 3, 9, 1], [1, 1, 0, 2, 2, 0, 1], 3, 128, 96,
                                                 5, BF16, gen, device, w_transposed=True)
    y = ops.grouped_gemm(torch.randn(4, 3, device=device), torch.randn(0, 3, 2, device=device),
                         torch.zeros(0, dtype=torch.int32, device=device))
    if not torch.equal(y, torch.zeros(4, 2, device=device)):
        raise AssertionError("no slots (S = 0): the output must be all zeros")
    return out


def _host(gen: torch.Generator) -> torch.Generator:
    """A CPU generator seeded from ``gen`` (shape choices are drawn on the host)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device)))


def _draw(host: torch.Generator, lo: int, hi: int) -> int:
    return int(torch.randint(lo, hi, (1,), generator=host))


def _grouped_random(device, gen) -> dict:
    out = {}
    host = _host(gen)
    for i in range(6):
        S = 7  # one S_PAD for all cases: a bounded number of compiled variants
        sizes = [(0, 1, _draw(host, 0, 400))[_draw(host, 0, 3)] for _ in range(S)]
        shared = i % 2 == 1
        G = 4 if shared else S
        s2w = [_draw(host, 0, G) for _ in range(S)] if shared else None
        Kd = (_draw(host, 1, 300), 16 * _draw(host, 1, 20))[i % 2]  # odd (masked K loop) or aligned
        N = (16 * _draw(host, 1, 20), _draw(host, 1, 300))[i % 2]
        tail = (0, 130)[i % 2]
        out[f"#{i} sizes={sizes} G={G} K={Kd} N={N} tail={tail}"] = grouped_case(
            sizes, s2w, G, Kd, N, tail, BF16, gen, device, w_transposed=i % 3 == 0)
    return out


def _grouped_qwen3(device, gen) -> dict:
    """Qwen3-30B-A3B expert shapes (D 2048, F 768), 64K rows, skewed slots with empty ones."""
    from relibra_torch.ops import custom_ops

    out = {}
    R, D, F, S = 65536, 2048, 768, 8
    sizes = ref.skewed_sizes(R, S, _host(gen))
    offs = ref.offsets_of(sizes, device)
    for proj, (K_, N_) in (("gate/up", (D, F)), ("down", (F, D))):
        x = ref.randn((R, K_), BF16, device, gen)
        w = ref.randn((S, K_, N_), BF16, device, gen, K_ ** -0.5)
        dy = ref.randn((R, N_), BF16, device, gen)
        y = custom_ops.grouped_mm(x, w, offs, None)
        out[f"{proj} fwd"] = ref.within(y, *ref.grouped_mm_f64(x, w, offs, None), BF16, f"{proj} fwd")
        dx = custom_ops.grouped_mm(dy, w.transpose(1, 2), offs, None)
        out[f"{proj} dX"] = ref.within(dx, *ref.grouped_mm_f64(dy, w.transpose(1, 2), offs, None), BF16, f"{proj} dX")
        dw = custom_ops.grouped_mm_wgrad(x, dy, offs, None, S)
        out[f"{proj} dW"] = ref.within(dw, *ref.grouped_mm_wgrad_f64(x, dy, offs, None, S), BF16, f"{proj} dW")
        if not torch.equal(dw, custom_ops.grouped_mm_wgrad(x, dy, offs, None, S)):
            raise AssertionError(f"{proj} dW differs between two identical calls (not deterministic)")
    out["sizes"] = sizes
    return out


def _beyond_int32(device, gen) -> dict:
    """Tensors of more than 2^31 elements: offsets past int32 in loads and stores."""
    import relibra_torch.ops as ops
    from relibra_torch.ops import custom_ops

    free, _ = torch.cuda.mem_get_info(device)
    if free < BEYOND_INT32_BYTES:
        raise Skip(f"needs ~{BEYOND_INT32_BYTES / 2**30:.0f} GiB of free GPU memory, {free / 2**30:.0f} GiB free")
    out = {}
    sizes = [200_000, 200_000, 140_000, 60_000]  # x and dX are [600000, 4096]: 2.46e9 elements
    R, Kd, N, G = sum(sizes), 4096, 256, 4
    offs = ref.offsets_of(sizes, device)
    x = ref.randn((R, Kd), BF16, device, gen)
    w = ref.randn((G, Kd, N), BF16, device, gen, Kd ** -0.5)
    dy = ref.randn((R, N), BF16, device, gen)
    lo = 520_000  # rows checked: their elements lie past 2^31 = row 524288 of x
    tail_sizes = [0, 0, 540_000 - lo, 60_000]
    tail_offs = ref.offsets_of(tail_sizes, device)
    y = custom_ops.grouped_mm(x, w, offs, None)
    out["fwd"] = ref.within(y[lo:], *ref.grouped_mm_f64(x[lo:], w, tail_offs, None), BF16, "fwd > 2^31")
    del y
    dx = custom_ops.grouped_mm(dy, w.transpose(1, 2), offs, None)
    out["dX"] = ref.within(dx[lo:], *ref.grouped_mm_f64(dy[lo:], w.transpose(1, 2), tail_offs, None), BF16,
                           "dX > 2^31")
    del dx
    dw = custom_ops.grouped_mm_wgrad(x, dy, offs, None, G)
    exact, bound = ref.grouped_mm_wgrad_f64(x[400_000:], dy[400_000:], ref.offsets_of([0, 0, 140_000, 60_000], device),
                                            None, G)
    out["dW slots 2-3"] = ref.within(dw[2:], exact[2:], bound[2:], BF16, "dW > 2^31")
    del x, dy, dw
    T, K, D = 80_000, 8, 4096  # permuted buffer [640000, 4096]: 2.6e9 elements
    slots = torch.randint(0, 32, (T, K), generator=gen, device=device)
    xt = ref.randn((T, D), BF16, device, gen)
    x_sorted, row_of, _ = ops.permute(slots, xt, 32)
    last = slice(T - 3000, T)
    if not torch.equal(x_sorted[row_of[last].reshape(-1)].view(-1, K, D), xt[last, None].expand(-1, K, D)):
        raise AssertionError("permute > 2^31: the last tokens' sorted rows are not their rows")
    gates = torch.rand(T, K, generator=gen, device=device)
    combined = ops.unpermute(x_sorted, row_of, gates)
    out["unpermute"] = ref.within(combined[last], *ref.unpermute_f64(x_sorted, row_of[last], gates[last]), BF16,
                                  "unpermute > 2^31")
    return out


def sweep_configs(report: Report, device, gen) -> None:
    """``full`` mode: every autotune config of both GEMM kernels, pinned once each (bf16)."""
    tk = _kernels()
    odd = ([9, 0, 31, 4, 17, 0, 2], [2, 0, 2, 1, 2, 0, 1], 4, 37, 41, 2)  # masked K loop, shared weights
    aligned = (ref.skewed_sizes(3000, 7, torch.Generator().manual_seed(3)), None, 7, 256, 384, 130)  # EVEN_K
    gemm, wgrad = tk._grouped_mm_kernel, tk._grouped_mm_wgrad_kernel
    sweeps = [("forward/dX", gemm, wgrad, tk._wgrad_configs()[0], tk._gemm_configs()),
              ("dW", wgrad, gemm, tk._gemm_configs()[0], tk._wgrad_configs())]
    for label, kernel, other, other_cfg, configs in sweeps:
        for cfg in configs:
            def run(kernel=kernel, cfg=cfg, other=other, other_cfg=other_cfg):
                with pinned(kernel, cfg), pinned(other, other_cfg), ref.poisoned_outputs():
                    return {name: grouped_case(*case, BF16, gen, device) for name, case in (("odd", odd), ("aligned", aligned))}
            report.check(PART, f"{label} config {cfg}", run)


def run(report: Report, device: torch.device, full: bool, seed: int) -> None:
    """Record every kernel check in ``report``."""
    import relibra_torch.ops as ops

    gen = torch.Generator(device=device).manual_seed(seed)
    cases = [("permute_index exact vs the torch reference (S 1..300, T up to 64K, int16/32/64)", _permute_index),
             ("permute, unpermute fwd/bwd vs fp64 (bf16/fp16/fp32, gates fp32/same/none)", _permute_unpermute),
             ("grouped GEMM fwd/dX/dW edge cases vs fp64 (empty groups, S = 0, shared and unused weights)",
              _grouped_edges),
             ("grouped GEMM fwd/dX/dW, 6 random shapes vs fp64 (odd K/N, tail rows, torchtitan layout)",
              _grouped_random),
             ("grouped GEMM Qwen3-30B-A3B shapes, 64K rows, skewed with empty slots, vs fp64", _grouped_qwen3),
             ("more than 2^31 elements: grouped fwd/dX/dW and permute/unpermute vs fp64", _beyond_int32)]
    with ops.use_backend("triton"):
        for name, fn in cases:
            def one(fn=fn):
                with first_configs():
                    return fn(device, gen)
            report.check(PART, name, one)
        if full:
            sweep_configs(report, device, gen)
