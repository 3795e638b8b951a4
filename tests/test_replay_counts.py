"""Token counts, the default batching rule, converters and the uniform baseline.

Shape legend: T tokens, L layers, K top-k, E experts, N samples, M micro-batches,
S source ranks, B batch rows, P padded positions.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from _replay_helpers import naive_counts, offsets_from_lengths, random_ids_TLK
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.replay import (
    RoutingReplay,
    SampleAssignment,
    batch_samples,
    counts_for_tokens,
    from_per_sample,
    from_slime,
    from_verl,
    uniform_max_over_mean,
    validate_loads,
)
from relibra_torch.replay import baseline as baseline_mod
from relibra_torch.replay import counts as counts_mod

SETTINGS = settings(max_examples=100, deadline=None)


@st.composite
def replays_and_assignments(draw):
    L = draw(st.integers(1, 3))
    E = draw(st.integers(1, 9))
    K = draw(st.integers(1, min(E, 3)))
    lengths = draw(st.lists(st.integers(1, 6), min_size=1, max_size=7))
    S = draw(st.integers(1, 3))
    M = draw(st.integers(1, 3))
    ranks = draw(st.lists(st.integers(0, S - 1), min_size=len(lengths), max_size=len(lengths)))
    micro = draw(st.lists(st.integers(0, M - 1), min_size=len(lengths), max_size=len(lengths)))
    seed = draw(st.integers(0, 2**16))
    ids = random_ids_TLK(sum(lengths), L, K, E, seed=seed, skew=draw(st.sampled_from([0.0, 0.7])))
    replay = RoutingReplay(ids.to(draw(st.sampled_from([torch.int16, torch.int32, torch.int64]))), offsets_from_lengths(lengths), E)
    assignment = SampleAssignment(torch.tensor(ranks), torch.tensor(micro), S, M)
    return replay, assignment


@SETTINGS
@given(replays_and_assignments())
def test_counts_match_naive_loop(case):
    replay, a = case
    got = replay.counts(a)
    want = naive_counts(replay.routed_experts_TLK, replay.sample_offsets, a.rank_N, a.micro_batch_N,
                        a.num_micro_batches, a.num_ranks, replay.num_experts)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)
    # Invariants the planner relies on: each (m, s) carries K * tokens in every layer, the
    # counts pass the loads validation, and summing over (m, s) gives the per-layer totals.
    validate_loads(got[None], replay.top_k)
    assert torch.equal(got.sum(dim=(0, 2)), replay.expert_counts())
    tokens_MS = torch.zeros(a.num_micro_batches, a.num_ranks, dtype=torch.int64)
    tokens_MS.index_put_((a.micro_batch_N, a.rank_N), replay.sample_lengths, accumulate=True)
    assert torch.equal(got.sum(dim=-1), replay.top_k * tokens_MS[:, None, :].expand(-1, replay.num_layers, -1))


def test_counts_chunked_path(monkeypatch):
    # Force many small chunks: the result must not depend on the chunk size.
    replay = RoutingReplay(random_ids_TLK(200, 2, 2, 6, seed=3), offsets_from_lengths([50, 70, 80]), 6)
    a = SampleAssignment(torch.tensor([1, 0, 1]), torch.tensor([0, 0, 1]), 2, 2)
    full = replay.counts(a)
    monkeypatch.setattr(counts_mod, "CHUNK_ELEMENTS", 7)
    assert torch.equal(replay.counts(a), full)
    assert torch.equal(replay.expert_counts(), counts_for_tokens(replay.routed_experts_TLK, 6))


def test_counts_for_tokens():
    ids = torch.tensor([[[0, 1], [2, 1]], [[1, 2], [2, 0]]])  # T=2, L=2, K=2
    assert counts_for_tokens(ids, 3).tolist() == [[1, 2, 1], [1, 1, 2]]
    with pytest.raises(ValueError, match=r"expert_ids\[1, 1, 0\] = 3 is out of range; allowed: expert ids in \[0, 3\)"):
        counts_for_tokens(torch.tensor([[[0, 1], [2, 1]], [[1, 2], [3, 0]]]), 3)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(2, 2\); allowed: \[T, L, K\]"):
        counts_for_tokens(ids[0], 3)


@given(lead=st.lists(st.integers(0, 4), min_size=0, max_size=3), L=st.integers(1, 3), E=st.integers(1, 6),
       data=st.data())
@SETTINGS
def test_count_experts_any_leading_dims_and_groups(lead, L, E, data):
    # The one counting implementation: [..., L, K] ids -> [L, E], and per group -> [B, L, E],
    # against a per-token Python loop.
    K = data.draw(st.integers(1, E))
    seed = data.draw(st.integers(0, 2**16))
    T = math.prod(lead)
    ids_TLK = random_ids_TLK(T, L, K, E, seed) if T else torch.zeros(0, L, K, dtype=torch.int64)
    ids = ids_TLK.view(*lead, L, K)
    want_LE = torch.zeros(L, E, dtype=torch.int64)
    for t in range(T):
        for l in range(L):
            for k in range(K):
                want_LE[l, ids_TLK[t, l, k]] += 1
    assert torch.equal(counts_mod.count_experts(ids, E), want_LE)
    B = data.draw(st.integers(1, 4))
    group_T = torch.tensor(data.draw(st.lists(st.integers(0, B - 1), min_size=T, max_size=T)), dtype=torch.int64)
    got_BLE = counts_mod.count_by_group(ids, group_T, B, E)
    assert got_BLE.shape == (B, L, E) and torch.equal(got_BLE.sum(0), want_LE)
    for b in range(B):
        assert torch.equal(got_BLE[b], counts_mod.count_experts(ids_TLK[group_T == b], E))


def test_count_helpers_name_the_bad_argument(monkeypatch):
    ids = torch.tensor([[[0, 1]], [[1, 2]]])  # T=2, L=1, K=2
    monkeypatch.setattr(counts_mod, "CHUNK_ELEMENTS", 1)  # one token per chunk
    assert counts_mod.count_by_group(ids, torch.tensor([1, 0]), 2, 3).tolist() == [[[0, 1, 1]], [[1, 1, 0]]]
    with pytest.raises(ValueError, match=r"group_T\[1\] = 2; allowed: \[0, 2\)"):
        counts_mod.count_by_group(ids, torch.tensor([0, 2]), 2, 3)
    with pytest.raises(ValueError, match=r"group_T has 1 entries but expert_ids has 2 tokens; allowed: one group per token"):
        counts_mod.count_by_group(ids, torch.tensor([0]), 2, 3)
    with pytest.raises(ValueError, match=r"group_T has dtype float32; allowed: an integer dtype"):
        counts_mod.count_by_group(ids, torch.tensor([0.0, 1.0]), 2, 3)
    with pytest.raises(ValueError, match=r"num_groups = 0; allowed: an int >= 1"):
        counts_mod.count_by_group(ids, torch.tensor([0, 0]), 0, 3)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(2,\); allowed: \[\.\.\., L, K\]"):
        counts_mod.count_experts(torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match=r"num_experts = 0; allowed: an int in \[1, 1048576\]"):
        counts_mod.count_experts(ids, 0)
    with pytest.raises(ValueError, match=r"expert_ids\[0\] = \[1, 1\] repeats an expert; allowed: distinct expert ids"):
        counts_mod.check_expert_ids(torch.tensor([[1, 1]]), 3, distinct=True)
    counts_mod.check_expert_ids(torch.tensor([[1, 1]]), 3)  # duplicates only checked when asked
    with pytest.raises(TypeError, match=r"routed_experts is Tensor; allowed: a list of \[T, L, K\] tensors"):
        counts_mod.count_micro_batches(ids, 1, 3)


def test_counts_rejects_bad_assignment():
    replay = RoutingReplay(random_ids_TLK(6, 1, 1, 4), offsets_from_lengths([3, 3]), 4)
    with pytest.raises(ValueError, match="assignment covers 3 samples but the replay has 2"):
        replay.counts(SampleAssignment(torch.tensor([0, 0, 0]), torch.tensor([0, 0, 0]), 1, 1))
    with pytest.raises(ValueError, match=r"rank_N\[1\] = 2; allowed: \[0, 2\)"):
        SampleAssignment(torch.tensor([0, 2]), torch.tensor([0, 0]), 2, 1)
    with pytest.raises(ValueError, match=r"micro_batch_N is int32 \(2,\); allowed: int64"):
        SampleAssignment(torch.tensor([0, 1]), torch.tensor([0, 0], dtype=torch.int32), 2, 1)
    with pytest.raises(TypeError, match="assignment is tuple"):
        replay.counts((torch.tensor([0, 0]), torch.tensor([0, 0])))


# ---------------------------------------------------------------- batching rule


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    num_ranks=st.integers(1, 5),
    num_micro_batches=st.integers(1, 4),
)
def test_batch_samples_fixed_micro_batches(lengths, num_ranks, num_micro_batches):
    a = batch_samples(torch.tensor(lengths), num_ranks, num_micro_batches=num_micro_batches)
    again = batch_samples(torch.tensor(lengths), num_ranks, num_micro_batches=num_micro_batches)
    assert torch.equal(a.rank_N, again.rank_N) and torch.equal(a.micro_batch_N, again.micro_batch_N)
    assert a.num_ranks == num_ranks and a.num_micro_batches == num_micro_batches
    # Greedy fewest-tokens: rank totals differ by at most one sample's length.
    totals = [sum(n for n, r in zip(lengths, a.rank_N.tolist()) if r == rank) for rank in range(num_ranks)]
    assert max(totals) - min(totals) <= max(lengths)
    for rank in range(num_ranks):
        members = [i for i, r in enumerate(a.rank_N.tolist()) if r == rank]
        micro = [int(a.micro_batch_N[i]) for i in members]
        assert micro == sorted(micro)  # contiguous runs in file order
        # Midpoint rule: a micro-batch holds at most W/M tokens plus one sample.
        for m in range(num_micro_batches):
            tokens = sum(lengths[i] for i in members if int(a.micro_batch_N[i]) == m)
            assert tokens <= totals[rank] / num_micro_batches + max(lengths)


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    num_ranks=st.integers(1, 4),
    budget=st.integers(40, 120),
)
def test_batch_samples_token_budget(lengths, num_ranks, budget):
    a = batch_samples(torch.tensor(lengths), num_ranks, max_tokens_per_micro_batch=budget)
    used_M = set()
    for rank in range(num_ranks):
        members = [i for i, r in enumerate(a.rank_N.tolist()) if r == rank]
        micro = [int(a.micro_batch_N[i]) for i in members]
        assert micro == sorted(micro)
        if micro:
            assert micro[0] == 0 and all(b - c in (0, 1) for c, b in zip(micro, micro[1:]))
            used_M.add(micro[-1] + 1)
        groups = {}
        for i, m in zip(members, micro):
            groups.setdefault(m, []).append(i)
        for m, idx in groups.items():
            assert sum(lengths[i] for i in idx) <= budget
            if m + 1 in groups:  # greedy: the next micro-batch's first sample did not fit
                assert sum(lengths[i] for i in idx) + lengths[groups[m + 1][0]] > budget
    assert a.num_micro_batches == max(used_M)


def test_batch_samples_examples_and_errors():
    a = batch_samples(torch.tensor([10, 1, 1, 1, 10, 3]), 2, num_micro_batches=2)
    # ranks: 10->0, 1->1, 1->1, 1->1, 10->1 (1 has 3 < 10), 3->0 (0 has 10 < 13)
    assert a.rank_N.tolist() == [0, 1, 1, 1, 1, 0]
    # rank 0: [10, 3] of 13: midpoints 5 -> mb 0, 11.5 -> mb 1; rank 1: [1,1,1,10] of 13:
    # midpoints .5, 1.5, 2.5 -> mb 0, 8 -> mb 1
    assert a.micro_batch_N.tolist() == [0, 0, 0, 0, 1, 1]
    b = batch_samples(torch.tensor([4, 4, 4, 4, 4]), 1, max_tokens_per_micro_batch=8)
    assert b.micro_batch_N.tolist() == [0, 0, 1, 1, 2] and b.num_micro_batches == 3
    with pytest.raises(ValueError, match=r"sample_lengths\[1\] = 9 exceeds max_tokens_per_micro_batch = 8"):
        batch_samples(torch.tensor([4, 9]), 1, max_tokens_per_micro_batch=8)
    with pytest.raises(ValueError, match="allowed: exactly one of them"):
        batch_samples(torch.tensor([4]), 1)
    with pytest.raises(ValueError, match="allowed: exactly one of them"):
        batch_samples(torch.tensor([4]), 1, num_micro_batches=1, max_tokens_per_micro_batch=4)
    with pytest.raises(ValueError, match=r"sample_lengths\[0\] = 0; allowed: >= 1"):
        batch_samples(torch.tensor([0, 3]), 1, num_micro_batches=1)
    with pytest.raises(ValueError, match=r"sample_lengths has dtype float32"):
        batch_samples(torch.tensor([1.0]), 1, num_micro_batches=1)
    with pytest.raises(ValueError, match=r"num_ranks = 0; allowed"):
        batch_samples(torch.tensor([1]), 0, num_micro_batches=1)


# ---------------------------------------------------------------- converters


def test_from_verl_matches_per_sample():
    L, K, E = 2, 2, 6
    lengths = [3, 5, 1]
    samples = [random_ids_TLK(n, L, K, E, seed=10 + i).to(torch.int32) for i, n in enumerate(lengths)]
    B, P = len(lengths), 7
    routed = torch.full((B, P, L, K), 99, dtype=torch.int32)  # padding holds invalid ids on purpose
    mask = torch.zeros(B, P, dtype=torch.int64)
    starts = [2, 0, 6]  # left-padded, unpadded and fully right-aligned rows
    for b, (start, ids) in enumerate(zip(starts, samples)):
        routed[b, start : start + ids.shape[0]] = ids
        mask[b, start : start + ids.shape[0]] = 1
    got = from_verl(routed, mask, E, model="m", sample_step=[4, 4, 5])
    want = from_slime(samples, E, model="m", sample_step=torch.tensor([4, 4, 5]))
    assert torch.equal(got.routed_experts_TLK, want.routed_experts_TLK)
    assert got.routed_experts_TLK.dtype == torch.int32
    assert torch.equal(got.sample_offsets, torch.tensor([0, 3, 8, 9]))
    assert torch.equal(got.sample_step, want.sample_step) and got.model == "m"
    # numpy input and a bool mask work too
    got2 = from_verl(routed.numpy(), mask.bool().numpy(), E)
    assert torch.equal(got2.routed_experts_TLK, want.routed_experts_TLK)


def test_from_verl_errors():
    routed = torch.zeros(2, 3, 1, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 4\); allowed: \[batch, max_seq_len\] = \[2, 3\]"):
        from_verl(routed, torch.ones(2, 4), 2)
    with pytest.raises(ValueError, match=r"attention_mask\[1, 2\] = 2; allowed: 0 or 1"):
        from_verl(routed, torch.tensor([[1, 1, 1], [1, 1, 2]]), 2)
    with pytest.raises(ValueError, match=r"attention_mask\[0\] has no tokens"):
        from_verl(routed, torch.tensor([[0, 0, 0], [1, 1, 1]]), 2)
    with pytest.raises(ValueError, match=r"attention_mask has dtype float32"):
        from_verl(routed, torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match=r"routed_experts has dtype float32; allowed: an integer dtype"):
        from_verl(routed.float(), torch.ones(2, 3, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match=r"routed_experts has shape \(2, 3, 1\); allowed: \[batch, max_seq_len, num_layers, top_k\]"):
        from_verl(routed[..., 0], torch.ones(2, 3, dtype=torch.int64), 2)
    bad = routed.clone()
    bad[1, 0, 0, 0] = 5
    with pytest.raises(ValueError, match=r"routed_experts\[3, 0, 0\] = 5 is out of range"):
        from_verl(bad, torch.ones(2, 3, dtype=torch.int64), 2)


def test_from_per_sample_errors_and_dtypes():
    a = torch.tensor([[[0, 1]]], dtype=torch.uint8)
    b = torch.tensor([[[1, 2]], [[2, 0]]], dtype=torch.int16)
    replay = from_per_sample([a, b.numpy()], 3)
    assert replay.routed_experts_TLK.tolist() == [[[0, 1]], [[1, 2]], [[2, 0]]]
    assert replay.sample_offsets.tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match=r"routed_experts_per_sample\[1\] has \[num_layers, top_k\] = \[2, 2\] but sample 0 has \[1, 2\]"):
        from_per_sample([a, torch.zeros(1, 2, 2, dtype=torch.int64)], 3)
    with pytest.raises(ValueError, match=r"routed_experts_per_sample\[0\] has shape \(0, 1, 2\); allowed: \[seq_len >= 1"):
        from_per_sample([a[:0]], 3)
    with pytest.raises(ValueError, match="routed_experts_per_sample is empty"):
        from_per_sample([], 3)
    with pytest.raises(TypeError, match="allowed: a list of"):
        from_per_sample(b, 3)
    with pytest.raises(ValueError, match=r"routed_experts\[0, 0\] = \[1, 1\] repeats an expert"):
        from_per_sample([torch.tensor([[[1, 1]]])], 3)


# ---------------------------------------------------------------- uniform baseline
# uniform_max_over_mean(num_tokens, num_experts, top_k, seed=0, trials=256) is the package's
# only implementation (sim.traces re-exports it). Agreement tolerances are ~4.5 standard
# errors of the compared means (the per-trial standard deviation of max/mean is stated
# next to each); every draw is seeded, so the comparisons are deterministic.


def _brute_force(T: int, E: int, K: int, trials: int, seed: int) -> float:
    """Mean max/mean of ``trials`` token-by-token draws (a uniform K-subset = top-k of iid uniforms)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(trials, T, E, generator=g).topk(K, dim=-1).indices
    counts_RE = torch.zeros(trials, E, dtype=torch.int64).scatter_add_(
        1, ids.reshape(trials, -1), torch.ones(trials, T * K, dtype=torch.int64))
    return float((counts_RE.amax(-1) / (T * K / E)).mean())


