"""Slow, obviously-correct fp64 loop oracles for the ops, with error bounds (tests, benchmark checks).

Each grouped oracle returns the exact result in fp64 together with ``|A| @ |B|`` (the sum of
absolute products), which bounds every rounding error of an fp32-accumulating
implementation: ``|out - exact| <= tol(dtype) * bound``. :func:`check_within` applies it.

Shape legend: T tokens, K top-k, R sorted rows, D hidden, S slots, G weights; in grouped GEMM
names x_RK / w_GKN / y_RN, K is the reduction dim and N the output dim.
"""

from __future__ import annotations

import torch

# Relative tolerance per dtype against the absolute-product bound: the output's own
# rounding (half an ulp), fp32 accumulation, and for bf16/fp16 one extra rounding of per-slot
# partial sums in the torch reference's weight gradient.
TOL = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}
# Absolute floor: the spacing of subnormals, where relative rounding bounds stop holding.
ABS_FLOOR = {torch.float32: 2.0**-149, torch.float16: 2.0**-24, torch.bfloat16: 2.0**-133}


def _bounds(offsets_S: torch.Tensor) -> list[tuple[int, int]]:
    ends = [int(v) for v in offsets_S.tolist()]
    starts = [0] + ends[:-1]
    return list(zip(starts, ends))


def _weight_of(slot_to_weight_S: torch.Tensor | None, s: int) -> int:
    return s if slot_to_weight_S is None else int(slot_to_weight_S[s])


def permute_index(expert_slot_TK: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_of_TK, offsets_S)`` by bucketing token-slots in flat order (a stable sort)."""
    T, K = expert_slot_TK.shape
    flat = [int(v) for v in expert_slot_TK.reshape(-1).tolist()]
    buckets: list[list[int]] = [[] for _ in range(num_slots)]
    for i, s in enumerate(flat):
        buckets[s].append(i)
    row_of = [0] * len(flat)
    row = 0
    ends = []
    for b in buckets:
        for i in b:
            row_of[i] = row
            row += 1
        ends.append(row)
    return (torch.tensor(row_of, dtype=torch.int64).view(T, K),
            torch.tensor(ends, dtype=torch.int32))


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, offsets_S: torch.Tensor,
               slot_to_weight_S: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_RN, bound_RN)`` in fp64; rows outside every slot are 0."""
    x = x_RK.double().cpu()
    w = w_GKN.double().cpu()
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    bound = torch.zeros_like(y)
    for s, (a, b) in enumerate(_bounds(offsets_S.cpu())):
        g = _weight_of(slot_to_weight_S, s)
        y[a:b] = x[a:b] @ w[g]
        bound[a:b] = x[a:b].abs() @ w[g].abs()
    return y, bound


def grouped_mm_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_S: torch.Tensor,
                     slot_to_weight_S: torch.Tensor | None, num_weights: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dw_GKN, bound_GKN)`` in fp64; weights no slot uses are 0."""
    x = x_RK.double().cpu()
    dy = dy_RN.double().cpu()
    dw = torch.zeros(num_weights, x.shape[1], dy.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(dw)
    for s, (a, b) in enumerate(_bounds(offsets_S.cpu())):
        g = _weight_of(slot_to_weight_S, s)
        dw[g] += x[a:b].t() @ dy[a:b]
        bound[g] += x[a:b].abs().t() @ dy[a:b].abs()
    return dw, bound


def unpermute(y_RD: torch.Tensor, row_of_TK: torch.Tensor,
              gates_TK: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_TD, bound_TD)`` in fp64 by a loop over token-slots."""
    y = y_RD.double().cpu()
    T, K = row_of_TK.shape
    out = torch.zeros(T, y.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(out)
    for t in range(T):
        for k in range(K):
            g = 1.0 if gates_TK is None else float(gates_TK[t, k])
            r = int(row_of_TK[t, k])
            out[t] += g * y[r]
            bound[t] += abs(g) * y[r].abs()
    return out, bound


def check_within(actual: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype,
                 what: str) -> None:
    """Raise AssertionError unless ``|actual - exact| <= TOL[dtype] * bound + ABS_FLOOR[dtype]``."""
    if tuple(actual.shape) != tuple(exact.shape):
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != expected {tuple(exact.shape)}")
    err = (actual.double().cpu() - exact).abs()
    allowed = TOL[dtype] * bound + ABS_FLOOR[dtype]
    bad = err > allowed
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0])
        raise AssertionError(
            f"{what} ({dtype}): {int(bad.sum())} of {bad.numel()} elements off; first at flat index {i}: "
            f"got {actual.reshape(-1)[i].item()}, exact {exact.reshape(-1)[i].item()}, "
            f"allowed error {allowed.reshape(-1)[i].item():.3g}")
