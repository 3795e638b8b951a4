"""relibra's step-long set over every free slot (planning.step_set): tokens kept, copies all
step, shares that pay, traffic replicas shared over their node by two-hop copies."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, StepPlan, Topology, evaluate, relibra_plan, validate_plan
from relibra_torch.planning.residency import residencies
from relibra_torch.planning.step_set import margin_sets, step_long_set
from relibra_torch.planning.traffic import traffic_replicas


def _loads(seed, M, L, topo, scale, hot=0.0):
    gen = torch.Generator().manual_seed(seed)
    E = topo.num_experts
    pop = torch.rand(E, generator=gen) ** 3
    pop[0] += hot * pop.sum()
    return torch.poisson((pop / pop.sum()).expand(M, L, topo.num_gpus, E) * scale, generator=gen).long()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 4), nodes=st.sampled_from([1, 2]), R=st.integers(1, 3),
       min_tokens=st.sampled_from([0, 50, 5000]), hot=st.sampled_from([0.0, 3.0]))
def test_every_token_kept_copies_stay_all_step_and_pay_their_fill(seed, M, nodes, R, min_tokens, hot):
    topo = Topology(nodes, 4, 16, R)
    loads = _loads(seed, M, 2, topo, 400, hot)
    placement = topo.static_placement(2)
    pre = None
    if nodes > 1:  # traffic replicas in the first slot, as relibra plans them
        pre = traffic_replicas(loads, topo, placement, 1, 1e-6, 1e-5)
    se, tok = step_long_set(loads, topo, placement, min_tokens, pre, keep_prefilled=1)
    validate_plan(StepPlan(topo, placement, se, tok, "t", placement.clone()), loads)
    El, r0 = topo.experts_per_gpu, 0 if pre is None else 1
    copies = se[..., El + r0:]
    assert (copies == copies[:1]).all()                                   # same slots every micro-batch
    g = topo.gpus_per_node
    for l in range(2):
        held = se[:, l].reshape(M, topo.num_nodes, -1)                   # every slot of each node
        for n in range(topo.num_nodes):
            mine = copies[0, l, n * g:(n + 1) * g].flatten()
            mine = mine[mine >= 0]
            first = held[:, n, :].reshape(M, g, -1)[..., :El + r0].reshape(M, -1)
            # a copy shares a native of its node, or a traffic replica held there all step
            assert all(bool((first == e).any(-1).all()) for e in mine.tolist())
            # each copy's step share (its item's step tokens over its instances) pays its fill
            if pre is None and mine.numel():
                step_e = loads[:, l].sum((0, 1))
                count = (held[0, n].unsqueeze(-1) == mine.unique()).sum(0)
                assert (step_e[mine.unique()] >= min_tokens * count).all()
    if pre is not None:  # a shared traffic replica keeps a token where its copies have some
        pe, pq = se[..., El:El + 1], tok[..., El:El + 1]
        shared = (pe >= 0) & (pe.unsqueeze(-1) == copies.unsqueeze(-2)).flatten(-2).any(-1, keepdim=True)
        assert (pq[shared & (pre[1] > 0)] >= 1).all()


def test_a_collapsed_expert_spreads_over_both_nodes_with_one_inter_node_fill():
    """One expert takes most tokens on two nodes: the traffic replica of it on the other node
    is shared with two-hop copies there, so both nodes' GPUs end near their mean, and the
    expert crosses nodes once per step (its other copies fill over NVLink). Per micro-batch a
    copy would take ~250 tokens, short of a fill's worth (800); all step it takes ~2,000."""
    topo = Topology(2, 4, 8, 2)
    M, E = 8, 8
    loads = torch.full((M, 1, 8, E), 20, dtype=torch.int64)
    loads[..., 0] = 250
    cfg = ReLibraConfig(reorder=False, dispatch="hierarchical", compute_s_per_token=5e-8,
                        cross_node_s_per_token=3.6e-7, replica_fill_s_per_expert=4e-5,
                        cross_replica_fill_s_per_expert=3.2e-4, intra_node_s_per_token=4.5e-8,
                        inter_node_latency_s=2.5e-5, nvlink_latency_s=1.2e-5)
    plan = relibra_plan(loads, topo, config=cfg)
    validate_plan(plan, loads)
    load_G = evaluate(plan, loads).gpu_load_MLG
    mean = loads[0, 0].sum() / topo.num_gpus
    assert float(load_G.amax(-1).max()) < 1.3 * float(mean)               # was ~4x the mean on one GPU
    res = residencies(plan)
    node_G = torch.arange(topo.num_gpus) // topo.gpus_per_node
    owner_node = int(plan.placement_LE[0, 0]) // topo.experts_per_gpu // topo.gpus_per_node
    remote = (plan.slot_expert_MLGJ[0, 0] == 0) & (node_G != owner_node).view(-1, 1)
    assert int(remote.sum()) >= 2                                          # several copies on the other node
    assert int((res.fill_start_MLGJ[:, 0] & remote).sum()) == int(remote.sum())   # each filled once


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 4), nodes=st.sampled_from([1, 2]), R=st.integers(1, 3),
       min_tokens=st.sampled_from([0, 50, 800, 5000]), hot=st.sampled_from([0.0, 3.0]))
def test_margin_sets_the_second_set_pays_each_copy_at_the_margin(seed, M, nodes, R, min_tokens, hot):
    """``margin_sets``: the share rule's set (:func:`step_long_set`), then, only where its copies
    differ, the margin rule's: each item with ``n`` instances on a node has
    ``w >= min_tokens * n * (n - 1)`` (its last instance took a fill's worth off each of the
    others), while the share rule only has ``w >= min_tokens * n``. Both are valid step-long
    plans that keep every token."""
    topo = Topology(nodes, 4, 16, R)
    loads = _loads(seed, M, 2, topo, 400, hot)
    placement = topo.static_placement(2)
    sets = margin_sets(loads, topo, placement, min_tokens)
    assert 1 <= len(sets) <= 2
    share = step_long_set(loads, topo, placement, min_tokens)
    margin = step_long_set(loads, topo, placement, min_tokens, marginal=True)
    assert torch.equal(sets[0][0], share[0]) and torch.equal(sets[0][1], share[1])
    assert torch.equal(sets[-1][0], margin[0]) and torch.equal(sets[-1][1], margin[1])
    assert (len(sets) == 2) == (not torch.equal(share[0], margin[0]))
    El, g = topo.experts_per_gpu, topo.gpus_per_node
    for se, tok in sets:
        validate_plan(StepPlan(topo, placement, se, tok, "t", placement.clone()), loads)
    se = margin[0]
    for l in range(2):
        step_e = loads[:, l].sum((0, 1))
        for n in range(topo.num_nodes):
            node = se[0, l, n * g:(n + 1) * g].flatten()
            copied = se[0, l, n * g:(n + 1) * g, El:].flatten()
            for e in copied[copied >= 0].unique().tolist():
                count = int((node == e).sum())
                assert int(step_e[e]) >= min_tokens * count * (count - 1)
