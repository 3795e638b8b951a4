"""float64 references of the ops, evaluated on the tensors' own device, and the comparison rule.

The loop oracles of :mod:`relibra_torch.ops.oracle` run on the CPU element by element; the
GPU check needs the same rigour at GPU sizes (up to billions of elements), so these compute
the exact fp64 result and the absolute-product bound ``|A| @ |B|`` with one fp64 matmul per
slot on the device. :func:`within` applies the oracle's rule
``|actual - exact| <= TOL[dtype] * bound + ABS_FLOOR[dtype]`` and also fails on any NaN or
Inf (a NaN compares false against every bound, so it is counted explicitly: outputs are
allocated NaN-filled by :func:`poisoned_outputs`, and a row the kernel never wrote shows up
as NaN here).

Shape legend: T tokens, K top-k, R sorted rows, D hidden, S slots, G weights; grouped GEMM
operands x_RK / w_GKN / y_RN (K reduction dim, N output dim).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from relibra_torch.ops import oracle

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _slot_bounds(offsets_S: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offsets_S.tolist()]
    return list(zip([0] + ends[:-1], ends))


def _weight_index(slot_to_weight_S: torch.Tensor | None, S: int) -> list[int]:
    return list(range(S)) if slot_to_weight_S is None else [int(v) for v in slot_to_weight_S.tolist()]


def grouped_mm_f64(x_RK: torch.Tensor, w_GKN: torch.Tensor, offsets_S: torch.Tensor,
                   slot_to_weight_S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_RN, bound_RN)`` in fp64 on x's device; rows outside every slot are exactly 0."""
    y = torch.zeros(x_RK.shape[0], w_GKN.shape[2], dtype=torch.float64, device=x_RK.device)
    bound = torch.zeros_like(y)
    weights = _weight_index(slot_to_weight_S, offsets_S.shape[0])
    for s, (a, b) in enumerate(_slot_bounds(offsets_S)):
        if b > a:
            xs, w = x_RK[a:b].double(), w_GKN[weights[s]].double()
            y[a:b] = xs @ w
            bound[a:b] = xs.abs() @ w.abs()
    return y, bound


def grouped_mm_wgrad_f64(x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_S: torch.Tensor,
                         slot_to_weight_S: torch.Tensor | None,
                         num_weights: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dw_GKN, bound_GKN)`` in fp64; a weight no slot uses is exactly 0."""
    dw = torch.zeros(num_weights, x_RK.shape[1], dy_RN.shape[1], dtype=torch.float64, device=x_RK.device)
    bound = torch.zeros_like(dw)
    weights = _weight_index(slot_to_weight_S, offsets_S.shape[0])
    for s, (a, b) in enumerate(_slot_bounds(offsets_S)):
        if b > a:
            xs, ds = x_RK[a:b].double(), dy_RN[a:b].double()
            dw[weights[s]] += xs.t() @ ds
            bound[weights[s]] += xs.abs().t() @ ds.abs()
    return dw, bound


def unpermute_f64(y_RD: torch.Tensor, row_of_TK: torch.Tensor,
                  gates_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_TD, bound_TD)``: ``sum_k gates[t, k] * y[row_of[t, k]]`` in fp64."""
    T, K = row_of_TK.shape
    rows_TKD = y_RD.double().index_select(0, row_of_TK.reshape(-1)).view(T, K, y_RD.shape[1])
    g_TK = (torch.ones(T, K, dtype=torch.float64, device=y_RD.device) if gates_TK is None
            else gates_TK.double())
    return (rows_TKD * g_TK[..., None]).sum(1), (rows_TKD.abs() * g_TK.abs()[..., None]).sum(1)