def test_uniform_baseline_matches_exact_enumeration():
    # 3 tokens, 2 of 5 experts: all 10^3 equally likely routings give the exact expectation.
    T, E, K = 3, 5, 2
    subsets = list(itertools.combinations(range(E), K))
    ratios = []
    for choice in itertools.product(subsets, repeat=T):
        counts = [0] * E
        for subset in choice:
            for e in subset:
                counts[e] += 1
        ratios.append(max(counts) / (T * K / E))
    exact = sum(ratios) / len(ratios)
    sd = math.sqrt(sum((r - exact) ** 2 for r in ratios) / len(ratios))  # 0.385
    trials = 20_000
    got = uniform_max_over_mean(T, E, K, trials=trials)
    assert abs(got - exact) < 4.5 * sd / math.sqrt(trials), (got, exact)


@pytest.mark.parametrize(
    "T,E,K,brute_trials,tol",
    [
        (512, 16, 4, 1000, 0.006),  # per-trial sd 0.039: 4.3 standard errors
        (20, 8, 3, 4000, 0.016),  # per-trial sd 0.16: 4.5 standard errors
    ],
)
def test_uniform_baseline_matches_brute_force(T, E, K, brute_trials, tol):
    got = uniform_max_over_mean(T, E, K, trials=4000)
    brute = _brute_force(T, E, K, brute_trials, seed=5)
    assert abs(got - brute) < tol, (got, brute)


