"""relibra's plain plan keeps, per layer, the cheapest number of traffic slots at the exact
step price (planning/plain.py): never priced above any of the plans it weighs (traffic
replicas in ``R // 2`` slots; none; at ``R = 1`` the one slot, per node or per GPU, in the
layers where it holds some), whatever the loads."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from benchmarks.standin_loads import standin_loads
from relibra_torch.planning import PlannedOnlinePlanner, StepPlan, Topology
from relibra_torch.planning.balance import replicate
from relibra_torch.planning.plain import _balanced, _has_copies, layers_price, _traffic, _without_copies, plain_plan
from relibra_torch.planning.price import moe_seconds_ML, replica_seconds_ML, step_seconds
from relibra_torch.planning.pricing import priced_config


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), R=st.sampled_from([1, 2, 3]), k=st.sampled_from([1, 2, 8]),
       zipf=st.sampled_from([0.3, 1.0]), collapse=st.sampled_from([0.0, 0.95]), factor=st.sampled_from([1, 8, 64]),
       nodes=st.sampled_from([1, 2]), hardware=st.sampled_from(["h200", "h800"]),
       dims=st.sampled_from([(768, 3072), (4096, 14336)]), E=st.sampled_from([8, 16]))
@example(seed=6229, R=2, k=1, zipf=1.0, collapse=0.0, factor=64, nodes=2, hardware="h200", dims=(768, 3072),
         E=16)   # no traffic replica: 7.80 ms with their slots empty, 7.67 without
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
    # (prefilled, traffic slots per GPU, layers weighed: None = every layer)
    pres = [(None, False, None)]
    if R // 2 and nodes > 1:
        pre = _traffic(loads, topo, place, R // 2, cfg)
        # the plan without traffic slots too, also where traffic replicas make none (their
        # reserved slots would stay empty)
        pres = [(pre, False, None), (None, False, None)]
    if R == 1 and nodes > 1:
        one = _traffic(loads, topo, place, 1, cfg)
        made_L = (one[0] >= 0).flatten(2).any(2).any(0)   # weighed where they plan one
        pres += [(one, False, made_L), (one, True, made_L)] if bool(made_L.any()) else []
    plain = dataclasses.replace(cfg, balance=False)

    def at_most(candidate, layers_L):  # the plan prices at most the candidate in the layers weighed
        if layers_L is not None:
            w = layers_L.view(1, -1, 1, 1)
            candidate = StepPlan(topo, place, torch.where(w, candidate.slot_expert_MLGJ, plan.slot_expert_MLGJ),
                                 torch.where(w, candidate.slot_tokens_MLGJ, plan.slot_tokens_MLGJ), "relibra",
                                 place.clone())
        assert price <= step_seconds(candidate, loads, cfg) * (1 + 1e-12)

    for k, (pre, free, layers_L) in enumerate(pres):
        capped: list = []   # the capped step-long sets handed over (first choice, without traffic slots)
        with_copies = _balanced(loads, topo, place, place, pre, cfg, free, capped if k == 0 and pre is None else None)
        assert torch.equal(with_copies.slot_tokens_MLGJ.sum((2, 3)), loads.sum((2, 3)))
        at_most(with_copies, layers_L)
        # without balancing's copies in the layers where their fills cost more than the
        # compute they save (the layers plain_plan weighs that variant in)
        bare = _without_copies(with_copies, _balanced(loads, topo, place, place, pre, plain, free), cfg)
        if bare is not None:
            at_most(bare, layers_L)
        for se, tok in capped:
            at_most(StepPlan(topo, place, se, tok, "relibra", place.clone()), None)

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
    assert torch.allclose(layers_price(plan, idx, loads, cfg), full_L[idx], rtol=1e-12, atol=0)
    assert layers_price(plan, idx[:0], loads, cfg).shape == (0,)


def test_one_slot_per_gpu_spreads_a_collapsed_routers_hot_expert_over_both_nodes():
    """``R = 1`` on two nodes of 4 GPUs, 8 experts top-1, a collapsed router (95% of tokens
    to one expert) at 64 x 64 tokens per GPU (never_behind's ``switch-8/collapsed/t64x64/2x4``
    was 1.44x online-global-planned): the traffic replica of the hot expert takes one GPU's
    slot on the other node and its two-hop copies the other GPUs' slots there
    (``balance.replicate(free_empty=True)``), so the plain plan prices within 1% of
    online-global-planned's, which copies it on every GPU."""
    topo = Topology(2, 4, 8, 1)
    loads = standin_loads(8, 1, 2, 4, 8, 64, steps=1, zipf=1.0, collapse=0.95, factor=64, seed=0)[0]
    cfg = priced_config(768, 3072, "h200", dispatch="hierarchical", top_k=1)
    place = topo.static_placement(2)
    plan = plain_plan(loads, topo, place, place, cfg)
    online = PlannedOnlinePlanner(topo).plan(loads)
    assert step_seconds(plan, loads, cfg) <= 1.01 * step_seconds(online, loads, cfg)
    # the hot expert has an instance on every GPU of the node that does not own it
    hot_L = loads.sum((0, 2)).argmax(-1)
    for l in range(2):
        other = 1 - int(place[l, hot_L[l]]) // topo.experts_per_node
        held_G = (plan.slot_expert_MLGJ[:, l] == hot_L[l]).any(-1).all(0)
        assert bool(held_G.view(2, 4)[other].all())


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), R=st.sampled_from([2, 4]), k=st.sampled_from([1, 2]),
       holes=st.integers(0, 2 ** 16 - 1))
