"""Triton kernels for token permutation and grouped GEMM, and their host-side launchers.

Imported lazily (by :mod:`relibra_torch.ops.custom_ops`) on the first Triton call, because
``triton.jit`` decides at decoration time whether a kernel runs compiled or in the
interpreter (``TRITON_INTERPRET=1``, used to run these kernels on CPU tensors in tests).

Shape legend (suffixes of tensor names):
  T tokens, K top-k (routed slots per token), n = T*K flattened token-slots,
  R rows of the sorted (permuted) buffer, D hidden size,
  S slots (groups of the grouped GEMM; native or replica), G weights (experts),
  M rows of a GEMM operand, Kd reduction dim of a GEMM, N output columns,
  B blocks of BLOCK token-slots in the permutation kernels.

Every launcher sizes its grid from shapes known on the host (T, K, R, S, G, N, Kd), never
from device values, so nothing here synchronises with the device and all of it can be
captured in a CUDA graph.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)


def _fix_interpreter_scalar_index() -> bool:
    """Make the interpreter of triton <= 3.6 usable with numpy >= 2.4; True if patched.

    The interpreter holds every scalar as a one-element 1-D numpy array, and those tritons
    turn it into a Python int (``range(0, K, BK)`` with a runtime ``K``) by
    ``int(array([v]))``, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted
    to Python scalars", triton-lang/triton#9171; later tritons index the element). Every
    kernel loop with a runtime bound hits it. The interpreter installs ``tensor.__index__``
    on each launch, so the launch-time hook is wrapped to install the element-wise version
    after it (on tritons that already take the element this changes nothing). Interpreter
    only: compiled kernels never see this code.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if np.lib.NumpyVersion(np.__version__) < "2.4.0" or original is None:
        return False
    if getattr(original, "_relibra_index_fix", False):
        return True

    def _index(self) -> int:
        data = self.handle.data
        if data.size != 1:
            raise TypeError(f"only a scalar converts to an index; got a block of shape {data.shape}")
        return int(data.reshape(-1)[0])

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", _index)  # restored with the rest after the launch

    patched._relibra_index_fix = True
    interpreter._patch_lang_tensor = patched
    return True


if INTERPRET:
    _fix_interpreter_scalar_index()

# `tl.dot` on bf16 tiles returns wrong values under the interpreter (numpy has no bf16
# matmul); upcasting the tiles to fp32 there is exact for bf16 inputs.
_INTERPRET_UPCAST_DTYPES = (torch.bfloat16,)

_TORCH_TO_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def _needs_upcast(dtype: torch.dtype) -> bool:
    return INTERPRET and dtype in _INTERPRET_UPCAST_DTYPES


@triton.jit
def _cast_out(v, ptr, FIX_BF16: tl.constexpr):
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest even; FIX_BF16
    # (set only under the interpreter) rounds in fp32 bits first so both give the same bf16.
    if FIX_BF16:
        if ptr.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    return v.to(ptr.dtype.element_ty)


# ----------------------------------------------------------------------------------------
# Permutation: histogram -> prefix sum -> stable scatter
# ----------------------------------------------------------------------------------------

PERMUTE_BLOCK = 128  # token-slots per block of the index kernels (rank uses a BLOCK^2 compare)
SCAN_CHUNK = 1024  # blocks scanned per iteration of the prefix-sum kernel


@triton.jit
def _slot_histogram_kernel(slot_ptr, counts_SB_ptr, n, num_blocks, S,
                           BLOCK: tl.constexpr, S_PAD: tl.constexpr):
    # Per-block histogram, stored slot-major so the scan reads contiguous rows.
    b = tl.program_id(0)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    valid = idx < n
    s = tl.load(slot_ptr + idx, mask=valid, other=0).to(tl.int32)
    hist = tl.histogram(s, S_PAD, mask=valid)
    bins = tl.arange(0, S_PAD)
    tl.store(counts_SB_ptr + bins.to(tl.int64) * num_blocks + b, hist, mask=bins < S)