def test_uniform_baseline_values_and_determinism():
    # README: 64 experts, top-8, 4,096 tokens, uniform routing: max/mean near 1.1.
    u = uniform_max_over_mean(4096, 64, 8)
    assert 1.05 < u < 1.15
    assert uniform_max_over_mean(4096, 64, 8, seed=0) == u  # seeded: deterministic
    baseline_mod._cached.cache_clear()
    assert uniform_max_over_mean(4096, 64, 8) == u  # recomputed, not only cached
    assert uniform_max_over_mean(4096, 64, 8, seed=1) != u  # the seed matters
    # Every token takes every expert.
    assert uniform_max_over_mean(100, 8, 8) == 1.0
    assert uniform_max_over_mean(5, 4, 4, trials=3) == 1.0
    # One token, top-1 of 4 experts: the expert used gets 1 token, the mean is 1/4.
    assert uniform_max_over_mean(1, 4, 1) == 4.0
    # Fewer than 128/8 tokens cannot cover 128 experts: max >= 1 > mean.
    assert uniform_max_over_mean(10, 128, 8) > 1.0
    # Decreasing with tokens (here far beyond the Monte-Carlo noise).
    values = [uniform_max_over_mean(t, 64, 8) for t in (100, 1000, 10_000, 10**6)]
    assert all(a > b for a, b in zip(values, values[1:])), values
    assert 1.0 < uniform_max_over_mean(10**6, 128, 8) < 1.02
    assert uniform_max_over_mean(3000, 16, 2) > 1.05  # finite token counts are never balanced


