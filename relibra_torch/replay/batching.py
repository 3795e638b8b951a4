"""Batching samples into (source rank, micro-batch): the default deterministic rule.

:func:`batch_samples` assigns every sample of a rollout to a source rank and a micro-batch
the way RL trainers pack them; :meth:`RoutingReplay.counts
<relibra_torch.replay.RoutingReplay.counts>` turns the assignment into ``loads_MLSE``.

Legend: N samples, M micro-batches, S source ranks.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from ..checks import check_int, check_tensor
from .fileio import dtype_name

__all__ = ["SampleAssignment", "batch_samples"]

# Limit on ranks and micro-batches: generous, and keeps flattened group indices in int64.
MAX_GROUPS = 2**20


@dataclass(frozen=True)
class SampleAssignment:
    """Which source rank and micro-batch each sample goes to.

    ``rank_N`` and ``micro_batch_N`` are int64 ``[N]`` with values in ``[0, num_ranks)`` and
    ``[0, num_micro_batches)``. A micro-batch may be empty on some ranks (its counts are 0).
    """

    rank_N: torch.Tensor
    micro_batch_N: torch.Tensor
    num_ranks: int
    num_micro_batches: int

    def __post_init__(self):
        check_int("num_ranks", self.num_ranks, 1, MAX_GROUPS)
        check_int("num_micro_batches", self.num_micro_batches, 1, MAX_GROUPS)
        for name, bound in (("rank_N", self.num_ranks), ("micro_batch_N", self.num_micro_batches)):
            value = check_tensor(name, getattr(self, name))
            if value.dtype != torch.int64 or value.dim() != 1:
                raise ValueError(
                    f"{name} is {dtype_name(value.dtype)} {tuple(value.shape)}; allowed: int64 [num_samples]"
                )
            bad = (value < 0) | (value >= bound)
            if bool(bad.any()):
                i = int(bad.nonzero()[0, 0])
                raise ValueError(f"{name}[{i}] = {int(value[i])}; allowed: [0, {bound})")
        if self.rank_N.shape != self.micro_batch_N.shape:
            raise ValueError(
                f"rank_N has {self.rank_N.numel()} samples but micro_batch_N has {self.micro_batch_N.numel()}; allowed: equal"
            )

    @property
    def num_samples(self) -> int:
        return self.rank_N.numel()


def batch_samples(
    sample_lengths_N,
    num_ranks: int,
    *,
    num_micro_batches: int | None = None,
    max_tokens_per_micro_batch: int | None = None,
) -> SampleAssignment:
    """The default, deterministic rule that batches samples into ranks and micro-batches.

    1. Ranks: samples in file order; each goes to the rank holding the fewest tokens so far
       (ties: the lowest rank). This is greedy longest-free-bin, not optimal packing.
    2. Micro-batches, per rank, keeping the rank's samples in file order (contiguous runs).
       Give exactly one of:

       * ``num_micro_batches = M``: sample ``j`` of a rank whose samples total ``W`` tokens
         goes to micro-batch ``floor(M * (P_j + len_j / 2) / W)``, where ``P_j`` is the
         tokens before it on that rank; i.e. each sample goes where its midpoint falls when
         the rank's tokens are cut into ``M`` equal parts. Micro-batches can be empty when a
         rank has fewer samples than ``M``.
       * ``max_tokens_per_micro_batch = B``: a new micro-batch starts when the next sample
         would push the current one over ``B`` tokens (verl/slime-style dynamic batch size);
         ``M`` is the largest count over ranks and shorter ranks have trailing empty
         micro-batches. A sample longer than ``B`` raises ``ValueError``.

    Args:
        sample_lengths_N: integer ``[N]`` token counts, each >= 1.
    Returns:
        :class:`SampleAssignment`.
    """
    sample_lengths_N = check_tensor("sample_lengths", sample_lengths_N)
    if sample_lengths_N.dtype.is_floating_point or sample_lengths_N.dtype == torch.bool or sample_lengths_N.is_complex():
        raise ValueError(f"sample_lengths has dtype {dtype_name(sample_lengths_N.dtype)}; allowed: an integer dtype")
    if sample_lengths_N.dim() != 1 or sample_lengths_N.numel() == 0:
        raise ValueError(f"sample_lengths has shape {tuple(sample_lengths_N.shape)}; allowed: [num_samples >= 1]")
    if int(sample_lengths_N.min()) < 1:
        i = int((sample_lengths_N < 1).nonzero()[0, 0])
        raise ValueError(f"sample_lengths[{i}] = {int(sample_lengths_N[i])}; allowed: >= 1")
    check_int("num_ranks", num_ranks, 1, MAX_GROUPS)
    if (num_micro_batches is None) == (max_tokens_per_micro_batch is None):
        raise ValueError(
            f"num_micro_batches = {num_micro_batches}, max_tokens_per_micro_batch = {max_tokens_per_micro_batch}; "
            "allowed: exactly one of them"
        )
    lengths = [int(x) for x in sample_lengths_N.tolist()]
    # Greedy over samples (not tokens): a heap keeps it O(N log S).
    heap = [(0, r) for r in range(num_ranks)]
    rank = [0] * len(lengths)
    for i, n in enumerate(lengths):
        load, r = heapq.heappop(heap)
        rank[i] = r
        heapq.heappush(heap, (load + n, r))
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for i, r in enumerate(rank):
        per_rank[r].append(i)

    micro = [0] * len(lengths)
    if num_micro_batches is not None:
        M = check_int("num_micro_batches", num_micro_batches, 1, MAX_GROUPS)
        for samples in per_rank:
            total = sum(lengths[i] for i in samples)
            before = 0
            for i in samples:
                # Integer form of floor(M * (before + len/2) / total): exact, no float rounding.
                micro[i] = min(M - 1, (M * (2 * before + lengths[i])) // (2 * total))
                before += lengths[i]
    else:
        budget = check_int("max_tokens_per_micro_batch", max_tokens_per_micro_batch, 1, 2**62)
        M = 1
        for samples in per_rank:
            m, used = 0, 0
            for i in samples:
                if lengths[i] > budget:
                    raise ValueError(
                        f"sample_lengths[{i}] = {lengths[i]} exceeds max_tokens_per_micro_batch = {budget}; "
                        "allowed: every sample fits in one micro-batch"
                    )
                if used and used + lengths[i] > budget:
                    m, used = m + 1, 0
                micro[i] = m
                used += lengths[i]
            M = max(M, m + 1)
    return SampleAssignment(
        rank_N=torch.tensor(rank, dtype=torch.int64),
        micro_batch_N=torch.tensor(micro, dtype=torch.int64),
        num_ranks=num_ranks,
        num_micro_batches=M,
    )
