"""relibra's plain plan keeps, per layer, the cheapest number of traffic slots at the exact
step price (planning/plain.py): never priced above any of the plans it weighs (traffic
replicas in ``R // 2`` slots; none where those make some; at ``R = 1`` the one slot where it
holds some), whatever the loads."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.standin_loads import standin_loads
from relibra_torch.planning import StepPlan, Topology
from relibra_torch.planning.plain import _balanced, _layers_price, _traffic, _without_copies, plain_plan
from relibra_torch.planning.price import moe_seconds_ML, replica_seconds_ML, step_seconds
from relibra_torch.planning.pricing import priced_config


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), R=st.sampled_from([1, 2, 3]), k=st.sampled_from([1, 2, 8]),
       zipf=st.sampled_from([0.3, 1.0]), collapse=st.sampled_from([0.0, 0.95]), factor=st.sampled_from([1, 8, 64]),
       nodes=st.sampled_from([1, 2]), hardware=st.sampled_from(["h200", "h800"]),
       dims=st.sampled_from([(768, 3072), (4096, 14336)]), E=st.sampled_from([8, 16]))
def test_plain_plan_is_priced_at_most_each_traffic_choice(seed, R, k, zipf, collapse, factor, nodes, hardware, dims,
                                                         E):
    """The plain plan prices at most each traffic choice it weighs, each of those without
    balancing's copies (traffic replicas kept) where the copies' fills cost more than the
    compute they save (on H800's slower NVLink: docs/results.md, cause 3), and each capped
    step-long set it is handed (cause 4)."""
    topo = Topology(nodes, 8 // nodes, E, R)
    loads = standin_loads(E, k, 3, 4, 8, 16, steps=1, zipf=zipf, collapse=collapse, factor=factor, seed=seed)[0]
    cfg = priced_config(*dims, hardware, dispatch="hierarchical" if nodes > 1 else "flat", top_k=k)
    place = topo.static_placement(3)
    plan = plain_plan(loads, topo, place, place, cfg)
    # every slot's tokens add up to the loads (nothing lost, nothing invented)
    assert torch.equal(plan.slot_tokens_MLGJ.sum((2, 3)), loads.sum((2, 3)))
    price = step_seconds(plan, loads, cfg)
    pres = [None]
    if R // 2 and nodes > 1:
        pre = _traffic(loads, topo, place, R // 2, cfg)
        # where traffic replicas make none their slots stay reserved (the fast path's bounds
        # assume it): the plan without them is a candidate only where they make some
        pres = [pre, None] if bool((pre[0] >= 0).any()) else [pre]
    if R == 1 and nodes > 1:
        one = _traffic(loads, topo, place, 1, cfg)
        pres += [one] if bool((one[0] >= 0).any()) else []
    plain = dataclasses.replace(cfg, balance=False)
    for k, pre in enumerate(pres):
        capped: list = []   # the capped step-long sets handed over (first choice, without traffic slots)
        with_copies = _balanced(loads, topo, place, place, pre, cfg, capped if k == 0 and pre is None else None)
        assert price <= step_seconds(with_copies, loads, cfg) * (1 + 1e-12)
        # without balancing's copies in the layers where their fills cost more than the
        # compute they save (the layers plain_plan weighs that variant in)
        bare = _without_copies(with_copies, _balanced(loads, topo, place, place, pre, plain), cfg)
        if bare is not None:
            assert price <= step_seconds(bare, loads, cfg) * (1 + 1e-12)
        for se, tok in capped:
            assert price <= step_seconds(StepPlan(topo, place, se, tok, "relibra", place.clone()), loads, cfg) * (
                1 + 1e-12)


def test_traffic_replicas_that_cost_more_than_they_save_are_dropped():
    """Two nodes of 4 GPUs, 8 experts top-1, Zipf loads at 64 tokens per GPU x 64: the
    traffic replicas alone price above the plan without them; the plain plan must not keep
    them where they lose."""
    topo = Topology(2, 4, 8, 2)
    loads = standin_loads(8, 1, 4, 8, 8, 64, steps=1, zipf=1.0, factor=64, seed=7)[0]
    cfg = priced_config(768, 3072, "h200", dispatch="hierarchical", top_k=1)
    place = topo.static_placement(4)
    with_traffic = _balanced(loads, topo, place, place, _traffic(loads, topo, place, 1, cfg), cfg)
    without = _balanced(loads, topo, place, place, None, cfg)
    plan = plain_plan(loads, topo, place, place, cfg)
    assert step_seconds(plan, loads, cfg) <= min(step_seconds(with_traffic, loads, cfg),
                                                 step_seconds(without, loads, cfg)) * (1 + 1e-12)
    off = dataclasses.replace(cfg, cross_node_replicas=False)
    assert step_seconds(plan, loads, cfg) <= step_seconds(plain_plan(loads, topo, place, place, off), loads, cfg) * (1 + 1e-12)


def test_layers_priced_apart_equal_the_whole_plans_layers():
    """plain.py prices each candidate only on the layers where it differs from the first:
    those layers' prices are the whole plan's, and no layer prices to nothing."""
    topo = Topology(2, 4, 16, 2)
    loads = standin_loads(16, 2, 5, 4, 8, 64, steps=1, zipf=1.0, collapse=0.95, factor=64, seed=1)[0]
    cfg = priced_config(2048, 768, "h200", dispatch="hierarchical", top_k=2)
    place = topo.static_placement(5)
    plan = plain_plan(loads, topo, place, place, cfg)
    full_L = (moe_seconds_ML(plan, loads, cfg) + replica_seconds_ML(plan, cfg)).sum(0)
    idx = torch.tensor([1, 3, 4])
    assert torch.allclose(_layers_price(plan, idx, loads, cfg), full_L[idx], rtol=1e-12, atol=0)
    assert _layers_price(plan, idx[:0], loads, cfg).shape == (0,)