@SETTINGS
@given(T=st.integers(1, 10**7), E=st.integers(1, 40), data=st.data())
def test_uniform_baseline_bounds(T, E, data):
    # 1 <= max/mean <= E/K: no expert gets more than every token.
    K = data.draw(st.integers(1, E))
    value = uniform_max_over_mean(T, E, K, seed=data.draw(st.integers(0, 3)), trials=4)
    assert 1.0 - 1e-12 <= value <= E / K + 1e-12


@pytest.mark.parametrize(
    "args,kwargs,exc,fragment",
    [
        ((10, 4, 5), {}, ValueError, "top_k = 5; allowed: an int in [1, num_experts = 4]"),
        ((0, 4, 2), {}, ValueError, "num_tokens = 0; allowed: an int >= 1"),
        ((10, 0, 1), {}, ValueError, "num_experts = 0; allowed: an int >= 1"),
        ((10, 4, 0), {}, ValueError, "top_k = 0; allowed: an int >= 1"),
        ((10, 4, 2), {"seed": -1}, ValueError, "seed = -1; allowed: an int >= 0"),
        ((10, 4, 2), {"trials": 0}, ValueError, "trials = 0; allowed: an int >= 1"),
        ((10.0, 4, 2), {}, TypeError, "num_tokens is float 10.0; allowed: an int >= 1"),
        ((10, True, 1), {}, TypeError, "num_experts is bool True; allowed: an int >= 1"),
        ((True, 4, 1), {}, TypeError, "num_tokens is bool True; allowed: an int >= 1"),
        ((10, 4, 2), {"trials": [4]}, TypeError, "trials is list [4]; allowed: an int >= 1"),
    ],
)
def test_uniform_baseline_validation(args, kwargs, exc, fragment):
    uniform_max_over_mean(1, 4, 1)  # an equal-valued valid call is cached; it must not leak
    with pytest.raises(exc) as info:
        uniform_max_over_mean(*args, **kwargs)
    assert fragment in str(info.value)


