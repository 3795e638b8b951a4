"""Entry points: plan a packing from samples, count a replay's samples, pack a replay.

Legend: see :mod:`relibra_torch.planning.packing`.
"""

from __future__ import annotations

import numpy as np
import torch

from ...checks import check_int, check_tensor
from .config import INT_DTYPES, PackingConfig, PackingCosts, PackingPlan
from .problem import PackingProblem


def _plan_from_bins(problem: PackingProblem, bin_N: np.ndarray, **kw) -> PackingPlan:
    S, M = problem.S, problem.M
    rank = torch.from_numpy(bin_N % S).to(torch.int64)
    micro = torch.from_numpy(bin_N // S).to(torch.int64)
    key = (rank * M + micro) * problem.N + torch.arange(problem.N)
    perm = torch.argsort(key)
    offsets = torch.zeros(S * M + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(rank * M + micro, minlength=S * M).cumsum(0)
    return PackingPlan(rank, micro, perm, offsets, **kw)


def plan_packing(lengths_N: torch.Tensor, counts_NLE: torch.Tensor | None, config: PackingConfig,
                 costs: PackingCosts, *, initial: tuple[torch.Tensor, torch.Tensor] | None = None,
                 node_LE: torch.Tensor | None = None) -> PackingPlan:
    """Pack one step's samples (every rank's, gathered) into ``S x M`` micro-batches.

    Args:
        lengths_N: integer ``[N]`` sample lengths.
        counts_NLE: integer ``[N, L, E]`` per-sample token-expert counts from the replay
            (``None``: attention only).
        config: :class:`PackingConfig` (ranks, micro-batches, cap, method, search).
        costs: :class:`PackingCosts` in seconds.
        initial: the ``fixed`` rule's ``(rank_N, micro_batch_N)``; required for
            ``method="fixed"``, a start for ``routepack``.
        node_LE: expert-to-node map for the objective (default: balanced from the step).
    Returns:
        :class:`PackingPlan`: every sample exactly once, ``M`` non-empty micro-batches per
        rank, none over ``max_tokens`` unless it holds a single longer sample.
    Raises:
        ValueError when no such packing exists (too few samples, too many over-long ones,
        too many tokens), naming the setting to change.
    """
    problem = PackingProblem(lengths_N, counts_NLE, config, costs, node_LE)
    starts: dict[str, float | None] = {}
    candidates: list[tuple[float, int, np.ndarray]] = []
    if initial is not None:
        fixed = problem._bins(*initial)
        if problem.violations(*initial):
            fixed = problem._repair(fixed)
        if fixed is None:
            starts["fixed"] = None
        else:
            obj = float(problem._cost(*problem._bin_state(fixed)).sum())
            starts["fixed"] = obj
            candidates.append((obj, 0, fixed))
    elif config.method == "fixed":
        raise ValueError("method = 'fixed' needs initial=(rank_N, micro_batch_N): the fixed rule's packing")
    if config.method == "fixed":
        if not candidates:
            raise ValueError("the fixed packing could not be made feasible (empty or overfilled micro-batches)")
        obj, _, bins = candidates[0]
        return _plan_from_bins(problem, bins, objective_s=obj, start_objectives_s=starts, method="fixed")
    try:
        length = problem.length_start()
    except ValueError:
        if config.method == "length" or not candidates:
            raise
        starts["length"] = None   # a greedy stuck on a tight cap: the feasible fixed start remains
    else:
        obj = float(problem._cost(*problem._bin_state(length)).sum())
        starts["length"] = obj
        if config.method == "length":
            return _plan_from_bins(problem, length, objective_s=obj, start_objectives_s=starts, method="length")
        candidates.append((obj, 1, length))
    start_obj, _, start = min(candidates, key=lambda c: (c[0], c[1]))
    bins, proposals, accepted = problem.anneal(start)
    # Recompute from scratch: the running sum of deltas may drift by rounding.
    final = float(problem._cost(*problem._bin_state(bins)).sum())
    if final > start_obj:
        bins, final = start, start_obj
    return _plan_from_bins(problem, bins, objective_s=final, start_objectives_s=starts, method="routepack",
                           proposals=proposals, accepted=accepted)


def per_sample_counts(routed_experts_TLK: torch.Tensor, sample_lengths_N: torch.Tensor,
                      num_experts: int) -> torch.Tensor:
    """int32 ``[N, L, E]`` token-expert pairs of each sample (tokens of sample ``n`` are the
    ``sample_lengths_N[n]`` rows after the previous samples'); ids ``< 0`` (padding) count nothing."""
    check_tensor("routed_experts_TLK", routed_experts_TLK, dim=3, dtypes=INT_DTYPES)
    check_tensor("sample_lengths_N", sample_lengths_N, dim=1, dtypes=INT_DTYPES)
    E = check_int("num_experts", num_experts, 1)
    T, L, _ = routed_experts_TLK.shape
    if int(sample_lengths_N.sum()) != T:
        raise ValueError(f"sample_lengths_N sums to {int(sample_lengths_N.sum())} tokens but routed_experts_TLK "
                         f"has {T}")
    N = sample_lengths_N.numel()
    ids = routed_experts_TLK.to(torch.int64)
    if int(ids.max()) >= E:
        raise ValueError(f"routed_experts_TLK holds expert {int(ids.max())}; allowed: < num_experts = {E}")
    sample_T = torch.repeat_interleave(torch.arange(N), sample_lengths_N.to(torch.int64))
    flat = (sample_T.view(-1, 1, 1) * L + torch.arange(L).view(1, L, 1)) * E + ids
    valid = ids >= 0
    out = torch.zeros(N * L * E, dtype=torch.int32)
    out.index_add_(0, flat[valid], torch.ones(int(valid.sum()), dtype=torch.int32))
    return out.view(N, L, E)


def pack_replay(replay, config: PackingConfig, costs: PackingCosts, *,
                initial: tuple[torch.Tensor, torch.Tensor] | None = None) -> PackingPlan:
    """Pack a step's routing replay (every rank's samples, gathered; a
    :class:`relibra_torch.replay.RoutingReplay` or anything with ``routed_experts_TLK``,
    ``sample_lengths`` and ``num_experts``): :func:`plan_packing` on its lengths and
    per-sample counts.

    Apply the result with ``plan.micro_batches_of(rank)``: rank ``r``'s micro-batch ``m``
    holds the samples whose ids are listed there (ids index the replay's samples), or with
    ``plan.permutation_N`` (all samples, rank-major) and ``plan.bin_offsets``.
    """
    lengths = replay.sample_lengths.to(torch.int64)
    counts = per_sample_counts(replay.routed_experts_TLK, lengths, replay.num_experts)
    return plan_packing(lengths, counts, config, costs, initial=initial)