@triton.jit
def _slot_scan_kernel(counts_SB_ptr, totals_ptr, num_blocks, CHUNK: tl.constexpr):
    # In place: counts[s, b] -> number of slot-s token-slots in blocks before b.
    s = tl.program_id(0)
    row = counts_SB_ptr + s.to(tl.int64) * num_blocks
    carry = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, num_blocks, CHUNK):
        cb = c0 + tl.arange(0, CHUNK)
        m = cb < num_blocks
        v = tl.load(row + cb, mask=m, other=0)
        incl = tl.cumsum(v, axis=0)
        tl.store(row + cb, carry + incl - v, mask=m)
        carry += tl.sum(v, axis=0)
    tl.store(totals_ptr + s, carry)


@triton.jit
def _slot_scatter_kernel(slot_ptr, base_SB_ptr, totals_ptr, offsets_ptr, row_of_ptr, n, num_blocks, S,
                         BLOCK: tl.constexpr, S_PAD: tl.constexpr):
    # Stable: a token-slot's row = start of its slot + earlier blocks' count for the slot
    # + number of equal slots before it inside the block. Every block derives the slot
    # starts from the totals itself (S_PAD values), so no launch is spent on them; block 0
    # writes the offsets.
    b = tl.program_id(0)
    si = tl.arange(0, S_PAD)
    tot = tl.load(totals_ptr + si, mask=si < S, other=0)
    ends = tl.cumsum(tot, axis=0)
    if b == 0:
        tl.store(offsets_ptr + si, ends, mask=si < S)
    starts = ends - tot
    loc = tl.arange(0, BLOCK)
    idx = b * BLOCK + loc
    valid = idx < n
    s = tl.load(slot_ptr + idx, mask=valid, other=0).to(tl.int32)
    s_rank = tl.where(valid, s, -1)
    same = (s_rank[:, None] == s_rank[None, :]) & (loc[None, :] < loc[:, None])
    rank = tl.sum(same.to(tl.int32), axis=1)
    start = tl.gather(starts, s, 0)
    base = tl.load(base_SB_ptr + s.to(tl.int64) * num_blocks + b, mask=valid, other=0)
    row = (start + base + rank).to(tl.int64)
    tl.store(row_of_ptr + idx, row, mask=valid)


