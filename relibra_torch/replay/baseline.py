"""Uniform-routing baseline for expert-load imbalance.

Question answered: if each of ``T`` tokens picked ``K`` *distinct* experts out of ``E``
uniformly at random, what is the expected ``max_e load_e / mean_e load_e``? (The mean is
exactly ``T*K/E``, so this is ``E[max] / (T*K/E)``.) Real routing is compared with it to
tell skew from the noise any finite token count has.

The answer is an exact simulation of that process (no approximation; only Monte-Carlo
noise over ``trials``) whose cost does not grow with ``T``: see
:func:`uniform_max_over_mean`. This is the only implementation in the package;
``relibra_torch.sim.traces`` re-exports it, and ``relibra inspect`` averages it over the
micro-batches of a loads file with :func:`mean_over_token_counts` (the same sweep run once
for all token counts, so the cost does not grow with Python calls).

Legend: T tokens, E experts, K top-k, R rows (independent simulations), Z distinct token counts.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import torch

from ..checks import check_int

__all__ = ["mean_over_token_counts", "uniform_max_over_mean"]


def _seed(seed: int, num_tokens: int, num_experts: int, top_k: int) -> int:
    # One platform-stable stream per (seed, shape), so baselines at different token counts
    # are independent draws (the same stream as sim.traces used before it re-exported this).
    key = repr((seed, "uniform", num_tokens, num_experts, top_k)).encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def uniform_max_over_mean(num_tokens: int, num_experts: int, top_k: int, seed: int = 0,
                          trials: int = 256) -> float:
    """Expected max/mean expert load of uniform top-k routing of ``num_tokens`` tokens.

    The baseline that sampling noise alone produces (e.g. about 1.1 for 4,096 tokens, 64
    experts, top-8); report it next to any skew figure. Exact simulation of every token
    picking ``top_k`` distinct experts uniformly, without per-token work: experts are
    visited in turn, tokens are grouped by how many picks they have left (``j``), and with
    ``r`` experts left each such token takes the current expert with probability ``j / r``
    (so a group of ``h_j`` tokens contributes ``Binomial(h_j, j / r)``). Cost: ``E`` steps
    of ``trials x K`` binomials, independent of ``num_tokens`` (~0.05 s for 256 trials,
    128 experts, top-8, at 1e5 or 1e6 tokens, one core).

    Args:
        num_tokens: T >= 1.
        num_experts: E >= 1.
        top_k: K, ``1 <= K <= E`` (``K == E`` gives exactly 1.0).
        seed: >= 0; the result is deterministic for equal arguments (cached).
        trials: independent simulations averaged (>= 1); the standard error of the result
            falls as ``1 / sqrt(trials)``.
    Returns:
        float: mean over trials of ``max_e counts_e / (T K / E)``.
    """
    T = check_int("num_tokens", num_tokens, 1)
    E, K = _check_shape(num_experts, top_k)
    check_int("seed", seed, 0)
    R = check_int("trials", trials, 1)
    return _cached(T, E, K, seed, R)


def _check_shape(num_experts, top_k) -> tuple[int, int]:
    E = check_int("num_experts", num_experts, 1)
    K = check_int("top_k", top_k, 1)
    if K > E:
        raise ValueError(f"top_k = {K}; allowed: an int in [1, num_experts = {E}]")
    return E, K


# Validated ints only (so 1, 1.0 and True never share an entry).
@lru_cache(maxsize=4096)
def _cached(T: int, E: int, K: int, seed: int, R: int) -> float:
    g = torch.Generator().manual_seed(_seed(seed, T, E, K))
    return float(_sweep_R(torch.full((R,), float(T), dtype=torch.float64), E, K, g).mean())


def _sweep_R(tokens_R: torch.Tensor, E: int, K: int, g: torch.Generator) -> torch.Tensor:
    """float64 ``[R]``: max/mean load of one simulation per row, row ``r`` routing
    ``tokens_R[r]`` tokens (float64 ``[R]``, integral, >= 1) to ``K`` of ``E`` experts."""
    R = tokens_R.numel()
    h_RK1 = torch.zeros(R, K + 1, dtype=torch.float64)  # h[:, j]: tokens with j picks left
    h_RK1[:, K] = tokens_R
    j_K = torch.arange(1, K + 1, dtype=torch.float64)
    counts_RE = torch.empty(R, E, dtype=torch.float64)
    for e in range(E):
        take_RK = torch.binomial(h_RK1[:, 1:], (j_K / (E - e)).clamp(max=1.0).expand(R, K), generator=g)
        h_RK1[:, 1:] -= take_RK
        h_RK1[:, :-1] += take_RK
        counts_RE[:, e] = take_RK.sum(-1)
    return counts_RE.amax(-1) / counts_RE.mean(-1)


# Budget of binomial draws for mean_over_token_counts (~0.8 s on one core): 4096 rows at
# 128 experts, top-8; the standard error of the mean is then ~3e-4 at 16k tokens. Rows are simulated in blocks of _BLOCK_ROWS to bound memory.
_COUNTS_BINOMIALS = 1 << 22
_BLOCK_ROWS = 8192


def mean_over_token_counts(num_tokens: list[int], num_experts: int, top_k: int, *, seed: int = 0,
                            max_trials: int = 256) -> tuple[float, int]:
    """Mean of the uniform baseline over many token counts (e.g. every micro-batch of a file).

    ``num_tokens`` may repeat values: each distinct count is simulated ``trials`` times in
    one sweep for all counts, and its mean enters the result once per occurrence. ``trials``
    is ``max_trials`` when cheap, fewer when there are many distinct counts (total
    ``Z x trials x E x K`` binomials kept near ``2^22``, never fewer than 1 per count): only
    the mean is returned, and its noise depends on the total number of simulations.

    Returns:
        ``(mean baseline, trials per distinct count)``; deterministic for equal arguments.
    """
    E, K = _check_shape(num_experts, top_k)
    check_int("seed", seed, 0)
    check_int("max_trials", max_trials, 1)
    if not isinstance(num_tokens, (list, tuple)) or not num_tokens:
        raise ValueError(f"num_tokens = {num_tokens!r}; allowed: a non-empty list of ints >= 1")
    for i, t in enumerate(num_tokens):
        check_int(f"num_tokens[{i}]", t, 1)
    counts_N = torch.tensor(num_tokens, dtype=torch.int64)
    distinct_Z, inverse_N = torch.unique(counts_N, return_inverse=True)
    Z = distinct_Z.numel()
    trials = max(1, min(max_trials, _COUNTS_BINOMIALS // (Z * E * K)))
    g = torch.Generator().manual_seed(_seed(seed, ("counts", trials), E, K))
    rows = distinct_Z.to(torch.float64).repeat_interleave(trials)
    ratio_R = torch.cat([_sweep_R(rows[i:i + _BLOCK_ROWS], E, K, g) for i in range(0, rows.numel(), _BLOCK_ROWS)])
    mean_Z = ratio_R.view(Z, trials).mean(-1)
    return float(mean_Z[inverse_N].mean()), trials
