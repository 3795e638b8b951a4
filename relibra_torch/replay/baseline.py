"""Uniform-routing baseline for expert-load imbalance.

Question answered: if each of ``T`` tokens picked ``K`` *distinct* experts out of ``E``
uniformly at random, what is the expected ``max_e load_e / mean_e load_e``? (The mean is
exactly ``T*K/E``, so this is ``E[max] / (T*K/E)``.) Real routing is compared with it to
tell skew from the noise any finite token count has.

Two methods, chosen by size, and the result says which:

* ``"exact-mc"``: seeded Monte-Carlo of the exact process (each token draws a uniform
  ``K``-subset) when ``T * E * trials`` is small enough to be cheap;
* ``"normal"``: the loads have mean ``T p`` and covariance ``T p (1-p) E/(E-1) (I - J/E)``
  with ``p = K/E`` (the exact first two moments of the sum of uniform K-subsets), so with a
  normal approximation ``max/mean ~= 1 + m_E * sqrt(T p (1-p) E/(E-1)) / (T p)`` where
  ``m_E`` is the expected maximum of ``E`` independent standard normals, computed by
  quadrature. The result is capped at ``E/K`` (no expert gets more than every token).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["expected_max_of_normals", "uniform_max_over_mean"]

# Monte-Carlo is used while T * E * trials stays under this many random numbers.
_EXACT_BUDGET = 1 << 22
_TRIALS = 64


@lru_cache(maxsize=None)
def expected_max_of_normals(n: int) -> float:
    """E[max of ``n`` i.i.d. N(0, 1)] by trapezoid quadrature of ``n x phi(x) Phi(x)^(n-1)``."""
    if n < 1:
        raise ValueError(f"n = {n}; allowed: n >= 1")
    if n == 1:
        return 0.0
    steps, lo, hi = 40_000, -12.0, 12.0
    h = (hi - lo) / steps
    total = 0.0
    for i in range(steps + 1):
        x = lo + i * h
        phi = math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
        cdf = 0.5 * math.erfc(-x / math.sqrt(2))
        term = n * x * phi * cdf ** (n - 1)
        total += term * (0.5 if i in (0, steps) else 1.0)
    return total * h


def _normal(num_tokens: int, top_k: int, num_experts: int) -> float:
    p = top_k / num_experts
    if p >= 1.0:
        return 1.0
    sigma = math.sqrt(num_tokens * p * (1 - p) * num_experts / (num_experts - 1))
    return min(num_experts / top_k, 1.0 + expected_max_of_normals(num_experts) * sigma / (num_tokens * p))


def _exact_mc(num_tokens: int, top_k: int, num_experts: int, trials: int, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    maxima = []
    for _ in range(trials):
        # top-k of i.i.d. uniforms is a uniform K-subset.
        picks_TK = torch.rand(num_tokens, num_experts, generator=gen).topk(top_k, dim=1).indices
        maxima.append(int(torch.bincount(picks_TK.reshape(-1), minlength=num_experts).max()))
    mean = num_tokens * top_k / num_experts
    return sum(maxima) / len(maxima) / mean


@lru_cache(maxsize=4096)
def uniform_max_over_mean(num_tokens: int, top_k: int, num_experts: int, *, seed: int = 0) -> tuple[float, str]:
    """Expected max/mean expert load under uniform top-k routing, and the method used.

    Returns ``(value, method)`` with method ``"exact-mc"`` (seeded Monte-Carlo, 64 trials)
    or ``"normal"`` (moment-matched normal approximation); deterministic for given inputs.
    """
    for name, value in (("num_tokens", num_tokens), ("top_k", top_k), ("num_experts", num_experts)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} = {value!r}; allowed: an integer >= 1")
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds num_experts = {num_experts}; allowed: top_k <= num_experts")
    if top_k == num_experts:
        return 1.0, "exact"
    if num_tokens * num_experts * _TRIALS <= _EXACT_BUDGET:
        return _exact_mc(num_tokens, top_k, num_experts, _TRIALS, seed), "exact-mc"
    return _normal(num_tokens, top_k, num_experts), "normal"