def permute_index(expert_slot_TK: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: ``(row_of_TK int64 [T, K], offsets_S int32 [S])`` of the stable sort by slot.

    Three launches (per-block histograms, their scan per slot, the scatter) and three
    allocations: on an H200 the call is launch-bound below ~64K token-slots (eager ~110 us
    with four launches against 11-19 us replayed from a CUDA graph;
    ``benchmarks/kernel_configs.py``), so every launch and allocation saved counts.
    """
    T, K = expert_slot_TK.shape
    n = T * K
    dev = expert_slot_TK.device
    row_of = torch.empty((T, K), dtype=torch.int64, device=dev)
    offsets = torch.empty((num_slots,), dtype=torch.int32, device=dev)
    if num_slots == 0:
        return row_of, offsets
    if n == 0:
        offsets.zero_()
        return row_of, offsets
    slots = expert_slot_TK.contiguous().view(-1)
    num_blocks = triton.cdiv(n, PERMUTE_BLOCK)
    s_pad = _next_pow2(num_slots)
    # one allocation: the per-(slot, block) counts, then the per-slot totals
    scratch = torch.empty((num_slots * (num_blocks + 1),), dtype=torch.int32, device=dev)
    counts_SB, totals = scratch[: num_slots * num_blocks], scratch[num_slots * num_blocks:]
    _slot_histogram_kernel[(num_blocks,)](slots, counts_SB, n, num_blocks, num_slots,
                                          BLOCK=PERMUTE_BLOCK, S_PAD=s_pad)
    _slot_scan_kernel[(num_slots,)](counts_SB, totals, num_blocks,
                                    CHUNK=min(SCAN_CHUNK, _next_pow2(num_blocks)))
    _slot_scatter_kernel[(num_blocks,)](slots, counts_SB, totals, offsets, row_of, n, num_blocks, num_slots,
                                        BLOCK=PERMUTE_BLOCK, S_PAD=s_pad)
    return row_of, offsets


# ----------------------------------------------------------------------------------------
# Row movement: permute (scatter x rows to their K sorted rows) and unpermute (gather + sum)
# ----------------------------------------------------------------------------------------


def _row_tiles(K: int, D: int) -> tuple[int, int, int]:
    """(BT, K_PAD, BD) with BT*K_PAD*BD bounded so one 3-D tile stays in registers."""
    k_pad = _next_pow2(K)
    budget = 8192
    bd = max(16, min(256, _next_pow2(D), budget // k_pad))
    bt = max(1, min(32, budget // (k_pad * bd)))
    bt = 1 << (bt.bit_length() - 1)
    return bt, k_pad, bd


@triton.jit
def _permute_rows_kernel(x_ptr, row_of_ptr, out_ptr, T, D, K, sxt, sxd, sor, sod,
                         BT: tl.constexpr, K_PAD: tl.constexpr, BD: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    k = tl.arange(0, K_PAD)
    d = pid_d * BD + tl.arange(0, BD)
    tk_mask = (t[:, None] < T) & (k[None, :] < K)
    rows = tl.load(row_of_ptr + t[:, None].to(tl.int64) * K + k[None, :], mask=tk_mask, other=0)
    d_mask = d < D
    xv = tl.load(x_ptr + t[:, None].to(tl.int64) * sxt + d[None, :] * sxd,
                 mask=(t[:, None] < T) & d_mask[None, :], other=0.0)
    out_ptrs = out_ptr + rows[:, :, None] * sor + d[None, None, :] * sod
    val = tl.broadcast_to(xv[:, None, :], (BT, K_PAD, BD))
    tl.store(out_ptrs, val, mask=tk_mask[:, :, None] & d_mask[None, None, :])


def permute_rows(x_TD: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """Triton: ``x_RD[row_of[t, k]] = x_TD[t]`` for all (t, k); R = T*K."""
    T, D = x_TD.shape
    K = row_of_TK.shape[1]
    out = torch.empty((T * K, D), dtype=x_TD.dtype, device=x_TD.device)
    if T * K == 0 or D == 0:
        return out
    row_of = row_of_TK.contiguous()
    bt, k_pad, bd = _row_tiles(K, D)
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd))
    _permute_rows_kernel[grid](x_TD, row_of, out, T, D, K, x_TD.stride(0), x_TD.stride(1),
                               out.stride(0), out.stride(1), BT=bt, K_PAD=k_pad, BD=bd)
    return out


@triton.jit
def _unpermute_kernel(y_ptr, row_of_ptr, gates_ptr, out_ptr, T, D, K, syr, syd, sot, sod,
                      HAS_GATES: tl.constexpr, FIX_BF16: tl.constexpr, BT: tl.constexpr, K_PAD: tl.constexpr,
                      BD: tl.constexpr):
    # out[t] = sum_k gate[t, k] * y[row_of[t, k]]: a fixed-order fp32 reduction inside one
    # program, so results are bit-reproducible without atomics.
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    t = pid_t * BT + tl.arange(0, BT)
    k = tl.arange(0, K_PAD)
    d = pid_d * BD + tl.arange(0, BD)
    tk_mask = (t[:, None] < T) & (k[None, :] < K)
    tk_off = t[:, None].to(tl.int64) * K + k[None, :]
    rows = tl.load(row_of_ptr + tk_off, mask=tk_mask, other=0)
    d_mask = d < D
    yv = tl.load(y_ptr + rows[:, :, None] * syr + d[None, None, :] * syd,
                 mask=tk_mask[:, :, None] & d_mask[None, None, :], other=0.0).to(tl.float32)
    if HAS_GATES:
        g = tl.load(gates_ptr + tk_off, mask=tk_mask, other=0.0).to(tl.float32)
        yv = yv * g[:, :, None]
    acc = tl.sum(yv, axis=1)
    tl.store(out_ptr + t[:, None].to(tl.int64) * sot + d[None, :] * sod,
             _cast_out(acc, out_ptr, FIX_BF16), mask=(t[:, None] < T) & d_mask[None, :])


def unpermute(y_RD: torch.Tensor, row_of_TK: torch.Tensor, gates_TK: torch.Tensor | None) -> torch.Tensor:
    """Triton: ``out_TD[t] = sum_k gates[t, k] * y_RD[row_of[t, k]]`` (fp32 accumulate)."""
    T, K = row_of_TK.shape
    D = y_RD.shape[1]
    out = torch.empty((T, D), dtype=y_RD.dtype, device=y_RD.device)
    if T == 0 or D == 0:
        return out
    if K == 0:
        return out.zero_()
    row_of = row_of_TK.contiguous()
    gates = gates_TK.contiguous() if gates_TK is not None else row_of  # dummy pointer
    bt, k_pad, bd = _row_tiles(K, D)
    grid = (triton.cdiv(T, bt), triton.cdiv(D, bd))
    _unpermute_kernel[grid](y_RD, row_of, gates, out, T, D, K, y_RD.stride(0), y_RD.stride(1),
                            out.stride(0), out.stride(1), HAS_GATES=gates_TK is not None, FIX_BF16=INTERPRET,
                            BT=bt, K_PAD=k_pad, BD=bd)
    return out


@triton.jit
def _unpermute_bwd_kernel(dout_ptr, y_ptr, row_of_ptr, gates_ptr, dy_ptr, dgates_ptr, T, D, K,
                          sdt, sdd, syr, syd, sdyr, sdyd, FIX_BF16: tl.constexpr,
                          BT: tl.constexpr, K_PAD: tl.constexpr, BD: tl.constexpr):
    # One program owns BT tokens and walks D, so dgates needs no cross-program reduction.
    pid_t = tl.program_id(0)
    t = pid_t * BT + tl.arange(0, BT)
    k = tl.arange(0, K_PAD)
    tk_mask = (t[:, None] < T) & (k[None, :] < K)
    tk_off = t[:, None].to(tl.int64) * K + k[None, :]
    rows = tl.load(row_of_ptr + tk_off, mask=tk_mask, other=0)
    g = tl.load(gates_ptr + tk_off, mask=tk_mask, other=0.0).to(tl.float32)
    dg = tl.zeros((BT, K_PAD), dtype=tl.float32)
    for d0 in range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        d_mask = d < D
        do = tl.load(dout_ptr + t[:, None].to(tl.int64) * sdt + d[None, :] * sdd,
                     mask=(t[:, None] < T) & d_mask[None, :], other=0.0).to(tl.float32)
        m3 = tk_mask[:, :, None] & d_mask[None, None, :]
        dyv = g[:, :, None] * do[:, None, :]
        tl.store(dy_ptr + rows[:, :, None] * sdyr + d[None, None, :] * sdyd,
                 _cast_out(dyv, dy_ptr, FIX_BF16), mask=m3)
        yv = tl.load(y_ptr + rows[:, :, None] * syr + d[None, None, :] * syd,
                     mask=m3, other=0.0).to(tl.float32)
        dg += tl.sum(yv * do[:, None, :], axis=2)
    tl.store(dgates_ptr + tk_off, _cast_out(dg, dgates_ptr, FIX_BF16), mask=tk_mask)


def unpermute_backward(dout_TD: torch.Tensor, y_RD: torch.Tensor, row_of_TK: torch.Tensor,
                       gates_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: ``(dy_RD, dgates_TK)`` of :func:`unpermute` (rows no token-slot reads get 0)."""
    T, K = row_of_TK.shape
    R, D = y_RD.shape
    # Rows that no token-slot maps to only exist when R > T*K; zero-fill only then.
    alloc = torch.zeros if R != T * K else torch.empty
    dy = alloc((R, D), dtype=y_RD.dtype, device=y_RD.device)
    dgates = torch.empty((T, K), dtype=gates_TK.dtype, device=gates_TK.device)
    if T * K == 0:
        return dy, dgates
    if D == 0:
        return dy, dgates.zero_()
    row_of = row_of_TK.contiguous()
    gates = gates_TK.contiguous()
    bt, k_pad, bd = _row_tiles(K, D)
    _unpermute_bwd_kernel[(triton.cdiv(T, bt),)](
        dout_TD, y_RD, row_of, gates, dy, dgates, T, D, K, dout_TD.stride(0), dout_TD.stride(1),
        y_RD.stride(0), y_RD.stride(1), dy.stride(0), dy.stride(1), FIX_BF16=INTERPRET, BT=bt, K_PAD=k_pad, BD=bd)
    return dy, dgates


# ----------------------------------------------------------------------------------------
# Grouped GEMM
# ----------------------------------------------------------------------------------------


def _gemm_configs() -> list:
    if INTERPRET:
        # Few large programs: the interpreter's cost is per program, not per element.
        return [triton.Config({"BM": 32, "BN": 32, "BK": 32}, num_warps=4, num_stages=1)]
    cfgs = []
    for bm, bn, bk, w, st in [
        (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 32, 4, 4), (64, 256, 32, 4, 4),
    ]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=st))
    return cfgs


