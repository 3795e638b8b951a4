"""Exploration routing: off = plain top-k, anchors kept, candidates only from the pool, seeds
reproduce, diversity grows with sigma, entropy schedule, config validation.

Shape legend: T tokens, E experts, K top-k. Budget: ~5 s.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.rollout.explore import (
    ExplorationConfig,
    ExplorationPolicy,
    exploration_sigma,
    explore_topk,
    resolve_pool,
    routing_entropy,
)


def random_scores(T, E, seed, temperature=1.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(T, E, generator=gen) / temperature, dim=-1)


@settings(max_examples=60, deadline=None)
@given(T=st.integers(0, 20), E=st.integers(1, 16), k_frac=st.floats(0, 1), seed=st.integers(0, 10**6))
def test_off_is_plain_topk(T, E, k_frac, seed):
    K = max(1, round(k_frac * E))
    scores = random_scores(T, E, seed)
    plain = torch.topk(scores, K, dim=-1).indices
    assert torch.equal(explore_topk(scores, K), plain)
    assert torch.equal(explore_topk(scores, K, ExplorationConfig(enabled=False, sigma_max=5.0)), plain)
    policy = ExplorationPolicy()  # default config: off, and it draws no noise
    state = policy.generator.get_state().clone()
    assert torch.equal(policy(scores, K), plain)
    assert torch.equal(policy.generator.get_state(), state)


@settings(max_examples=80, deadline=None)
@given(
    T=st.integers(1, 30), E=st.integers(2, 32), k_frac=st.floats(0, 1), anchor_frac=st.floats(0, 1),
    extra_pool=st.integers(0, 8), seed=st.integers(0, 10**6), temperature=st.sampled_from([0.05, 1.0, 10.0]),
    noise_space=st.sampled_from(["log", "score"]),
)
def test_anchors_kept_candidates_from_pool(T, E, k_frac, anchor_frac, extra_pool, seed, temperature, noise_space):
    K = max(1, round(k_frac * E))
    A = round(anchor_frac * K)
    M = max(1, (K - A) + extra_pool)
    cfg = ExplorationConfig(enabled=True, num_anchors=A, pool_size=M, sigma_min=0.5, sigma_max=3.0,
                            noise_space=noise_space)
    scores = random_scores(T, E, seed, temperature)
    ids = explore_topk(scores, K, cfg, torch.Generator().manual_seed(seed))
    assert ids.shape == (T, K) and ids.dtype == torch.int64
    A, M = resolve_pool(K, E, cfg)
    ranked = torch.topk(scores, A + M, dim=-1).indices
    assert torch.equal(ids[:, :A], ranked[:, :A])  # anchors: the router's top A, in order
    for t in range(T):
        assert len(set(ids[t].tolist())) == K
        assert set(ids[t, A:].tolist()) <= set(ranked[t, A:].tolist())  # candidates only from the pool


def test_seed_reproduces_paths_and_other_seeds_differ():
    scores = random_scores(200, 16, 0)
    cfg = ExplorationConfig(enabled=True, seed=11)
    a = [ExplorationPolicy(cfg)(scores, 4) for _ in range(2)]
    assert torch.equal(a[0], a[1])
    p = ExplorationPolicy(cfg)
    first, second = p(scores, 4), p(scores, 4)  # the stream advances between calls
    assert torch.equal(first, a[0]) and not torch.equal(first, second)
    p.reseed(11)
    assert torch.equal(p(scores, 4), a[0])
    other = ExplorationPolicy(ExplorationConfig(enabled=True, seed=12))(scores, 4)
    assert not torch.equal(other, a[0])
    # Same noise for the same seed whatever the scores' dtype.
    b = explore_topk(scores.double(), 4, cfg, torch.Generator().manual_seed(11))
    assert torch.equal(b, a[0])


def diversity(scores, K, sigma, draws=16):
    """Mean number of distinct expert sets per token over ``draws`` seeds, and the fraction
    of (token, draw) paths that differ from plain top-k."""
    cfg = ExplorationConfig(enabled=True, num_anchors=1, pool_size=6, sigma_min=sigma, sigma_max=sigma)
    paths = [explore_topk(scores, K, cfg, torch.Generator().manual_seed(s)).sort(dim=-1).values for s in range(draws)]
    stacked = torch.stack(paths, dim=1)  # [T, draws, K]
    distinct = sum(len({tuple(r) for r in stacked[t].tolist()}) for t in range(stacked.shape[0])) / stacked.shape[0]
    plain = torch.topk(scores, K, dim=-1).indices.sort(dim=-1).values
    differs = (stacked != plain[:, None]).any(-1).float().mean().item()
    return distinct, differs


def test_diversity_grows_with_sigma():
    scores = random_scores(64, 16, 3)
    K = 3
    sigmas = [0.0, 0.1, 0.3, 1.0, 3.0]
    measured = [diversity(scores, K, s) for s in sigmas]
    distinct = [m[0] for m in measured]
    differs = [m[1] for m in measured]
    # sigma = 0 is plain top-k exactly: one path per token, none differ.
    assert distinct[0] == 1.0 and differs[0] == 0.0
    assert all(b > a for a, b in zip(distinct, distinct[1:])), distinct
    assert all(b > a for a, b in zip(differs, differs[1:])), differs
    # With a large sigma the pool (6 candidates, 2 picks: 15 sets) is explored broadly.
    assert distinct[-1] > 6


def test_entropy_and_sigma_schedule():
    E = 8
    uniform = torch.full((1, E), 1.0 / E)
    onehot = torch.zeros(1, E)
    onehot[0, 3] = 1.0
    assert routing_entropy(uniform).item() == pytest.approx(1.0, abs=1e-6)
    assert routing_entropy(onehot).item() == 0.0
    # Unnormalised (sigmoid-like) scores are normalised first.
    assert routing_entropy(uniform * 0.3).item() == pytest.approx(1.0, abs=1e-6)
    p = torch.tensor([[0.5, 0.25, 0.25, 0, 0, 0, 0, 0]])
    assert routing_entropy(p).item() == pytest.approx(1.5 * math.log(2) / math.log(8), abs=1e-6)
    cfg = ExplorationConfig(enabled=True, sigma_min=0.2, sigma_max=1.4)
    assert exploration_sigma(uniform, cfg).item() == pytest.approx(0.2, abs=1e-6)
    assert exploration_sigma(onehot, cfg).item() == pytest.approx(1.4, abs=1e-6)
    # A confident router explores more: over many tokens, peaked scores leave plain top-k
    # more often than flat ones under the same config.
    flat, peaked = random_scores(400, 16, 5, 3.0), random_scores(400, 16, 5, 0.3)
    cfg = ExplorationConfig(enabled=True, num_anchors=1, pool_size=4, sigma_min=0.0, sigma_max=2.0)
    assert exploration_sigma(peaked, cfg).mean() > 1.0 > 0.1 > exploration_sigma(flat, cfg).mean()
    left = []
    for scores in (flat, peaked):
        ids = explore_topk(scores, 3, cfg, torch.Generator().manual_seed(0)).sort(-1).values
        left.append((ids != torch.topk(scores, 3).indices.sort(-1).values).any(-1).float().mean().item())
    assert left[1] > left[0] + 0.15, left  # measured 0.50 vs 0.22


def test_zero_score_experts_never_chosen_when_pool_has_others():
    scores = torch.tensor([[0.6, 0.3, 0.1, 0.0, 0.0]] * 50)
    cfg = ExplorationConfig(enabled=True, num_anchors=1, pool_size=4, sigma_min=5.0, sigma_max=5.0)
    ids = explore_topk(scores, 2, cfg, torch.Generator().manual_seed(0))
    assert set(ids[:, 1].tolist()) == {1, 2}


def test_defaults_and_caps():
    assert resolve_pool(8, 128, ExplorationConfig()) == (4, 8)
    assert resolve_pool(1, 8, ExplorationConfig()) == (0, 2)
    assert resolve_pool(2, 3, ExplorationConfig()) == (1, 2)  # pool capped at E - anchors
    assert resolve_pool(4, 4, ExplorationConfig(num_anchors=4)) == (4, 0)
    scores = random_scores(5, 4, 0)
    ids = explore_topk(scores, 4, ExplorationConfig(enabled=True, num_anchors=4), torch.Generator())
    assert torch.equal(ids, torch.topk(scores, 4).indices)


@pytest.mark.parametrize(
    "kwargs, exc, pattern",
    [
        ({"num_anchors": -1}, ValueError, "num_anchors = -1"),
        ({"pool_size": 0}, ValueError, "pool_size = 0"),
        ({"num_anchors": 1.5}, TypeError, "num_anchors is float"),
        ({"sigma_min": -0.1}, ValueError, "sigma_min = -0.1"),
        ({"sigma_max": float("inf")}, ValueError, "sigma_max = inf"),
        ({"sigma_min": 2.0, "sigma_max": 1.0}, ValueError, "sigma_max = 1.0 < sigma_min = 2.0"),
        ({"noise_space": "logit"}, ValueError, "noise_space = 'logit'"),
        ({"enabled": 1}, TypeError, "enabled is int"),
        ({"seed": "x"}, TypeError, "seed is str"),
    ],
)
def test_config_errors(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        ExplorationConfig(**kwargs)


def test_call_errors():
    scores = random_scores(3, 6, 0)
    on = ExplorationConfig(enabled=True)
    with pytest.raises(TypeError, match="generator is NoneType"):
        explore_topk(scores, 2, on)
    with pytest.raises(ValueError, match="top_k = 7"):
        explore_topk(scores, 7)
    with pytest.raises(ValueError, match="num_anchors = 3 exceeds top_k = 2"):
        explore_topk(scores, 2, ExplorationConfig(enabled=True, num_anchors=3), torch.Generator())
    with pytest.raises(ValueError, match="pool_size = 1 .* smaller than top_k - num_anchors = 2"):
        explore_topk(scores, 2, ExplorationConfig(enabled=True, num_anchors=0, pool_size=1), torch.Generator())
    with pytest.raises(ValueError, match=r"scores\[0, 1\] = -1.0 is negative"):
        explore_topk(torch.tensor([[0.5, -1.0, 0.2]]), 1, on, torch.Generator())
    with pytest.raises(ValueError, match=r"scores\[0\] sums to 0"):
        routing_entropy(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="scores has shape"):
        explore_topk(torch.rand(2, 3, 4), 1)
    with pytest.raises(ValueError, match="floating dtype"):
        explore_topk(torch.ones(2, 3, dtype=torch.int64), 1)
    with pytest.raises(TypeError, match="cfg is dict"):
        explore_topk(scores, 2, {"enabled": True})
