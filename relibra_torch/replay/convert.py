"""Converters from the routing-replay layouts of RL frameworks to :class:`RoutingReplay`.

* verl (router replay "R3"): one padded batch, ``routed_experts [B, P, L, K]`` with an
  ``attention_mask [B, P]`` that marks real tokens (left-padded prompts and right-padded
  responses both work: the masked positions of each row are taken in position order).
* slime / SGLang: one ``[T_i, L, K]`` array per sample (SGLang returns it per request,
  slime keeps it per sample); the samples are concatenated in the given order.

Inputs may be torch tensors or anything ``torch.as_tensor`` accepts (numpy arrays, lists).
Integer ids of any width are accepted (int16/int32/int64 kept, narrower ones widened to
int32, unsigned 32/64-bit to int64); floats and bools are refused.

Shape legend:
  B  batch rows   P  padded positions (max_seq_len)   T  tokens   L  MoE layers   K  top-k
  N  samples
"""

from __future__ import annotations

from typing import Sequence

import torch

from .fileio import dtype_name
from .routing import RoutingReplay

__all__ = ["from_verl", "from_per_sample", "from_slime", "from_sglang"]


def _as_ids(value, name: str, keep_width: bool = False) -> torch.Tensor:
    try:
        value = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{name} cannot be read as a tensor ({' '.join(str(exc).split())}); allowed: an integer array") from None
    if value.dtype.is_floating_point or value.is_complex() or value.dtype == torch.bool:
        raise ValueError(f"{name} has dtype {dtype_name(value.dtype)}; allowed: an integer dtype")
    if keep_width and value.dtype in (torch.int16, torch.int32, torch.int64):
        return value.cpu()
    if keep_width and value.dtype in (torch.int8, torch.uint8, torch.uint16):
        return value.to("cpu", torch.int32)  # widening, never truncating
    return value.to("cpu", torch.int64)


def from_verl(
    routed_experts_BPLK,
    attention_mask_BP,
    num_experts: int,
    *,
    model: str | None = None,
    sample_step=None,
    sample_task=None,
) -> RoutingReplay:
    """Convert a verl-style padded batch to a replay (one sample per batch row).

    Args:
        routed_experts_BPLK: integer ``[B, P, L, K]``; values at padded positions are ignored.
        attention_mask_BP: ``[B, P]`` bool or 0/1 integers; every row needs >= 1 token.
        num_experts: ``E``.
        model, sample_step, sample_task: as in :func:`save_routing` (``[B]`` per-sample).
    """
    routed = _as_ids(routed_experts_BPLK, "routed_experts", keep_width=True)
    mask = torch.as_tensor(attention_mask_BP).cpu()
    if routed.dim() != 4:
        raise ValueError(f"routed_experts has shape {tuple(routed.shape)}; allowed: [batch, max_seq_len, num_layers, top_k]")
    if tuple(mask.shape) != tuple(routed.shape[:2]):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}; allowed: [batch, max_seq_len] = {list(routed.shape[:2])}"
        )
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or mask.is_complex():
            raise ValueError(f"attention_mask has dtype {dtype_name(mask.dtype)}; allowed: bool or integer 0/1")
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            b, p = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"attention_mask[{b}, {p}] = {int(mask[b, p])}; allowed: 0 or 1")
        mask = mask.bool()
    lengths_B = mask.sum(dim=1)
    if bool((lengths_B == 0).any()):
        b = int((lengths_B == 0).nonzero()[0, 0])
        raise ValueError(f"attention_mask[{b}] has no tokens; allowed: at least one token per sample")
    offsets = torch.zeros(routed.shape[0] + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths_B, 0)
    # Boolean indexing over the first two dims keeps row-major (sample, position) order.
    return RoutingReplay(
        routed[mask], offsets, num_experts, model=model,
        sample_step=None if sample_step is None else _as_ids(sample_step, "sample_step"),
        sample_task=None if sample_task is None else _as_ids(sample_task, "sample_task"),
    )


def from_per_sample(
    routed_experts_per_sample: Sequence,
    num_experts: int,
    *,
    model: str | None = None,
    sample_step=None,
    sample_task=None,
    coverage: str | None = None,
) -> RoutingReplay:
    """Convert a list of per-sample ``[T_i, L, K]`` arrays (slime / SGLang) to a replay.

    Every sample needs >= 1 token and the same ``L`` and ``K``. ``coverage``: as in
    :func:`relibra_torch.replay.save_routing` (``"completion-only"`` when some samples lack
    their prompt rows).
    """
    if isinstance(routed_experts_per_sample, torch.Tensor) or not isinstance(routed_experts_per_sample, Sequence):
        raise TypeError(
            f"routed_experts_per_sample is {type(routed_experts_per_sample).__name__}; allowed: a list of [T_i, L, K] arrays"
        )
    if len(routed_experts_per_sample) == 0:
        raise ValueError("routed_experts_per_sample is empty; allowed: at least one sample")
    samples = []
    for i, value in enumerate(routed_experts_per_sample):
        ids = _as_ids(value, f"routed_experts_per_sample[{i}]", keep_width=True)
        if ids.dim() != 3 or ids.shape[0] == 0:
            raise ValueError(
                f"routed_experts_per_sample[{i}] has shape {tuple(ids.shape)}; allowed: [seq_len >= 1, num_layers, top_k]"
            )
        if samples and ids.shape[1:] != samples[0].shape[1:]:
            raise ValueError(
                f"routed_experts_per_sample[{i}] has [num_layers, top_k] = {list(ids.shape[1:])} but sample 0 has "
                f"{list(samples[0].shape[1:])}; allowed: the same for every sample"
            )
        if samples and ids.dtype != samples[0].dtype:
            ids = ids.to(torch.int64)
            samples = [s.to(torch.int64) for s in samples]
        samples.append(ids)
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor([s.shape[0] for s in samples], dtype=torch.int64), 0)
    return RoutingReplay(
        torch.cat(samples), offsets, num_experts, model=model,
        sample_step=None if sample_step is None else _as_ids(sample_step, "sample_step"),
        sample_task=None if sample_task is None else _as_ids(sample_task, "sample_task"),
        coverage=coverage,
    )


# Same layout in both frameworks; the names make call sites self-explanatory.
from_slime = from_per_sample
from_sglang = from_per_sample