def _wgrad_configs() -> list:
    if INTERPRET:
        # Few large programs: the interpreter's cost is per program, not per element.
        return [triton.Config({"BM": 32, "BN": 32, "BK": 32}, num_warps=4, num_stages=1)]
    cfgs = []
    for bm, bn, bk, w, st in [
        (64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4),
        (64, 256, 128, 8, 3), (32, 64, 64, 4, 4), (64, 128, 64, 4, 4),
    ]:
        cfgs.append(triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=st))
    return cfgs


_AUTOTUNE = not INTERPRET and os.environ.get("RELIBRA_OPS_AUTOTUNE", "1") != "0"


def _maybe_autotune(configs, key):
    if _AUTOTUNE:
        return triton.autotune(configs=configs, key=key)
    cfg = configs[0]

    def wrap(kernel):
        kernel._relibra_fixed_config = cfg
        return kernel

    return wrap


def _rows_bucket(rows: int) -> int:
    """The autotune key's row count: its power of two. Measured on an H200 (bf16, 8 slots,
    D 2048, F 768; ``benchmarks/kernel_configs.py``): the best forward config at 4K rows costs
    1.17x at 64K rows, and the best at 64K costs 1.38x at 4K, so one config per N, K cannot
    serve every micro-batch; per power of two the tuning runs a handful of times per run."""
    return max(int(rows), 1).bit_length()


