"""Host-side execution schedule of ReplayBalancedMoE: no process group needed.

Every rank's schedule is built from the same plan; together they must describe one
consistent exchange (what a rank sends is what its peer expects), follow token_split's
rule exactly, and fill every non-owned slot from its owner. Budget: ~10 s.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _moe_fns as fns
from relibra_torch.distributed import move_expert_rows, native_experts
from relibra_torch.moe.schedule import (LayerPlan, assign_slots, build_rank_schedule, check_layer_plan,
                                        group_permutation, layer_plans, native_layer_plan)
from relibra_torch.planning import Topology, native_plan, token_split

TOPOLOGIES = [(1, 2, 4), (2, 2, 8), (2, 2, 4), (2, 4, 8), (1, 1, 3), (3, 2, 12)]
PLANS = ["random-native", "random-intra", "random-general", "static", "eplb-oracle", "relibra"]


@st.composite
def scenario(draw):
    N, g, E = draw(st.sampled_from(TOPOLOGIES))
    R = draw(st.integers(0, 2))
    K = draw(st.integers(1, min(3, E)))
    seed = draw(st.integers(0, 2**31 - 1))
    mode = draw(st.sampled_from(["random", "skewed", "one", "sparse"]))
    tokens = draw(st.lists(st.integers(0, 9), min_size=N * g, max_size=N * g))
    kind = draw(st.sampled_from(PLANS))
    return N, g, E, R, K, seed, mode, tokens, kind


def _build(N, g, E, R, K, seed, mode, tokens, kind):
    topo = Topology(N, g, E, R)
    gen = torch.Generator().manual_seed(seed)
    ids = fns.make_routing(mode, tokens, E, K, gen)
    loads = fns.loads_of(ids, E)
    plan = fns.planner_plan(kind, topo, loads, gen)
    lp = layer_plans(plan, loads, 0)[0]
    placement = plan.placement_LE[0]
    scheds = [build_rank_schedule(topo, placement, check_layer_plan(lp, topo, placement), r)
              for r in range(topo.num_gpus)]
    return topo, ids, loads, plan, lp, placement, scheds


@settings(max_examples=60, deadline=None, derandomize=True)
@given(scenario())
def test_schedules_form_one_consistent_exchange(sc):
    topo, ids, loads, plan, lp, placement, scheds = _build(*sc)
    G, J, El = topo.num_gpus, topo.slots_per_gpu, topo.experts_per_gpu
    split = lp.split_SGJ
    owner = placement // El
    for r, s in enumerate(scheds):
        assert torch.equal(s.expected_counts_E, loads[0, 0, r])
        assert s.send_sizes == split[r].sum(1).tolist()
        assert s.recv_sizes == split[:, r].sum(1).tolist()
        # The rows each slot receives from every source: token_split's split, exactly.
        dest = assign_slots(ids[r], s).reshape(-1)
        assert torch.equal(torch.bincount(dest, minlength=G * J), split[r].reshape(-1))
        # Inside one expert, pairs in flat order fill its instances in slot order.
        flat = ids[r].reshape(-1)
        for e in flat.unique().tolist():
            d = dest[flat == e]
            assert (d[1:] >= d[:-1]).all()
            assert (lp.slot_expert_GJ.reshape(-1)[d] == e).all()
        # Grouping: native groups then fills cover every received row once.
        assert sum(s.own_counts) + sum(s.fill_counts) == s.num_recv_rows
        perm = group_permutation(s, torch.device("cpu"))
        assert torch.equal(perm.sort().values, torch.arange(s.num_recv_rows))
        assert torch.equal(s.slot_tokens_J, split[:, r].sum(0))
        for j in range(J):
            e = int(lp.slot_expert_GJ[r, j])
            if s.slot_tokens_J[j] and int(owner[e]) != r:
                assert j in s.fill_slots  # every non-owned slot with work is filled
    # Fills: every receiver's expected experts come from their owners, in order.
    any_fill = [s.any_fill for s in scheds]
    assert len(set(any_fill)) == 1
    for dst, s in enumerate(scheds):
        got = []
        for src, t in enumerate(scheds):
            assert t.fill_send_sizes[dst] == s.fill_recv_sizes[src]
            start = sum(t.fill_send_sizes[:dst])
            rows = t.fill_send_idx[start : start + t.fill_send_sizes[dst]]
            got += native_experts(placement, El, src)[rows].tolist()
        assert got == s.fill_experts


def test_native_layer_plan_matches_native_step_plan():
    topo = Topology(2, 2, 8, 1)
    gen = torch.Generator().manual_seed(0)
    loads = fns.loads_of(fns.make_routing("skewed", [3, 0, 5, 4], 8, 2, gen), 8)
    placement = torch.randperm(8, generator=gen)
    lp = native_layer_plan(topo, placement, loads[0, 0])
    ref = native_plan(loads, topo, placement.view(1, 8), "native")
    assert torch.equal(lp.slot_expert_GJ, ref.slot_expert_MLGJ[0, 0])
    assert torch.equal(lp.split_SGJ, token_split(ref, loads)[0, 0])


def test_check_layer_plan_names_the_problem():
    topo = Topology(2, 2, 8, 1)
    placement = torch.arange(8)
    good = native_layer_plan(topo, placement, torch.ones(4, 8, dtype=torch.int64))
    check_layer_plan(good, topo, placement)
    other = native_layer_plan(Topology(1, 2, 8, 1), placement, torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="another topology"):
        check_layer_plan(other, topo, placement)
    with pytest.raises(ValueError, match="another topology"):
        check_layer_plan(LayerPlan(good.slot_expert_GJ, good.split_SGJ[:, :, :2]), topo, placement)
    se = good.slot_expert_GJ.clone()
    se[0, 2] = se[0, 0]
    with pytest.raises(ValueError, match="two instances"):
        check_layer_plan(LayerPlan(se, good.split_SGJ), topo, placement)
    sp = good.split_SGJ.clone()
    sp[0, 0, 2] = 1
    with pytest.raises(ValueError, match="empty slot"):
        check_layer_plan(LayerPlan(good.slot_expert_GJ, sp), topo, placement)
    sp = good.split_SGJ.clone()
    sp[0, 0, 0] = -1
    with pytest.raises(ValueError, match="negative"):
        check_layer_plan(LayerPlan(good.slot_expert_GJ, sp), topo, placement)
    se = good.slot_expert_GJ.clone()
    se[1, 2] = 8
    with pytest.raises(ValueError, match="outside"):
        check_layer_plan(LayerPlan(se, good.split_SGJ), topo, placement)
    with pytest.raises(ValueError, match="apply_placement"):
        check_layer_plan(good, topo, torch.arange(8).flip(0))
    with pytest.raises(TypeError, match="LayerPlan"):
        check_layer_plan((good.slot_expert_GJ, good.split_SGJ), topo, placement)


def test_move_expert_rows_one_process_is_a_permutation():
    gen = torch.Generator().manual_seed(1)
    E = 6
    logical = torch.randn(E, 3, 2, generator=gen)
    old, new = torch.randperm(E, generator=gen), torch.randperm(E, generator=gen)
    local_old = logical[native_experts(old, E, 0)]
    local_new = move_expert_rows(local_old, old, new, 0, None)
    assert torch.equal(local_new, logical[native_experts(new, E, 0)])
    # The identity placement is the logical order.
    assert torch.equal(move_expert_rows(local_old, old, torch.arange(E), 0, None), logical)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(1, 2, 4, 1), (2, 2, 8, 2), (2, 4, 8, 0), (3, 2, 12, 3)]),
       M=st.integers(1, 3), L=st.integers(1, 3), tokens=st.integers(0, 50))
def test_a_plan_without_replicas_splits_as_the_general_rule(seed, shape, M, L, tokens):
    """``token_split``'s shortcut for plans without replicas (static steps, and relibra's
    steps where no copy pays) gives what the general rule gives; a plan with a replica takes
    the general rule."""
    from relibra_torch.planning.plan import general_split, _native_split

    N, g, E, R = shape
    topo = Topology(N, g, E, R)
    gen = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, tokens + 1, (M, L, N * g, E), generator=gen)
    placement = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    plan = native_plan(loads, topo, placement, "native")
    assert torch.equal(token_split(plan, loads), general_split(plan, loads))
    if R and tokens:  # one replica of the first GPU's first expert, on the last GPU
        one = native_plan(loads, topo, placement, "native")
        one.slot_expert_MLGJ[:, 0, -1, -1] = one.slot_expert_MLGJ[:, 0, 0, 0]   # in layer 0 only
        # the layers without a replica take the shortcut, layer 0 the general rule: the same split
        assert torch.equal(token_split(one, loads), general_split(one, loads))
        plan.slot_expert_MLGJ[..., -1, -1] = plan.slot_expert_MLGJ[..., 0, 0]
        assert _native_split(plan, loads) is None
