"""Torch reference implementations of the ops (the path used off CUDA, and the test oracle).

Pure functions of their inputs with the same contracts as the Triton launchers in
:mod:`relibra_torch.ops.triton_kernels`. Built from ``torch._grouped_mm`` and index ops only,
without device-to-host synchronisation, so they also run under ``torch.compile`` and on CUDA.

Shape legend (suffixes of tensor names):
  T tokens, K top-k (routed slots per token), n = T*K flattened token-slots,
  R rows of the sorted (permuted) buffer, D hidden size,
  S slots (groups of the grouped GEMM; native or replica), G weights (experts),
  Kd reduction dim of a GEMM (written K in grouped-GEMM names: x_RK, w_GKN), N output columns.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def permute_index(expert_slot_TK: torch.Tensor, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stable sort of token-slots by slot.

    Args:
      expert_slot_TK: integer ``[T, K]``, values in ``[0, num_slots)``.
      num_slots: S.
    Returns:
      ``row_of_TK`` int64 ``[T, K]`` (row of each token-slot in the sorted buffer; rows of a
      slot keep the flat ``t * K + k`` order) and ``offsets_S`` int32 ``[S]`` (cumulative ends).
    """
    T, K = expert_slot_TK.shape
    flat_n = expert_slot_TK.reshape(-1).to(torch.int64)
    n = flat_n.numel()
    order_n = torch.argsort(flat_n, stable=True)
    arange_n = torch.arange(n, device=flat_n.device, dtype=torch.int64)
    row_of_n = torch.empty_like(flat_n).scatter_(0, order_n, arange_n)
    # scatter_add instead of bincount: bincount's output size depends on the data.
    counts_S = torch.zeros(num_slots, dtype=torch.int64, device=flat_n.device)
    counts_S.scatter_add_(0, flat_n, torch.ones_like(flat_n))
    offsets_S = torch.cumsum(counts_S, 0).to(torch.int32)
    return row_of_n.view(T, K), offsets_S


def permute_rows(x_TD: torch.Tensor, row_of_TK: torch.Tensor) -> torch.Tensor:
    """``x_RD[row_of[t, k]] = x_TD[t]``, R = T*K (row_of must be a permutation of [0, R))."""
    T, K = row_of_TK.shape
    src_RD = x_TD.unsqueeze(1).expand(T, K, x_TD.shape[1]).reshape(T * K, x_TD.shape[1])
    out = torch.empty_like(src_RD)
    return out.index_copy_(0, row_of_TK.reshape(-1), src_RD)


def unpermute(y_RD: torch.Tensor, row_of_TK: torch.Tensor, gates_TK: torch.Tensor | None) -> torch.Tensor:
    """``out_TD[t] = sum_k gates[t, k] * y_RD[row_of[t, k]]`` in fp32, cast to y's dtype.

    ``gates_TK=None`` means all ones (the backward of :func:`permute_rows`).
    """
    T, K = row_of_TK.shape
    rows_TKD = y_RD.index_select(0, row_of_TK.reshape(-1)).view(T, K, y_RD.shape[1])
    if gates_TK is None:
        return rows_TKD.sum(1, dtype=torch.float32).to(y_RD.dtype)
    # [T, 1, K] @ [T, K, D]: the weighted sum over k in one fp32 batched product, with no
    # [T, K, D] temporary for the products.
    out_T1D = torch.bmm(gates_TK.float().unsqueeze(1), rows_TKD.float())
    return out_T1D.squeeze(1).to(y_RD.dtype)