@_maybe_autotune(_gemm_configs(), key=["N", "K", "S_PAD", "HAS_S2W", "TRANS_W", "ROWS_BUCKET"])
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BK"] == 0})
@triton.jit
def _grouped_mm_kernel(x_ptr, w_ptr, y_ptr, offs_ptr, s2w_ptr, R, N, K, S, ROWS_BUCKET,
                       sxm, sxk, swg, swk, swn, sym, syn,
                       HAS_S2W: tl.constexpr, S_PAD: tl.constexpr, TRANS_W: tl.constexpr,
                       UPCAST: tl.constexpr, IEEE: tl.constexpr, FIX_BF16: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr):
    # y[rows of slot s] = x[rows of slot s] @ w[s2w[s]]. The grid is an upper bound on the
    # number of (row tile, column tile) pairs, cdiv(R, BM) + S, known on the host; each
    # program finds its slot from the offsets, and the tiles past the last slot write the
    # zeros of rows that belong to no slot (offsets[-1] < R).
    pid = tl.program_id(0)
    n_tiles_n = (N + BN - 1) // BN
    tile = pid // n_tiles_n
    pid_n = pid % n_tiles_n

    sidx = tl.arange(0, S_PAD)
    s_valid = sidx < S
    total_rows = tl.load(offs_ptr + S - 1)
    ends = tl.load(offs_ptr + sidx, mask=s_valid, other=0)
    ends = tl.where(s_valid, ends, total_rows)
    starts = tl.load(offs_ptr + sidx - 1, mask=s_valid & (sidx > 0), other=0)
    starts = tl.where(s_valid, starts, total_rows)
    sizes = tl.maximum(ends - starts, 0)
    tiles = (sizes + BM - 1) // BM
    tile_ends = tl.cumsum(tiles, axis=0)
    total_tiles = tl.sum(tiles, axis=0)
    g = tl.sum((tile_ends <= tile).to(tl.int32), axis=0)
    in_slot = g < S
    sel = sidx == g
    row_start = tl.where(in_slot, tl.sum(tl.where(sel, starts, 0), axis=0), total_rows)
    row_end = tl.where(in_slot, tl.sum(tl.where(sel, ends, 0), axis=0), R)
    tile_start = tl.where(in_slot, tl.sum(tl.where(sel, tile_ends - tiles, 0), axis=0), total_tiles)
    g_safe = tl.minimum(g, S - 1)
    if HAS_S2W:
        widx = tl.load(s2w_ptr + g_safe).to(tl.int64)
    else:
        widx = g_safe.to(tl.int64)

    rm = row_start + (tile - tile_start) * BM + tl.arange(0, BM)
    m_mask = rm < row_end
    rn = pid_n * BN + tl.arange(0, BN)
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    k_lim = tl.where(in_slot, K, 0)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    x_base = x_ptr + rm64[:, None] * sxm
    w_base = w_ptr + widx * swg + rn[None, :] * swn
    for k0 in range(0, k_lim, BK):
        rk = k0 + tl.arange(0, BK)
        if EVEN_K:  # no K mask: keeps the loads vectorised along K
            a = tl.load(x_base + rk[None, :] * sxk, mask=m_mask[:, None], other=0.0)
            b = tl.load(w_base + rk[:, None] * swk, mask=n_mask[None, :], other=0.0)
        else:
            k_mask = rk < K
            a = tl.load(x_base + rk[None, :] * sxk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_base + rk[:, None] * swk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rm64[:, None] * sym + rn[None, :] * syn, _cast_out(acc, y_ptr, FIX_BF16),
             mask=m_mask[:, None] & n_mask[None, :])


