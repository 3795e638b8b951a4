"""The one definition of a replica residency (planning.residency) against a brute-force walk."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning import Topology, evaluate, static_plan
from relibra_torch.planning.residency import residencies, residency_masks


def brute(se, fill, tokens):
    """Per slot: walk the micro-batches, one residency per maximal run of one non-owned expert."""
    M, X = se.shape
    start = torch.zeros(M, X, dtype=torch.bool)
    ret = torch.zeros_like(start)
    held = torch.zeros_like(start)
    for x in range(X):
        m = 0
        while m < M:
            if not fill[m, x]:
                m += 1
                continue
            end = m
            while end + 1 < M and fill[end + 1, x] and se[end + 1, x] == se[m, x]:
                end += 1
            active = [q for q in range(m, end + 1) if tokens[q, x] > 0]
            if active:
                start[active[0], x] = True
                ret[active[-1], x] = True
                held[active[0] : active[-1] + 1, x] = True
            m = end + 1
    return start, ret, held


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_residency_masks_match_a_walk(data):
    M = data.draw(st.integers(1, 6))
    X = data.draw(st.integers(1, 4))
    se = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, 2), min_size=X, max_size=X),
                                         min_size=M, max_size=M)))
    owned = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=X, max_size=X),
                                            min_size=M, max_size=M)))
    tokens = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 2), min_size=X, max_size=X),
                                             min_size=M, max_size=M)))
    fill = (se >= 0) & ~owned
    got = residency_masks(se, fill, tokens)
    for a, b, name in zip(got, brute(se, fill, tokens), ("fill_start", "grad_return", "held")):
        assert torch.equal(a, b), (name, se.tolist(), fill.tolist(), tokens.tolist(), a.tolist(), b.tolist())


def test_tokenless_slots_are_never_filled_and_a_step_boundary_ends_residencies():
    topo = Topology(1, 2, 4, 1)
    loads = torch.ones(4, 1, 2, 4, dtype=torch.int64)
    plan = static_plan(loads, topo)
    # GPU 1's replica slot holds expert 0 (owned by GPU 0) in every micro-batch;
    # tokens only in micro-batches 1 and 2.
    plan.slot_expert_MLGJ[:, 0, 1, 2] = 0
    plan.slot_tokens_MLGJ[:, 0, 0, 0] = torch.tensor([2, 1, 1, 2])
    plan.slot_tokens_MLGJ[:, 0, 1, 2] = torch.tensor([0, 1, 1, 0])
    res = residencies(plan)
    assert res.fill_start_MLGJ[:, 0, 1, 2].tolist() == [False, True, False, False]
    assert res.grad_return_MLGJ[:, 0, 1, 2].tolist() == [False, False, True, False]
    assert res.held_MLGJ[:, 0, 1, 2].tolist() == [False, True, True, False]
    assert res.fetches(refetch=True)[:, 0, 1, 2].tolist() == [0, 2, 2, 0]
    assert res.returns(refetch=True)[:, 0, 1, 2].tolist() == [0, 1, 1, 0]
    metrics = evaluate(plan, loads)
    assert int(metrics.fill_start_MLGJ.sum()) == 1 and int(metrics.grad_return_MLGJ.sum()) == 1
    # no tokens at all: no fill, no return
    plan.slot_tokens_MLGJ[:, 0, 1, 2] = 0
    res = residencies(plan)
    assert not res.fill_start_MLGJ.any() and not res.grad_return_MLGJ.any() and not res.held_MLGJ.any()


def test_layer_plans_carry_each_slots_residency():
    """Every micro-batch's LayerPlan names the residency its slots are in: the micro-batch
    whose forward fills it and the one whose backward returns its gradient."""
    from relibra_torch.moe import layer_plans

    topo = Topology(1, 2, 4, 1)
    loads = torch.ones(5, 1, 2, 4, dtype=torch.int64)
    plan = static_plan(loads, topo)
    # GPU 1's replica slot: expert 0 in micro-batches 0-2 (tokens in 1, 2), expert 1 in 3-4
    # (tokens in 3 only); GPU 0's replica slot holds its own expert 1: never a fill.
    plan.slot_expert_MLGJ[:, 0, 1, 2] = torch.tensor([0, 0, 0, 1, 1])
    plan.slot_expert_MLGJ[:, 0, 0, 2] = 1
    plan.slot_tokens_MLGJ[:, 0, 1, 2] = torch.tensor([0, 1, 1, 1, 0])
    want = [(1, 2), (1, 2), (1, 2), (3, 3), (3, 3)]   # micro-batch 0 is tokenless inside 0-2
    for m in range(5):
        lp = layer_plans(plan, loads, m)[0]
        assert (int(lp.fill_mb_GJ[1, 2]), int(lp.return_mb_GJ[1, 2])) == want[m], m
        assert int(lp.fill_mb_GJ[0, 2]) == -1 and int(lp.fill_mb_GJ[0, 0]) == -1


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_every_micro_batchs_residency_matches_a_walk(data):
    """``step_residency_micro_batches`` (all micro-batches at once) against a walk of each
    slot's runs: every micro-batch of a fill run names the run's first and last micro-batch
    with tokens, ``-1`` outside a fill run or in a run without tokens; the per-micro-batch
    function gives the same rows."""
    from relibra_torch.planning.residency import residency_micro_batches, step_residency_micro_batches

    M = data.draw(st.integers(1, 7))
    topo = Topology(1, 2, 4, 2)                   # GPU 0 owns experts 0, 1; GPU 1 owns 2, 3
    loads = torch.ones(M, 1, 2, 4, dtype=torch.int64)
    plan = static_plan(loads, topo)
    cells = st.lists(st.integers(-1, 3), min_size=M, max_size=M)
    for gpu in range(2):
        for j in (2, 3):
            plan.slot_expert_MLGJ[:, 0, gpu, j] = torch.tensor(data.draw(cells))
            plan.slot_tokens_MLGJ[:, 0, gpu, j] = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=M,
                                                                                   max_size=M)))
    fill_mb, return_mb = step_residency_micro_batches(plan)
    se = plan.slot_expert_MLGJ[:, 0]
    owner = torch.where(se >= 0, se // 2, -1)
    for gpu in range(2):
        for j in range(4):
            want_fill, want_ret = [-1] * M, [-1] * M
            m = 0
            while m < M:
                e = int(se[m, gpu, j])
                if e < 0 or int(owner[m, gpu, j]) == gpu:
                    m += 1
                    continue
                end = m
                while end + 1 < M and int(se[end + 1, gpu, j]) == e:
                    end += 1
                active = [q for q in range(m, end + 1) if int(plan.slot_tokens_MLGJ[q, 0, gpu, j]) > 0]
                if active:
                    want_fill[m:end + 1] = [active[0]] * (end + 1 - m)
                    want_ret[m:end + 1] = [active[-1]] * (end + 1 - m)
                m = end + 1
            assert fill_mb[:, 0, gpu, j].tolist() == want_fill, (gpu, j, se[:, gpu, j].tolist())
            assert return_mb[:, 0, gpu, j].tolist() == want_ret, (gpu, j, se[:, gpu, j].tolist())
    for m in range(M):
        one = residency_micro_batches(plan, m)
        assert torch.equal(one[0], fill_mb[m]) and torch.equal(one[1], return_mb[m])