def test_mean_over_token_counts():
    # `relibra inspect` on a loads file: the baseline averaged over micro-batches.
    mean_over = baseline_mod.mean_over_token_counts
    # Weighted by occurrences: one token of top-1 of 4 gives exactly 4.0; K == E gives 1.0.
    assert mean_over([1, 1, 1], 4, 1) == (4.0, 256)
    assert mean_over([7, 1000], 4, 4, max_trials=5) == (1.0, 5)
    value, trials = mean_over([1, 1, 1, 10**6], 4, 1)
    big = uniform_max_over_mean(10**6, 4, 1)
    assert abs(value - (3 * 4.0 + big) / 4) < 0.01 and big < 1.01  # not (4.0 + big) / 2
    # Agrees with averaging the one-count function: per-trial sd of max/mean 0.22 / 0.10 /
    # 0.044 at 50 / 200 / 1000 tokens, 256 vs 4000 trials per count, so the difference has a
    # standard error of ~0.005; the tolerance is 4.5 of them.
    tokens = [50, 50, 200, 1000, 1000, 1000]
    value, trials = mean_over(tokens, 16, 2)
    direct = sum(uniform_max_over_mean(t, 16, 2, trials=4000) for t in tokens) / len(tokens)
    assert trials == 256 and abs(value - direct) < 0.023, (value, direct)
    assert mean_over(tokens, 16, 2) == (value, trials)  # deterministic
    # Many distinct counts: fewer trials each, total work bounded (about 2^22 binomials).
    value, trials = mean_over(list(range(1000, 2024)), 128, 8)
    assert trials == 4 and 1.0 < value < 1.5
    with pytest.raises(ValueError, match=r"num_tokens\[1\] = 0; allowed: an int >= 1"):
        mean_over([5, 0], 4, 2)
    with pytest.raises(ValueError, match=r"num_tokens = \[\]; allowed: a non-empty list of ints >= 1"):
        mean_over([], 4, 2)
    with pytest.raises(ValueError, match=r"top_k = 5; allowed: an int in \[1, num_experts = 4\]"):
        mean_over([5], 4, 5)


def test_run_time_counts_skip_pad_ids():
    """count_micro_batches / hook.count_loads take run-time routing: -1 (a pad) counts
    nowhere; anything below -1 is refused; files (count_experts without pads) refuse -1."""
    from relibra_torch.hook import count_loads
    from relibra_torch.replay.counts import count_experts

    ids = torch.tensor([[[0, -1]], [[-1, -1]], [[2, 0]]])          # [T=3, L=1, K=2]
    got = count_loads([ids, ids[:1]], 1, 3)
    assert got.tolist() == [[[2, 0, 1]], [[1, 0, 0]]]
    with pytest.raises(ValueError, match=r"= -2 is out of range; allowed: expert ids in \[0, 3\), or -1"):
        count_loads([torch.full((1, 1, 2), -2)], 1, 3)
    with pytest.raises(ValueError, match=r"= -1 is out of range; allowed: expert ids in \[0, 3\)$"):
        count_experts(ids, 3)