def unpermute_backward(dout_TD: torch.Tensor, y_RD: torch.Tensor, row_of_TK: torch.Tensor,
                       gates_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients ``(dy_RD, dgates_TK)`` of :func:`unpermute`; rows no token-slot reads get 0."""
    T, K = row_of_TK.shape
    R, D = y_RD.shape
    flat_n = row_of_TK.reshape(-1)
    dout32_TD = dout_TD.float()
    dy_nD = (gates_TK.float().unsqueeze(-1) * dout32_TD.unsqueeze(1)).reshape(T * K, D)
    # Every row is read exactly once when R == T*K (row_of is then a permutation): no need
    # to zero-fill first.
    alloc = torch.empty if R == T * K else torch.zeros
    dy_RD = alloc((R, D), dtype=y_RD.dtype, device=y_RD.device)
    dy_RD.index_copy_(0, flat_n, dy_nD.to(y_RD.dtype))
    y_TKD = y_RD.index_select(0, flat_n).view(T, K, D).float()
    dgates_TK = torch.bmm(y_TKD, dout32_TD.unsqueeze(-1)).squeeze(-1).to(gates_TK.dtype)
    return dy_RD, dgates_TK


def _align(dtype: torch.dtype) -> int:
    # torch._grouped_mm needs every stride to be a multiple of 16 bytes.
    return max(1, 16 // torch.empty((), dtype=dtype).element_size())


def _pad_last(t: torch.Tensor, mult: int) -> torch.Tensor:
    extra = (-t.shape[-1]) % mult
    return F.pad(t, (0, extra)) if extra else t


def _row_mask(R: int, offsets_S: torch.Tensor) -> torch.Tensor | None:
    """``[R]`` bool, rows inside the groups; ``None`` when every row is (checked on CPU only,
    where reading ``offsets[-1]`` costs no device sync: the common case, all rows grouped,
    then skips a masking pass over the whole output)."""
    if offsets_S.device.type == "cpu" and int(offsets_S[-1]) == R:
        return None
    return torch.arange(R, device=offsets_S.device) < offsets_S[-1].to(torch.int64)


def _zero_rows_past_groups(t_RX: torch.Tensor, offsets_S: torch.Tensor) -> torch.Tensor:
    mask_R = _row_mask(t_RX.shape[0], offsets_S)
    return t_RX if mask_R is None else torch.where(mask_R.unsqueeze(1), t_RX, 0)


def grouped_mm(x_RK: torch.Tensor, w_GKN: torch.Tensor, offsets_S: torch.Tensor,
               slot_to_weight_S: torch.Tensor | None) -> torch.Tensor:
    """``y_RN``: rows of slot s (``offsets[s-1]:offsets[s]``) times ``w[slot_to_weight[s]]``.

    Rows past ``offsets[-1]`` are 0 (``torch._grouped_mm`` leaves them undefined).
    """
    R, Kd = x_RK.shape
    N = w_GKN.shape[2]
    S = offsets_S.shape[0]
    if S == 0 or R == 0:
        return x_RK.new_zeros((R, N))
    w_SKN = w_GKN.index_select(0, slot_to_weight_S) if slot_to_weight_S is not None else w_GKN
    a = _align(x_RK.dtype)
    if Kd % a or N % a:
        x_in = _pad_last(x_RK, a).contiguous()
        w_in = _pad_last(F.pad(w_SKN, (0, 0, 0, x_in.shape[1] - Kd)), a).contiguous()
    else:
        # Aligned: torch._grouped_mm takes w row- or column-major (e.g. a transposed
        # parameter), so no copy of the weights.
        x_in = x_RK.contiguous()
        w_in = w_SKN if 1 in (w_SKN.stride(1), w_SKN.stride(2)) else w_SKN.contiguous()
    y_RN = torch._grouped_mm(x_in, w_in, offs=offsets_S)[:, :N]
    return _zero_rows_past_groups(y_RN, offsets_S).contiguous()


def grouped_mm_wgrad(x_RK: torch.Tensor, dy_RN: torch.Tensor, offsets_S: torch.Tensor,
                     slot_to_weight_S: torch.Tensor | None, num_weights: int) -> torch.Tensor:
    """``dw_GKN[g] = sum_{s: s2w[s] = g} x[rows of s]^T @ dy[rows of s]``; 0 for unused g.

    Per-slot products come from ``torch._grouped_mm``; slots sharing a weight are summed
    in fp32 with a one-hot matmul (deterministic on every device, unlike ``index_add_``).
    """
    R, Kd = x_RK.shape
    N = dy_RN.shape[1]
    S = offsets_S.shape[0]
    if S == 0 or R == 0:
        return x_RK.new_zeros((num_weights, Kd, N))
    a = _align(x_RK.dtype)
    x_pad = _pad_last(_zero_rows_past_groups(x_RK, offsets_S), a)
    dy_pad = _pad_last(_zero_rows_past_groups(dy_RN, offsets_S), a)
    # Rows padded to a multiple of the alignment: the transposed operand's stride is R.
    extra_r = (-R) % a
    if extra_r:
        x_pad = F.pad(x_pad, (0, 0, 0, extra_r))
        dy_pad = F.pad(dy_pad, (0, 0, 0, extra_r))
    xt = x_pad.t().contiguous()
    dw_SKN = torch._grouped_mm(xt, dy_pad.contiguous(), offs=offsets_S)[:, :Kd, :N]
    if slot_to_weight_S is None:
        return dw_SKN.contiguous()
    onehot_GS = (torch.arange(num_weights, device=x_RK.device).unsqueeze(1)
                 == slot_to_weight_S.unsqueeze(0)).float()
    dw_GX = onehot_GS @ dw_SKN.reshape(S, Kd * N).float()
    return dw_GX.view(num_weights, Kd, N).to(x_RK.dtype)
