"""``torch.library`` custom ops (namespace ``relibra``) with fake kernels and autograd.

Each op's implementation picks the Triton kernels or the torch reference at run time
(:func:`relibra_torch.ops.backend.uses_triton`); the fake (meta) kernels give shapes to
``torch.compile``, and ``register_autograd`` wires the backward ops, so the ops compose with
compiled graphs and keep their gradients.

Shape legend: see :mod:`relibra_torch.ops` (T tokens, K top-k, R sorted rows, D hidden,
S slots, G weights, x_RK / w_GKN / y_RN the grouped GEMM operands).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from relibra_torch.ops import reference
from relibra_torch.ops.backend import uses_triton

_kernels: ModuleType | None = None


def _triton(device: torch.device) -> ModuleType:
    """The Triton kernel module, imported on first use (see its docstring for why)."""
    global _kernels
    if _kernels is None:
        _kernels = importlib.import_module("relibra_torch.ops.triton_kernels")
    if device.type != "cuda" and not _kernels.INTERPRET:
        raise RuntimeError(
            "the Triton kernels were loaded without the interpreter (TRITON_INTERPRET was not 1 "
            f"when relibra_torch.ops.triton_kernels was imported), so they cannot run on "
            f"{device.type} tensors; set TRITON_INTERPRET=1 earlier or use backend 'torch'")
    return _kernels


def _impl(device: torch.device) -> ModuleType:
    return _triton(device) if uses_triton(device) else reference


def _cpu_eager(t: torch.Tensor) -> bool:
    # Value checks read tensor data: free on CPU, a device sync on CUDA, so CPU only.
    return t.device.type == "cpu"


# ----------------------------------------------------------------------------------------
# permute_index
# ----------------------------------------------------------------------------------------


@torch.library.custom_op("relibra::permute_index", mutates_args=())
def permute_index(expert_slot: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_of_TK int64, offsets_S int32)`` of the stable sort of ``expert_slot`` ``[T, K]``."""
    if _cpu_eager(expert_slot) and expert_slot.numel():
        lo, hi = int(expert_slot.min()), int(expert_slot.max())
        if lo < 0 or hi >= num_slots:
            raise ValueError(f"expert_slot_TK has values in [{lo}, {hi}]; allowed: [0, num_slots={num_slots})")
    return _impl(expert_slot.device).permute_index(expert_slot, num_slots)


@permute_index.register_fake
def _(expert_slot, num_slots):
    return (expert_slot.new_empty(expert_slot.shape, dtype=torch.int64),
            expert_slot.new_empty((num_slots,), dtype=torch.int32))


# ----------------------------------------------------------------------------------------
# permute_rows / unpermute
# ----------------------------------------------------------------------------------------


def _check_row_of(row_of: torch.Tensor, num_rows: int) -> None:
    if _cpu_eager(row_of) and row_of.numel():
        flat = row_of.reshape(-1)
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= num_rows:
            raise ValueError(f"row_of_TK has values in [{lo}, {hi}]; allowed: [0, {num_rows})")
        if torch.unique(flat).numel() != flat.numel():
            raise ValueError("row_of_TK has repeated rows; every token-slot needs its own row")


@torch.library.custom_op("relibra::permute_rows", mutates_args=())
def permute_rows(x: torch.Tensor, row_of: torch.Tensor) -> torch.Tensor:
    """``x_RD[row_of[t, k]] = x_TD[t]`` with R = T*K."""
    _check_row_of(row_of, row_of.numel())
    return _impl(x.device).permute_rows(x, row_of)


@permute_rows.register_fake
def _(x, row_of):
    return x.new_empty((row_of.shape[0] * row_of.shape[1], x.shape[1]))


def _permute_rows_setup(ctx, inputs, output):
    _, row_of = inputs
    ctx.save_for_backward(row_of)


def _permute_rows_backward(ctx, grad):
    (row_of,) = ctx.saved_tensors
    return unpermute_rows(grad.contiguous(), row_of, None), None


permute_rows.register_autograd(_permute_rows_backward, setup_context=_permute_rows_setup)


@torch.library.custom_op("relibra::unpermute_rows", mutates_args=())
def unpermute_rows(y: torch.Tensor, row_of: torch.Tensor, gates: torch.Tensor | None) -> torch.Tensor:
    """``out_TD[t] = sum_k gates[t, k] * y_RD[row_of[t, k]]`` (gates None: all ones)."""
    _check_row_of(row_of, y.shape[0])
    return _impl(y.device).unpermute(y, row_of, gates)


