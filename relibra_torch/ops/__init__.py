"""Token permutation and grouped GEMM for ``ReplayBalancedMoE``: Triton kernels + torch references.

Layout: the ragged contiguous layout of ``torch._grouped_mm``. Routed rows are sorted by
*slot* (a group: a native or a replica expert slot) in one ``[R, D]`` buffer without padding;
``offsets_S`` (int32) holds the cumulative end row of each slot, so slot s owns rows
``offsets[s-1]:offsets[s]`` (``0:offsets[0]`` for s = 0) and may be empty. A
``slot_to_weight_S`` index picks the weight of each slot, so several slots (an expert and
its replicas) can share one weight and replica slots need no special case; without it,
slot s uses weight s.

Ops (all differentiable where it makes sense, all ``torch.compile``-friendly custom ops):

* :func:`permute` -- sort token-slots by slot (histogram, prefix sum, stable scatter) and
  copy each token's row to its K sorted rows;
* :func:`unpermute` -- gather the rows back and sum the top-k contributions weighted by the
  gates, in fp32, deterministically (no atomics);
* :func:`grouped_gemm` -- per-slot ``x @ w[slot_to_weight[s]]``, fp32 accumulation, for
  fp32 / fp16 / bf16;
* :func:`expert_swiglu` -- a SwiGLU expert (torchtitan ``GroupedExperts`` convention) built
  from three grouped GEMMs.

Backend: Triton on CUDA tensors, the torch reference (``torch._grouped_mm``, index ops)
elsewhere; force either with ``RELIBRA_OPS_BACKEND`` in {auto, triton, torch},
:func:`set_backend` or :func:`use_backend`. See ``docs/ops.md``.

Shape legend (suffixes of tensor names):
  T tokens, K top-k (routed token-slots per token), R rows of the sorted buffer (T*K after
  permute), D hidden size, F expert intermediate size, S slots, G weights (experts);
  in grouped GEMM names x_RK / w_GKN / y_RN, K is the reduction dim and N the output dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from relibra_torch.checks import check_int, check_tensor
from relibra_torch.ops import custom_ops as _ops
from relibra_torch.ops.backend import (BACKENDS, ENV_VAR, get_backend, set_backend, use_backend,
                                       uses_triton)

__all__ = [
    "BACKENDS", "ENV_VAR", "get_backend", "set_backend", "use_backend", "uses_triton",
    "permute", "permute_index", "unpermute", "grouped_gemm", "expert_swiglu",
]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int16, torch.int32, torch.int64)


def _need_tensor(t: object, field: str) -> torch.Tensor:
    return check_tensor(field, t)


def _need_dim(t: torch.Tensor, field: str, ndim: int, shape_name: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{field} has shape {tuple(t.shape)}; allowed: {ndim}-D {shape_name}")


def _need_dtype(t: torch.Tensor, field: str, allowed: tuple[torch.dtype, ...]) -> None:
    check_tensor(field, t, dtypes=allowed)


def _need_device(t: torch.Tensor, field: str, ref: torch.Tensor, ref_field: str) -> None:
    if t.device != ref.device:
        raise ValueError(f"{field} is on {t.device}; allowed: {ref_field}'s device {ref.device}")


def permute_index(expert_slot_TK: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of token-slots by slot, without moving any data.

    Args:
      expert_slot_TK: int16/32/64 ``[T, K]``, slot of each token-slot, in ``[0, num_slots)``.
      num_slots: S >= 0.
    Returns:
      ``row_of_TK`` int64 ``[T, K]``: row of each token-slot in the sorted buffer; inside a
      slot, rows follow the flat ``t * K + k`` order.
      ``offsets_S`` int32 ``[S]``: cumulative end row of each slot.
    """
    _need_tensor(expert_slot_TK, "expert_slot_TK")
    _need_dim(expert_slot_TK, "expert_slot_TK", 2, "[T, K]")
    _need_dtype(expert_slot_TK, "expert_slot_TK", INDEX_DTYPES)
    check_int("num_slots", num_slots, 0)
    if num_slots == 0 and expert_slot_TK.numel():
        raise ValueError("num_slots=0 but expert_slot_TK is not empty; allowed: num_slots >= 1")
    return _ops.permute_index(expert_slot_TK, num_slots)