def unpermute_backward_f64(dout_TD: torch.Tensor, y_RD: torch.Tensor, row_of_TK: torch.Tensor,
                           gates_TK: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor],
                                                            tuple[torch.Tensor, torch.Tensor]]:
    """``((dy_RD, bound), (dgates_TK, bound))`` in fp64; rows no token-slot reads get 0."""
    T, K = row_of_TK.shape
    R, D = y_RD.shape
    d64, g64 = dout_TD.double(), gates_TK.double()
    dy = torch.zeros(R, D, dtype=torch.float64, device=y_RD.device)
    dy[row_of_TK.reshape(-1)] = (g64[..., None] * d64[:, None]).reshape(T * K, D)
    rows_TKD = y_RD.double().index_select(0, row_of_TK.reshape(-1)).view(T, K, D)
    dg = (rows_TKD * d64[:, None]).sum(-1)
    dg_bound = (rows_TKD.abs() * d64.abs()[:, None]).sum(-1)
    return (dy, dy.abs()), (dg, dg_bound)


def within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype,
           what: str) -> float:
    """Check the oracle's error rule on the device; returns max(error / allowed) (<= 1).

    Raises AssertionError naming the first bad element, the number of bad and of non-finite
    elements (unwritten NaN-poisoned rows count as non-finite).
    """
    if tuple(actual.shape) != tuple(exact.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(exact.shape)}")
    if actual.numel() == 0:
        return 0.0
    exact, bound = exact.detach(), bound.detach()
    a64 = actual.detach().to(exact.device, torch.float64)
    err = (a64 - exact).abs()
    allowed = oracle.TOL[dtype] * bound + oracle.ABS_FLOOR[dtype]
    bad = ~(err <= allowed)  # NaN errors are bad too
    n_bad = int(bad.sum())
    if n_bad:
        n_nonfinite = int((~torch.isfinite(a64)).sum())
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what} ({str(dtype).replace('torch.', '')}): {n_bad} of {bad.numel()} elements off "
            f"({n_nonfinite} not finite); first at flat index {i}: got {a64.reshape(-1)[i].item()}, "
            f"exact {exact.reshape(-1)[i].item()}, allowed error {allowed.reshape(-1)[i].item():.3g}")
    return float((err / allowed).max())


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| in fp64 (NaN anywhere gives inf)."""
    a, e = actual.detach().double(), expected.detach().to(actual.device).double()
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a - e).abs().max() / e.abs().max().clamp(min=1e-30)) if a.numel() else 0.0


# Poison of int32/int64 outputs (row_of, offsets, per-block counts): no valid row, offset or count.
_POISON_INT = -(2**31) + 7


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    if t.dtype in (torch.int32, torch.int64):
        return t.fill_(_POISON_INT)
    return t


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Inside the block, ``torch.empty`` / ``torch.empty_like`` called from Python return
    NaN-filled float tensors (int32/int64 ones filled with a large negative number).

    The kernel launchers allocate their outputs with ``torch.empty``; a kernel that leaves
    any element unwritten then returns NaN (or an impossible index) there instead of
    whatever the allocator recycled, which may by chance be right. Only this thread's
    Python calls are affected, and only inside the block.
    """
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned_empty(*args, **kwargs):
        return _poison(empty(*args, **kwargs))

    def poisoned_empty_like(*args, **kwargs):
        return _poison(empty_like(*args, **kwargs))

    torch.empty, torch.empty_like = poisoned_empty, poisoned_empty_like
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def offsets_of(sizes: list[int], device: torch.device | str) -> torch.Tensor:
    """int32 ``[S]`` cumulative ends of slots with ``sizes`` rows."""
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, gen: torch.Generator,
          scale: float = 1.0) -> torch.Tensor:
    """Fresh normal values (drawn on the device from ``gen``), scaled, cast to ``dtype``."""
    return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)


def skewed_sizes(rows: int, slots: int, gen: torch.Generator) -> list[int]:
    """Zipf-like row counts summing to ``rows``, with about one slot in eight empty."""
    w = 1.0 / torch.arange(1, slots + 1, dtype=torch.float64) ** 1.2
    w[torch.randperm(slots, generator=gen)[: max(1, slots // 8)]] = 0.0
    w = w[torch.randperm(slots, generator=gen)]
    sizes = torch.floor(w / w.sum() * rows).to(torch.int64)
    sizes[int(torch.argmax(w))] += rows - int(sizes.sum())
    return [int(v) for v in sizes]