@unpermute_rows.register_fake
def _(y, row_of, gates):
    return y.new_empty((row_of.shape[0], y.shape[1]))


def _unpermute_setup(ctx, inputs, output):
    y, row_of, gates = inputs
    ctx.has_gates = gates is not None
    ctx.save_for_backward(y, row_of, gates if gates is not None else row_of)


def _unpermute_backward(ctx, grad):
    y, row_of, gates = ctx.saved_tensors
    if not ctx.has_gates:
        if y.shape[0] == row_of.numel():
            # Ones-gates over a full permutation: each token's gradient copied into its rows.
            return permute_rows(grad.contiguous(), row_of), None, None
        ones = torch.ones(row_of.shape, dtype=torch.float32, device=y.device)
        dy, _ = unpermute_rows_backward(grad.contiguous(), y, row_of, ones)
        return dy, None, None
    dy, dgates = unpermute_rows_backward(grad.contiguous(), y, row_of, gates)
    return dy, None, dgates


unpermute_rows.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


@torch.library.custom_op("relibra::unpermute_rows_backward", mutates_args=())
def unpermute_rows_backward(grad: torch.Tensor, y: torch.Tensor, row_of: torch.Tensor,
                            gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy_RD, dgates_TK)`` of :func:`unpermute_rows` given ``grad`` = d out_TD."""
    return _impl(y.device).unpermute_backward(grad, y, row_of, gates)


@unpermute_rows_backward.register_fake
def _(grad, y, row_of, gates):
    return torch.empty_like(y), torch.empty_like(gates)


# ----------------------------------------------------------------------------------------
# grouped GEMM
# ----------------------------------------------------------------------------------------


def _check_groups(R: int, offsets: torch.Tensor, s2w: torch.Tensor | None, num_weights: int) -> None:
    if not _cpu_eager(offsets) or offsets.numel() == 0:
        return
    o = offsets.to(torch.int64)
    if int(o[0]) < 0 or bool((o[1:] < o[:-1]).any()) or int(o[-1]) > R:
        raise ValueError(f"offsets_S = {offsets.tolist()}; allowed: non-decreasing cumulative ends in [0, R={R}]")
    if s2w is not None and s2w.numel():
        lo, hi = int(s2w.min()), int(s2w.max())
        if lo < 0 or hi >= num_weights:
            raise ValueError(f"slot_to_weight_S has values in [{lo}, {hi}]; allowed: [0, G={num_weights})")


@torch.library.custom_op("relibra::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               slot_to_weight: torch.Tensor | None) -> torch.Tensor:
    """``y_RN``: rows of slot s times ``w_GKN[slot_to_weight[s]]``; rows past offsets[-1] are 0."""
    _check_groups(x.shape[0], offsets, slot_to_weight, w.shape[0])
    return _impl(x.device).grouped_mm(x, w, offsets, slot_to_weight)


@grouped_mm.register_fake
def _(x, w, offsets, slot_to_weight):
    return x.new_empty((x.shape[0], w.shape[2]))


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offsets, s2w = inputs
    ctx.has_s2w = s2w is not None
    ctx.num_weights = w.shape[0]
    ctx.save_for_backward(x, w, offsets, s2w if s2w is not None else offsets)


def _grouped_mm_backward(ctx, grad):
    x, w, offsets, s2w = ctx.saved_tensors
    s2w = s2w if ctx.has_s2w else None
    grad = grad.contiguous()
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = grouped_mm(grad, w.transpose(1, 2), offsets, s2w)
    if ctx.needs_input_grad[1]:
        if w.stride(1) == 1 and w.stride(2) != 1:
            # w is a transposed view (the layer passes torchtitan-layout [G, N, K] weights
            # as [G, K, N]): compute dw^T and return its transpose, so the gradient has the
            # parameter's own layout and autograd does not copy it into place.
            dw = grouped_mm_wgrad(grad, x, offsets, s2w, ctx.num_weights).transpose(1, 2)
        else:
            dw = grouped_mm_wgrad(x, grad, offsets, s2w, ctx.num_weights)
    return dx, dw, None, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


@torch.library.custom_op("relibra::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor,
                     slot_to_weight: torch.Tensor | None, num_weights: int) -> torch.Tensor:
    """``dw_GKN[g] = sum over slots s of weight g of x[rows of s]^T dy[rows of s]``."""
    return _impl(x.device).grouped_mm_wgrad(x, dy, offsets, slot_to_weight, num_weights)


@grouped_mm_wgrad.register_fake
def _(x, dy, offsets, slot_to_weight, num_weights):
    return x.new_empty((num_weights, x.shape[1], dy.shape[1]))