def permute(expert_slot_TK: torch.Tensor, x_TD: torch.Tensor,
            num_slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token rows by slot for the grouped GEMM.

    Args:
      expert_slot_TK: int16/32/64 ``[T, K]``, slot of each token-slot in ``[0, num_slots)``
        (an expert id, or the plan's choice among an expert's native and replica slots).
      x_TD: ``[T, D]`` token rows (any float dtype).
      num_slots: S.
    Returns:
      ``x_sorted_RD`` ``[T*K, D]``: row ``row_of[t, k]`` is ``x_TD[t]``; differentiable w.r.t.
      ``x_TD`` (the gradient sums a token's K rows).
      ``row_of_TK`` int64 ``[T, K]`` and ``offsets_S`` int32 ``[S]`` as in :func:`permute_index`.
    """
    _need_tensor(x_TD, "x_TD")
    _need_dim(x_TD, "x_TD", 2, "[T, D]")
    _need_tensor(expert_slot_TK, "expert_slot_TK")
    _need_dim(expert_slot_TK, "expert_slot_TK", 2, "[T, K]")
    if expert_slot_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"expert_slot_TK has T={expert_slot_TK.shape[0]} rows but x_TD has "
                         f"T={x_TD.shape[0]}; they must match")
    _need_device(expert_slot_TK, "expert_slot_TK", x_TD, "x_TD")
    row_of_TK, offsets_S = permute_index(expert_slot_TK, num_slots)
    x_sorted_RD = _ops.permute_rows(x_TD, row_of_TK)
    return x_sorted_RD, row_of_TK, offsets_S


def unpermute(y_sorted_RD: torch.Tensor, row_of_TK: torch.Tensor,
              gates_TK: torch.Tensor | None) -> torch.Tensor:
    """Combine the sorted rows back per token: ``out[t] = sum_k gates[t, k] * y[row_of[t, k]]``.

    Args:
      y_sorted_RD: ``[R, D]`` float rows (R >= T*K; usually R = T*K from :func:`permute`).
      row_of_TK: int64 ``[T, K]``, distinct rows in ``[0, R)`` (from :func:`permute`).
      gates_TK: float ``[T, K]`` gate weights, or None for all ones.
    Returns:
      ``out_TD`` ``[T, D]`` in y's dtype, accumulated in fp32 in a fixed order (no atomics,
      bit-reproducible); differentiable w.r.t. ``y_sorted_RD`` and ``gates_TK``.
    """
    _need_tensor(y_sorted_RD, "y_sorted_RD")
    _need_dim(y_sorted_RD, "y_sorted_RD", 2, "[R, D]")
    _need_dtype(y_sorted_RD, "y_sorted_RD", FLOAT_DTYPES)
    _need_tensor(row_of_TK, "row_of_TK")
    _need_dim(row_of_TK, "row_of_TK", 2, "[T, K]")
    _need_dtype(row_of_TK, "row_of_TK", (torch.int64,))
    _need_device(row_of_TK, "row_of_TK", y_sorted_RD, "y_sorted_RD")
    if gates_TK is not None:
        _need_tensor(gates_TK, "gates_TK")
        _need_dtype(gates_TK, "gates_TK", FLOAT_DTYPES)
        if tuple(gates_TK.shape) != tuple(row_of_TK.shape):
            raise ValueError(f"gates_TK has shape {tuple(gates_TK.shape)}; it must match row_of_TK "
                             f"{tuple(row_of_TK.shape)}")
        _need_device(gates_TK, "gates_TK", y_sorted_RD, "y_sorted_RD")
    return _ops.unpermute_rows(y_sorted_RD, row_of_TK, gates_TK)


def grouped_gemm(x_RK: torch.Tensor, w_GKN: torch.Tensor, offsets_S: torch.Tensor,
                 slot_to_weight_S: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped GEMM over the ragged slot layout.

    Args:
      x_RK: ``[R, K]`` fp32/fp16/bf16 rows sorted by slot.
      w_GKN: ``[G, K, N]`` weights, same dtype as x; any strides (a transposed view is fine).
      offsets_S: int32 ``[S]`` cumulative end rows, non-decreasing, ``offsets[-1] <= R``.
      slot_to_weight_S: int32/int64 ``[S]`` weight of each slot in ``[0, G)``; None means
        slot s uses weight s (then S must equal G).
    Returns:
      ``y_RN`` ``[R, N]`` in x's dtype: rows of slot s are ``x @ w[slot_to_weight[s]]`` with fp32
      accumulation; rows past ``offsets[-1]`` are 0. Differentiable w.r.t. x and w (the
      weight gradient sums over the slots that share a weight; unused weights get 0).
    """
    _need_tensor(x_RK, "x_RK")
    _need_tensor(w_GKN, "w_GKN")
    _need_tensor(offsets_S, "offsets_S")
    _need_dim(x_RK, "x_RK", 2, "[R, K]")
    _need_dim(w_GKN, "w_GKN", 3, "[G, K, N]")
    _need_dim(offsets_S, "offsets_S", 1, "[S]")
    _need_dtype(x_RK, "x_RK", FLOAT_DTYPES)
    if w_GKN.dtype != x_RK.dtype:
        raise TypeError(f"w_GKN has dtype {w_GKN.dtype} but x_RK has {x_RK.dtype}; they must match")
    _need_dtype(offsets_S, "offsets_S", (torch.int32,))
    if w_GKN.shape[1] != x_RK.shape[1]:
        raise ValueError(f"w_GKN has K={w_GKN.shape[1]} but x_RK has K={x_RK.shape[1]}; they must match")
    _need_device(w_GKN, "w_GKN", x_RK, "x_RK")
    _need_device(offsets_S, "offsets_S", x_RK, "x_RK")
    S = offsets_S.shape[0]
    if slot_to_weight_S is None:
        if w_GKN.shape[0] != S:
            raise ValueError(f"w_GKN has G = {w_GKN.shape[0]} weights; allowed: G = S = {S} (slot_to_weight_S is None)")
    else:
        _need_tensor(slot_to_weight_S, "slot_to_weight_S")
        _need_dim(slot_to_weight_S, "slot_to_weight_S", 1, "[S]")
        _need_dtype(slot_to_weight_S, "slot_to_weight_S", (torch.int32, torch.int64))
        if slot_to_weight_S.shape[0] != S:
            raise ValueError(f"slot_to_weight_S has {slot_to_weight_S.shape[0]} entries; it needs S={S}")
        _need_device(slot_to_weight_S, "slot_to_weight_S", x_RK, "x_RK")
        slot_to_weight_S = slot_to_weight_S.to(torch.int64)
    return _ops.grouped_mm(x_RK, w_GKN, offsets_S, slot_to_weight_S)


def expert_swiglu(x_RD: torch.Tensor, w1_GDF: torch.Tensor, w2_GFD: torch.Tensor, w3_GDF: torch.Tensor,
                  offsets_S: torch.Tensor, slot_to_weight_S: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU experts over the slot layout: ``h = silu(x @ w1) * (x @ w3)``, ``y = h @ w2``.

    Same convention as torchtitan's ``GroupedExperts`` (w1 gate, w3 up, w2 down), with the
    weights laid out ``[G, in, out]``.

    Args:
      x_RD: ``[R, D]`` rows sorted by slot; w1_GDF, w3_GDF: ``[G, D, F]``; w2_GFD: ``[G, F, D]``.
      offsets_S, slot_to_weight_S: as in :func:`grouped_gemm`.
    Returns:
      ``y_RD`` ``[R, D]`` (rows past ``offsets[-1]`` are 0).
    """
    h1_RF = grouped_gemm(x_RD, w1_GDF, offsets_S, slot_to_weight_S)
    h3_RF = grouped_gemm(x_RD, w3_GDF, offsets_S, slot_to_weight_S)
    h_RF = F.silu(h1_RF) * h3_RF
    return grouped_gemm(h_RF, w2_GFD, offsets_S, slot_to_weight_S)
