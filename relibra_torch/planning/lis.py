"""The Load-Imbalance Score (LIS) of expert loads.

R&Q (Replicate-and-Quantize) defines, per MoE layer,

    LIS = max_j n_j / (n * k / m)

with ``n_j`` the token-expert pairs of expert ``j``, ``n`` the tokens, ``k`` the top-k and
``m`` the experts: the heaviest expert's load against an equal split of the same pairs.
``1`` is perfect balance, ``m / k`` the worst (one expert takes every token). When every
token has ``k`` experts, ``n * k`` is the sum of the counts, so LIS is the max/mean of the
expert counts; with pad ids (fewer than ``k`` experts for some tokens) pass ``num_tokens``
to keep the definition's denominator.

LIS depends on the loads only, not on any plan or placement. Legend: E experts, ``...``
any leading dims (layers, micro-batches).
"""

from __future__ import annotations

import torch

__all__ = ["lis", "lis_summary"]


def lis(counts_E: torch.Tensor, num_tokens: torch.Tensor | int | None = None,
        top_k: int | None = None) -> torch.Tensor:
    """float64 ``[...]``: LIS of expert counts ``[..., E]`` (``nan`` where there are no pairs).

    Args:
        counts_E: int or float ``[..., E]`` token-expert pairs per expert.
        num_tokens: ``n``, broadcastable to ``[...]``; with ``top_k`` the denominator is
            ``n * k / E``. Default: the counts' sum (``n * k`` when no pair is a pad).
        top_k: ``k``; required with ``num_tokens``.
    """
    if not isinstance(counts_E, torch.Tensor) or counts_E.dim() < 1 or counts_E.shape[-1] < 1:
        raise ValueError(f"counts_E must be a tensor [..., E] with E >= 1, got "
                         f"{getattr(counts_E, 'shape', type(counts_E).__name__)}")
    c = counts_E.to(torch.float64)
    E = c.shape[-1]
    if num_tokens is None:
        pairs = c.sum(-1)
    else:
        if top_k is None or top_k < 1:
            raise ValueError(f"top_k={top_k!r}: allowed an int >= 1 when num_tokens is given")
        pairs = torch.as_tensor(num_tokens, dtype=torch.float64) * top_k
    mean = pairs / E
    return torch.where(mean > 0, c.max(-1).values / mean.clamp(min=1e-300), torch.full_like(mean, float("nan")))


def lis_summary(lis_values: torch.Tensor) -> dict[str, float | None]:
    """``{"lis_mean", "lis_max"}`` over the finite values of ``lis_values`` (``None`` when
    there are none: JSON has no nan)."""
    v = lis_values.flatten().to(torch.float64)
    v = v[torch.isfinite(v)]
    if v.numel() == 0:
        return {"lis_mean": None, "lis_max": None}
    return {"lis_mean": float(v.mean()), "lis_max": float(v.max())}
