"""Token counts, the default batching rule, converters and the uniform baseline.

Shape legend: T tokens, L layers, K top-k, E experts, N samples, M micro-batches,
S source ranks, B batch rows, P padded positions.
"""

from __future__ import annotations

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
from relibra_torch.replay import routing as routing_mod

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
    monkeypatch.setattr(routing_mod, "_CHUNK_ELEMENTS", 7)
    assert torch.equal(replay.counts(a), full)
    assert torch.equal(replay.expert_counts(), counts_for_tokens(replay.routed_experts_TLK, 6))


def test_counts_for_tokens():
    ids = torch.tensor([[[0, 1], [2, 1]], [[1, 2], [2, 0]]])  # T=2, L=2, K=2
    assert counts_for_tokens(ids, 3).tolist() == [[1, 2, 1], [1, 1, 2]]
    with pytest.raises(ValueError, match=r"expert_ids\[1, 1, 0\] = 3 is out of range; allowed: expert ids in \[0, 3\)"):
        counts_for_tokens(torch.tensor([[[0, 1], [2, 1]], [[1, 2], [3, 0]]]), 3)
    with pytest.raises(ValueError, match=r"expert_ids has shape \(2, 2\); allowed: \[T, L, K\]"):
        counts_for_tokens(ids[0], 3)


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


def test_expected_max_of_normals_closed_forms():
    # E[max of 2] = 1/sqrt(pi), E[max of 3] = 3/(2 sqrt(pi)); 1e-9 covers the quadrature error.
    assert baseline_mod.expected_max_of_normals(1) == 0.0
    assert abs(baseline_mod.expected_max_of_normals(2) - 1 / math.sqrt(math.pi)) < 1e-9
    assert abs(baseline_mod.expected_max_of_normals(3) - 1.5 / math.sqrt(math.pi)) < 1e-9
    # Tabulated value for n = 100 (Harter 1961): 2.50759.
    assert abs(baseline_mod.expected_max_of_normals(100) - 2.50759) < 1e-4


def test_uniform_baseline_methods_agree():
    # At a size where both are cheap, the normal formula is within 2% of exact Monte-Carlo
    # (256 trials: MC standard error of the mean max/mean is ~0.3% here).
    T, K, E = 3000, 2, 16
    exact = baseline_mod._exact_mc(T, K, E, trials=256, seed=1)
    normal = baseline_mod._normal(T, K, E)
    assert abs(exact - normal) / exact < 0.02, (exact, normal)
    assert exact > 1.05  # finite token counts are never perfectly balanced


def test_uniform_baseline_api():
    value, method = uniform_max_over_mean(100, 2, 8)
    assert method == "exact-mc" and 1.0 < value <= 4.0
    assert uniform_max_over_mean(100, 2, 8) == (value, method)  # seeded: deterministic
    value, method = uniform_max_over_mean(10**6, 8, 128)
    assert method == "normal" and 1.0 < value < 1.02
    assert uniform_max_over_mean(5, 4, 4) == (1.0, "exact")
    # One token, top-1 of 4 experts: the only expert used gets 1 token, mean 1/4.
    assert uniform_max_over_mean(1, 1, 4) == (4.0, "exact-mc")
    with pytest.raises(ValueError, match="top_k = 5 exceeds num_experts = 4"):
        uniform_max_over_mean(10, 5, 4)