@_maybe_autotune(_wgrad_configs(), key=["K", "N", "HAS_S2W", "ROWS_BUCKET"])
@triton.jit
def _grouped_mm_wgrad_kernel(x_ptr, dy_ptr, dw_ptr, offs_ptr, s2w_ptr, K, N, S, ROWS_BUCKET,
                             sxm, sxk, sdm, sdn, swg, swk, swn,
                             HAS_S2W: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                             FIX_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    # dw[g] = sum over slots s with s2w[s] == g of x[rows of s]^T @ dy[rows of s]. The ragged
    # dimension is the reduction (K-grouped GEMM); one program owns one (g, K tile, N tile)
    # output tile and walks the slots of g in order, so the sum needs no atomics and is
    # reproducible, and weights with no rows get zeros.
    pid = tl.program_id(0)
    n_tiles_k = (K + BK - 1) // BK
    n_tiles_n = (N + BN - 1) // BN
    per_g = n_tiles_k * n_tiles_n
    g = pid // per_g
    rem = pid % per_g
    pid_k = rem // n_tiles_n
    pid_n = rem % n_tiles_n
    rk = pid_k * BK + tl.arange(0, BK)
    rn = pid_n * BN + tl.arange(0, BN)
    k_mask = rk < K
    n_mask = rn < N
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    if HAS_S2W:
        s_lo = 0
        s_hi = S
    else:
        s_lo = g
        s_hi = g + 1
    for s in range(s_lo, s_hi):
        if HAS_S2W:
            mine = tl.load(s2w_ptr + s).to(tl.int32) == g
        else:
            mine = True
        start = tl.load(offs_ptr + s - 1, mask=s > 0, other=0)
        end = tl.load(offs_ptr + s)
        end = tl.where(mine, end, start)
        for m0 in range(start, end, BM):
            rm = m0 + tl.arange(0, BM)
            m_mask = rm < end
            rm64 = rm.to(tl.int64)
            a = tl.load(x_ptr + rm64[None, :] * sxm + rk[:, None] * sxk,
                        mask=k_mask[:, None] & m_mask[None, :], other=0.0)
            b = tl.load(dy_ptr + rm64[:, None] * sdm + rn[None, :] * sdn,
                        mask=m_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
    tl.store(dw_ptr + g.to(tl.int64) * swg + rk[:, None] * swk + rn[None, :] * swn,
             _cast_out(acc, dw_ptr, FIX_BF16), mask=k_mask[:, None] & n_mask[None, :])


def _launch(kernel, grid_fn, *args, **kwargs):
    cfg = getattr(kernel, "_relibra_fixed_config", None)
    if cfg is None:
        kernel[grid_fn](*args, **kwargs)
    else:
        meta = dict(cfg.kwargs)
        kernel[grid_fn(meta)](*args, **kwargs, **meta, num_warps=cfg.num_warps,
                              num_stages=cfg.num_stages)


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, offsets_S: torch.Tensor,
               slot_to_weight_S: torch.Tensor | None) -> torch.Tensor:
    """Triton: ``y_RN`` with rows of slot s times ``w[slot_to_weight[s]]``; other rows 0.

    Any strides for x and w (a transposed view of w gives the input gradient).
    """
    R, K = x_RK.shape
    N = w_GKN.shape[2]
    S = offsets_S.shape[0]
    y = torch.empty((R, N), dtype=x_RK.dtype, device=x_RK.device)
    if R == 0 or N == 0:
        return y
    if S == 0:
        return y.zero_()
    offs = offsets_S.contiguous()
    s2w = slot_to_weight_S.contiguous() if slot_to_weight_S is not None else offs  # dummy
    s_pad = _next_pow2(S)

    def grid(meta):
        return ((triton.cdiv(R, meta["BM"]) + S) * triton.cdiv(N, meta["BN"]),)

    _launch(_grouped_mm_kernel, grid, x_RK, w_GKN, y, offs, s2w, R, N, K, S, _rows_bucket(R),
            x_RK.stride(0), x_RK.stride(1), w_GKN.stride(0), w_GKN.stride(1), w_GKN.stride(2),
            y.stride(0), y.stride(1),
            HAS_S2W=slot_to_weight_S is not None, S_PAD=s_pad,
            TRANS_W=w_GKN.stride(2) != 1, UPCAST=_needs_upcast(x_RK.dtype),
            IEEE=x_RK.dtype == torch.float32, FIX_BF16=INTERPRET)
    return y


def grouped_mm_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_S: torch.Tensor,
                     slot_to_weight_S: torch.Tensor | None, num_weights: int) -> torch.Tensor:
    """Triton: ``dw_GKN[g] = sum_{s: s2w[s]=g} x[rows of s]^T dy[rows of s]``; 0 if no rows."""
    R, K = x_RK.shape
    N = dy_RN.shape[1]
    S = offsets_S.shape[0]
    dw = torch.empty((num_weights, K, N), dtype=x_RK.dtype, device=x_RK.device)
    if num_weights == 0 or K == 0 or N == 0:
        return dw
    if S == 0 or R == 0:
        return dw.zero_()
    offs = offsets_S.contiguous()
    s2w = slot_to_weight_S.contiguous() if slot_to_weight_S is not None else offs  # dummy

    def grid(meta):
        return (num_weights * triton.cdiv(K, meta["BK"]) * triton.cdiv(N, meta["BN"]),)

    _launch(_grouped_mm_wgrad_kernel, grid, x_RK, dy_RN, dw, offs, s2w, K, N, S, _rows_bucket(R),
            x_RK.stride(0), x_RK.stride(1), dy_RN.stride(0), dy_RN.stride(1),
            dw.stride(0), dw.stride(1), dw.stride(2),
            HAS_S2W=slot_to_weight_S is not None, UPCAST=_needs_upcast(x_RK.dtype),
            IEEE=x_RK.dtype == torch.float32, FIX_BF16=INTERPRET)
    return dw