def test_free_empty_slots_keep_every_prefilled_replica(seed, R, k, holes):
    """``replicate(free_empty=True)``: balancing may use a GPU's prefilled slots that hold
    nothing, never one that holds a replica (which keeps its expert and at least what it did
    not give away); every token is placed once, no GPU holds more than ``R`` copies."""
    E, r0 = 16, R // 2
    topo = Topology(2, 4, E, R)
    loads = standin_loads(E, k, 2, 3, 8, 32, steps=1, zipf=1.0, collapse=0.5, factor=8, seed=seed)[0]
    cfg = priced_config(768, 3072, "h200", dispatch="hierarchical", top_k=k)
    place = topo.static_placement(2)
    # traffic replicas as planning.traffic makes them: each node's slots hold distinct experts
    # of the other node with that node's demand for them, with holes where ``holes`` says
    # (micro-batches where a slot holds nothing)
    M, L, B = loads.shape[0], loads.shape[1], 4 * r0
    demand_MLNE = loads.view(M, L, 2, 4, E).sum(3)
    gen = torch.Generator().manual_seed(seed)
    pre_e = torch.stack([torch.randperm(E // 2, generator=gen)[:B] + (1 - n) * (E // 2) for n in (0, 1)])  # [N, B]
    pre_e = pre_e.view(1, 1, 2, B).expand(M, L, 2, B).clone()
    hole = ((holes >> torch.arange(M * L * 2 * B).remainder(16)) & 1).bool().view(M, L, 2, B)
    pre_e = pre_e.masked_fill(hole, -1)
    pre_q = demand_MLNE.gather(3, pre_e.clamp(min=0)) * (pre_e >= 0)
    pre_e, pre_q = pre_e.view(M, L, 8, r0), pre_q.view(M, L, 8, r0)
    load = loads.sum(2)
    left = load - torch.zeros_like(load).scatter_add_(2, pre_e.clamp(min=0).flatten(2), pre_q.flatten(2))
    assert bool((left >= 0).all())
    se, sq = replicate(loads, topo, place, cfg.min_replica_tokens_on(2), (pre_e, pre_q), 0, 1, None, True)
    assert torch.equal(sq.sum((2, 3)), load.sum(-1))
    per_expert = torch.zeros_like(load).scatter_add_(2, se.clamp(min=0).flatten(2), (sq * (se >= 0)).flatten(2))
    assert torch.equal(per_expert, load)
    El = topo.experts_per_gpu
    copies = se[..., El:]
    assert bool((((copies >= 0).sum(-1)) <= R).all())
    for e_pre in pre_e.unbind(-1):   # each prefilled replica still on its GPU
        held = (copies == e_pre.unsqueeze(-1)).any(-1)
        assert bool(held[e_pre >= 0].all())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), k=st.sampled_from([1, 2, 8]), g=st.sampled_from([4, 8]),
       collapse=st.sampled_from([0.5, 0.95]), factor=st.sampled_from([8, 64]), hardware=st.sampled_from(["h200", "h800"]))
@example(seed=0, k=1, g=4, collapse=0.95, factor=64, hardware="h200")   # free-slot copies made
def test_the_per_gpu_traffic_plan_without_copies_is_the_per_node_plan(seed, k, g, collapse, factor, hardware):
    """``R = 1`` on two nodes: balancing's copies in the per-GPU traffic plan sit in free
    traffic slots (``free_empty``), which ``plain._has_copies`` does not see, so that plan's
    variant without them is not built. It need not be: without balancing's copies that plan
    is exactly the per-node traffic plan (no GPU has a free slot there), which
    ``plain_plan`` weighs in the same layers, at the same price."""
    E = 16
    topo = Topology(2, g, E, 1)
    loads = standin_loads(E, k, 3, 4, 2 * g, 32, steps=1, zipf=1.0, collapse=collapse, factor=factor, seed=seed)[0]
    cfg = priced_config(768, 3072, hardware, dispatch="hierarchical", top_k=k)
    place = topo.static_placement(3)
    pre = _traffic(loads, topo, place, 1, cfg)
    plain = dataclasses.replace(cfg, balance=False)
    per_node = _balanced(loads, topo, place, place, pre, cfg, False)
    bare = _balanced(loads, topo, place, place, pre, plain, True)
    assert torch.equal(bare.slot_expert_MLGJ, per_node.slot_expert_MLGJ)
    assert torch.equal(bare.slot_tokens_MLGJ, per_node.slot_tokens_MLGJ)
    per_gpu = _balanced(loads, topo, place, place, pre, cfg, True)
    assert not _has_copies(per_gpu, pre)   # why the variant is not built
    if (seed, k, g, collapse, factor) == (0, 1, 4, 0.95, 64):   # the example is not vacuous
        assert bool((pre[0] >= 0).any()) and not torch.equal(per_gpu.slot_expert_MLGJ, per_node.slot_expert_MLGJ)
