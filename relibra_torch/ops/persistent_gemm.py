"""A persistent two-phase grouped GEMM (ExpertPlex): decode and prefill tiles in one launch.

One launch of ``P`` programs serves two **tile tables**, one per phase (0 = decode,
1 = prefill). A tile is one ``(expert, m-block, n-block)`` output block of a grouped GEMM,
stored as a row ``(weight, row_start, row_end, n_block)`` of an int32 ``[n, 4]`` table built
on the host from per-expert row counts (:func:`tile_table`). Both phases read one input
buffer ``x_RK`` and write one output ``y_RN``: each table holds absolute row ranges, so the
decode rows and the prefill rows are different parts of the same buffers (on an expert rank,
the regions of its receive buffer that the attention ranks wrote).

**The claim rule.** A program loops: it claims a tile of its first phase; if none is left it
claims one of its other phase; it computes the tile; repeat. Programs ``pid <
decode_programs`` (the decode share) have decode as their first phase; the others have
prefill first and take decode tiles only when prefill has none (work conserving). A claim
never takes a tile that is not published yet, so a table can grow while the kernel runs (the
publisher writes the entries, then raises the phase's published count):

* **decode** is claimed by compare-and-swap of its claim counter against its published
  count: any program that is free takes the next published decode tile;
* **prefill** is claimed by **ticket**: one fetch-and-add (never fails, never retries) hands a
  program the next prefill tile number, which it holds (at most one) until that tile is
  published, then computes it.

Why two kinds: compare-and-swap serialises. On an H200 the first version, compare-and-swap
for both phases, claimed about one tile per microsecond whatever the tile size or program
count: the microbenchmark's 768 prefill tiles took 735 us where the plain grouped GEMM took
95 us and the same tile loop without claims 116 us (``benchmarks/kernel_configs.py``).
Prefill has the many tiles, so it takes tickets; decode keeps compare-and-swap, so that a
published decode tile goes to whichever program is free first instead of waiting for one
ticket holder's tile to end.

Decisions happen only between tiles: a decode tile published while every program is busy
waits at most for the end of one tile plus one check (the worst-case preemption delay;
``relibra_torch.serving.runtime.claims`` models the rule event by event). A program exits when
neither claim succeeds and the control word ``closed`` was set before it tried (its prefill
ticket is then past the final count, and every published prefill tile has a holder that
computes it), or after ``max_idle_polls`` empty polls, so a publisher that never comes cannot
hang the GPU; the prefill tickets held at such an exit are lost, so its control block is not
reused for prefill.

Control words (int32 ``[CTRL_WORDS]``): ``[claimed_dec, tickets_pre, published_dec,
published_pre, closed, done_dec, done_pre, idle_exits]``. The prefill tickets exceed the
prefill tiles by at most one per program (the tickets held when the run closed).

``GATED`` computes the SwiGLU gate/up product ``silu(x @ w1) * (x @ w3)`` in the same tiles
(the first GEMM of an expert); without it the plain ``x @ w``. Interpreter quirks are handled
as in :mod:`relibra_torch.ops.triton_kernels` (bf16 tiles upcast, IEEE fp32 dots, bf16
rounding of the interpreter's truncating casts).

Shape legend: R rows of the shared buffer, K reduction dim, N output columns, G weights,
E experts (= weights here), n tiles of a table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from relibra_torch.checks import check_int, check_tensor
from relibra_torch.ops import triton_kernels as tk

__all__ = ["CTRL_WORDS", "DECODE", "PREFILL", "control_words", "tile_table", "two_phase_grouped_mm",
           "publish", "wait_done"]

DECODE, PREFILL = 0, 1
CTRL_WORDS = 8
_CLAIMED, _PUBLISHED, _CLOSED, _DONE, _IDLE = 0, 2, 4, 5, 7


def tile_table(rows_E: torch.Tensor, *, tile_m: int, n_cols: int, tile_n: int, row_base: int = 0,
               weight_E: torch.Tensor | None = None) -> torch.Tensor:
    """The tile table of one phase: int32 ``[n, 4]`` rows ``(weight, row_start, row_end, n_block)``.

    Args:
        rows_E: int ``[E]`` rows of each expert, stored contiguously in expert order from
            ``row_base`` in the shared buffer (expert e owns ``row_base + sum(rows[:e])`` ..).
        tile_m, tile_n: tile height and width (the kernel's ``BM``, ``BN``).
        n_cols: output columns N.
        row_base: first row of this phase's region.
        weight_E: int ``[E]`` weight index of each expert (default: expert e uses weight e).

    Returns:
        The tiles in (expert, m-block, n-block) order; experts without rows have none, so
        ``n = tile_footprint(rows_E, tile_m) * ceil(n_cols / tile_n)``.
    """
    check_tensor("rows_E", rows_E, dim=1)
    tile_m, tile_n = check_int("tile_m", tile_m), check_int("tile_n", tile_n)
    check_int("n_cols", n_cols, 0)
    check_int("row_base", row_base, 0)
    rows = [int(v) for v in rows_E.tolist()]
    if any(r < 0 for r in rows):
        raise ValueError(f"rows_E has a negative entry ({min(rows)}); allowed: rows >= 0")
    if weight_E is not None and tuple(weight_E.shape) != (len(rows),):
        raise ValueError(f"weight_E has shape {tuple(weight_E.shape)}; allowed: [{len(rows)}] like rows_E")
    weights = list(range(len(rows))) if weight_E is None else [int(v) for v in weight_E.tolist()]
    n_blocks = -(-n_cols // tile_n)
    out = []
    start = row_base
    for e, r in enumerate(rows):
        for m0 in range(0, r, tile_m):
            for nb in range(n_blocks):
                out.append((weights[e], start + m0, start + min(r, m0 + tile_m), nb))
        start += r
    return torch.tensor(out, dtype=torch.int32).reshape(-1, 4)


def control_words(n_decode: int, n_prefill: int, *, closed: bool = True, device=None) -> torch.Tensor:
    """int32 ``[CTRL_WORDS]`` control block with ``n_decode`` / ``n_prefill`` tiles published."""
    ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=device)
    ctrl[_PUBLISHED + DECODE], ctrl[_PUBLISHED + PREFILL] = n_decode, n_prefill
    ctrl[_CLOSED] = int(closed)
    return ctrl


@triton.jit
def _read(ptr):
    # A control word read as an atomic. Triton performs a scalar atomic in one thread and
    # broadcasts the result, so every thread of the program sees the same value; a volatile
    # load is issued per thread and may differ across threads while the word changes, and a
    # branch on it splits the program. A version that branched on volatile loads crashed on
    # an H200 with an illegal instruction once decode tiles were claimed.
    return tl.atomic_add(ptr, 0)


@triton.jit
def _claim(ctrl_ptr, phase):
    # Compare-and-swap against the published count: never takes an unpublished tile.
    # Retries only when another program won the race.
    got = -1
    trying = 1
    while trying != 0:
        c = _read(ctrl_ptr + phase)
        n = _read(ctrl_ptr + 2 + phase)
        avail = c < n
        old = tl.atomic_cas(ctrl_ptr + phase, c, tl.where(avail, c + 1, c))
        got = tl.where(avail & (old == c), c, got)
        trying = (avail & (old != c)).to(tl.int32)
    return got


@triton.jit
def _take(ctrl_ptr, phase, held):
    # A ticket is taken once (fetch-and-add: never fails, never retries) and held until its
    # tile is published; -1 means none held.
    if held < 0:
        held = tl.atomic_add(ctrl_ptr + phase, 1)
    return held


@triton.jit
def _cast_store(ptrs, v, mask, FIX_BF16: tl.constexpr):
    # The interpreter truncates fp32 -> bf16 where GPUs round to nearest even (see
    # triton_kernels._cast_out): round in fp32 bits first there.
    if FIX_BF16:
        if ptrs.dtype.element_ty == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            v = bits.to(tl.float32, bitcast=True)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _two_phase_kernel(x_ptr, w1_ptr, w3_ptr, y_ptr, tab_ptr, ctrl_ptr, DEC_CAP, N, K, P_DEC, MAX_IDLE,
                      sxm, sxk, swg, swk, swn, sym, syn,
                      GATED: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, FIX_BF16: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    first = tl.where(pid < P_DEC, 0, 1)
    running = 1
    idle = 0
    held = -1  # this program's prefill ticket (-1: none)
    while running != 0:
        # `closed` is read before the claims: if it was set and both then fail, every tile
        # that will ever be published is claimed or ticketed, and this program may leave.
        closed = _read(ctrl_ptr + 4)
        ph = 1
        t = -1
        if first == 0:
            t = _claim(ctrl_ptr, 0)
            ph = 0
        if t < 0:
            held = _take(ctrl_ptr, 1, held)
            if held < _read(ctrl_ptr + 3):
                t = held
                held = -1
                ph = 1
            elif first == 1:
                t = _claim(ctrl_ptr, 0)
                ph = 0
        if t >= 0:
            entry = tab_ptr + (tl.where(ph == 0, 0, DEC_CAP) + t).to(tl.int64) * 4
            g = tl.load(entry).to(tl.int64)
            r0 = tl.load(entry + 1)
            r1 = tl.load(entry + 2)
            nb = tl.load(entry + 3)
            rm = r0 + tl.arange(0, BM)
            m_mask = rm < r1
            rn = nb * BN + tl.arange(0, BN)
            n_mask = rn < N
            rm64 = rm.to(tl.int64)
            acc1 = tl.zeros((BM, BN), dtype=tl.float32)
            acc3 = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                rk = k0 + tl.arange(0, BK)
                k_mask = rk < K
                a = tl.load(x_ptr + rm64[:, None] * sxm + rk[None, :] * sxk,
                            mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                w_off = g * swg + rk[:, None] * swk + rn[None, :] * swn
                w_mask = k_mask[:, None] & n_mask[None, :]
                b1 = tl.load(w1_ptr + w_off, mask=w_mask, other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                    b1 = b1.to(tl.float32)
                if IEEE:
                    acc1 = tl.dot(a, b1, acc1, input_precision="ieee")
                else:
                    acc1 = tl.dot(a, b1, acc1)
                if GATED:
                    b3 = tl.load(w3_ptr + w_off, mask=w_mask, other=0.0)
                    if UPCAST:
                        b3 = b3.to(tl.float32)
                    if IEEE:
                        acc3 = tl.dot(a, b3, acc3, input_precision="ieee")
                    else:
                        acc3 = tl.dot(a, b3, acc3)
            if GATED:
                out = acc1 * tl.sigmoid(acc1) * acc3
            else:
                out = acc1
            _cast_store(y_ptr + rm64[:, None] * sym + rn[None, :] * syn, out,
                        m_mask[:, None] & n_mask[None, :], FIX_BF16)
            tl.atomic_add(ctrl_ptr + 5 + ph, 1)  # done count of the phase (release)
            idle = 0
        else:
            idle += 1
            leave = (closed != 0) | (idle > MAX_IDLE)
            running = tl.where(leave, 0, 1)
            if idle > MAX_IDLE:
                tl.atomic_add(ctrl_ptr + 7, 1)


@triton.jit
def _publish_kernel(ctrl_ptr, phase, n_tiles, close):
    # Table entries are written before this runs (stream order); the count goes up, then
    # `closed`, both as atomics so the persistent programs see them in that order.
    tl.atomic_xchg(ctrl_ptr + 2 + phase, n_tiles)
    tl.atomic_xchg(ctrl_ptr + 4, close)


@triton.jit
def _wait_done_kernel(ctrl_ptr, phase, n_tiles, max_polls):
    # Returns once `n_tiles` tiles of `phase` are done (or after max_polls), so an event
    # recorded after it on the same stream marks the phase's completion.
    polls = 0
    while (tl.atomic_add(ctrl_ptr + 5 + phase, 0) < n_tiles) & (polls < max_polls):
        polls += 1


def publish(control: torch.Tensor, phase: int, n_tiles: int, *, close: bool = True) -> None:
    """Raise ``phase``'s published tile count to ``n_tiles`` (and ``closed``) from the current stream."""
    _publish_kernel[(1,)](control, phase, n_tiles, int(close), num_warps=1)


def wait_done(control: torch.Tensor, phase: int, n_tiles: int, max_polls: int = 1 << 30) -> None:
    """Enqueue a one-program kernel that returns when ``n_tiles`` tiles of ``phase`` are done."""
    _wait_done_kernel[(1,)](control, phase, n_tiles, max_polls, num_warps=1)


def _check_table(name: str, tab: torch.Tensor, R: int, G: int, N: int, BM: int, BN: int) -> None:
    check_tensor(name, tab, dim=2, dtypes=(torch.int32,))
    if tab.shape[1] != 4:
        raise ValueError(f"{name} has shape {tuple(tab.shape)}; allowed: [n, 4] rows (weight, row_start, "
                         f"row_end, n_block) from tile_table")
    if tab.numel() == 0 or tab.device.type != "cpu":
        return  # device tables are the caller's precondition (a check would sync)
    g, r0, r1, nb = tab.unbind(1)
    bad = ((g < 0) | (g >= G) | (r0 < 0) | (r1 > R) | (r1 <= r0) | (r1 - r0 > BM) | (nb < 0)
           | (nb * BN >= max(N, 1)))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(f"{name} row {i} = {tab[i].tolist()} is out of range; allowed: weight in [0, {G}), "
                         f"0 <= row_start < row_end <= {R}, at most tile_m = {BM} rows, n_block * {BN} < N = {N}")


def two_phase_grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, decode_table: torch.Tensor,
                         prefill_table: torch.Tensor, *, tile_m: int, tile_n: int, tile_k: int = 32,
                         programs: int, decode_programs: int, w3_GKN: torch.Tensor | None = None,
                         y_RN: torch.Tensor | None = None, control: torch.Tensor | None = None,
                         max_idle_polls: int = 1 << 20, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """One persistent launch over both tile tables; returns ``y_RN``.

    Args:
        x_RK: ``[R, K]`` rows of both phases (fp32/fp16/bf16).
        w_GKN: ``[G, K, N]`` weights (``w1`` with ``w3_GKN``: the SwiGLU gate/up pair, and
            then ``y = silu(x @ w1) * (x @ w3)``).
        decode_table, prefill_table: int32 ``[n, 4]`` from :func:`tile_table` with the same
            ``tile_m`` / ``tile_n``, on x's device. With a ``control`` block whose decode
            count is not yet published, ``decode_table`` is the full capacity.
        programs: persistent programs ``P`` (a GPU: its SM count).
        decode_programs: the decode share, ``0 <= decode_programs <= programs``.
        y_RN: output (default: zeros; rows no tile covers are left as they are).
        control: int32 ``[CTRL_WORDS]`` (default: both tables published, closed).
    """
    R, K = x_RK.shape
    G, Kw, N = w_GKN.shape
    if Kw != K:
        raise ValueError(f"w_GKN has K={Kw} but x_RK has K={K}; they must match")
    if w3_GKN is not None and (w3_GKN.shape != w_GKN.shape or w3_GKN.stride() != w_GKN.stride()):
        raise ValueError(f"w3_GKN has shape {tuple(w3_GKN.shape)}; it must match w_GKN {tuple(w_GKN.shape)} "
                         f"(same strides)")
    for name, tab in (("decode_table", decode_table), ("prefill_table", prefill_table)):
        _check_table(name, tab, R, G, N, tile_m, tile_n)
    programs = check_int("programs", programs)
    check_int("decode_programs", decode_programs, 0, programs)
    if y_RN is None:
        y_RN = torch.zeros((R, N), dtype=x_RK.dtype, device=x_RK.device)
    if control is None:
        control = control_words(decode_table.shape[0], prefill_table.shape[0], device=x_RK.device)
    tab = torch.cat([decode_table, prefill_table]).contiguous()
    if tab.numel() == 0:
        return y_RN
    w3 = w_GKN if w3_GKN is None else w3_GKN
    _two_phase_kernel[(programs,)](
        x_RK, w_GKN, w3, y_RN, tab, control, decode_table.shape[0], N, K, decode_programs, max_idle_polls,
        x_RK.stride(0), x_RK.stride(1), w_GKN.stride(0), w_GKN.stride(1), w_GKN.stride(2),
        y_RN.stride(0), y_RN.stride(1),
        GATED=w3_GKN is not None, UPCAST=tk.INTERPRET and x_RK.dtype == torch.bfloat16,
        IEEE=x_RK.dtype == torch.float32, FIX_BF16=tk.INTERPRET, BM=tile_m, BN=tile_n, BK=tile_k,
        num_warps=num_warps, num_stages=num_stages)
    return y_RN
