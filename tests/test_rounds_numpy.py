"""The planner's greedy rounds in numpy (``step_set._copies`` / ``_rebalance``,
``balance._rounds`` / ``align_slots``, ``plan._even_receive``) give exactly what the torch
loops they replaced gave (``tests/_rounds_refs.py``): through their callers, on random
loads and plans, with ``torch.equal``."""

from __future__ import annotations

from unittest import mock

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _rounds_refs as ref
from relibra_torch.planning import balance, plan, step_set
from relibra_torch.planning.plan import token_split
from relibra_torch.planning.topology import Topology
from relibra_torch.planning.traffic import traffic_replicas
from test_price_batched import _random_plan


def _loads(seed, M, L, topo, scale, hot):
    gen = torch.Generator().manual_seed(seed)
    E = topo.num_experts
    pop = torch.rand(E, generator=gen) ** 3
    pop[int(torch.randint(E, (1,), generator=gen))] += hot * pop.sum()
    return torch.poisson((pop / pop.sum()).expand(M, L, topo.num_gpus, E) * scale, generator=gen).long()


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


_cases = dict(seed=st.integers(0, 10_000), M=st.integers(1, 4), nodes=st.sampled_from([1, 2]),
              g=st.sampled_from([2, 4]), R=st.integers(1, 3), hot=st.sampled_from([0.0, 3.0]))


@settings(max_examples=25, deadline=None)
@given(**_cases, min_tokens=st.sampled_from([0, 20, 400]), keep=st.sampled_from([0, 1]))
def test_step_long_sets_as_the_torch_rounds(seed, M, nodes, g, R, hot, min_tokens, keep):
    topo = Topology(nodes, g, 4 * nodes * g, R)
    loads = _loads(seed, M, 2, topo, 300, hot)
    placement = torch.stack([torch.randperm(topo.num_experts, generator=torch.Generator().manual_seed(seed + l))
                             for l in range(2)])
    pre = traffic_replicas(loads, topo, placement, 1, 1e-6, 1e-5) if nodes > 1 else None
    got = step_set.step_long_sets(loads, topo, placement, min_tokens, pre, keep)
    got_margin = step_set.margin_sets(loads, topo, placement, min_tokens)
    with mock.patch.object(step_set, "_copies", ref.copies), mock.patch.object(step_set, "_rebalance", ref.rebalance):
        want = step_set.step_long_sets(loads, topo, placement, min_tokens, pre, keep)
        want_margin = step_set.margin_sets(loads, topo, placement, min_tokens)
    assert _same(got, want) and _same(got_margin, want_margin)


@settings(max_examples=25, deadline=None)
@given(**_cases, min_tokens=st.sampled_from([0, 20, 400]), prices=st.booleans(), free_empty=st.booleans())
def test_replicate_as_the_torch_rounds(seed, M, nodes, g, R, hot, min_tokens, prices, free_empty):
    topo = Topology(nodes, g, 4 * nodes * g, R)
    loads = _loads(seed, M, 2, topo, 300, hot)
    placement = topo.static_placement(2)
    pre = traffic_replicas(loads, topo, placement, 1, 1e-6, 1e-5) if nodes > 1 else None
    args = (loads, topo, placement, min_tokens, pre, min_tokens // 2, 1, (1e-6, 1e-5, 2e-5) if prices else None,
            free_empty and pre is not None)
    got = balance.replicate(*args)
    with mock.patch.object(balance, "_rounds", ref.rounds):
        want = balance.replicate(*args)
    assert _same(got, want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 3), L=st.integers(1, 3),
       shape=st.sampled_from([(2, 2, 8, 2), (2, 3, 12, 3), (3, 2, 12, 2), (2, 4, 16, 3)]),
       replica_p=st.sampled_from([0.3, 0.9]), zipf=st.sampled_from([0.0, 1.2]))
def test_token_split_as_the_torch_rounds(seed, M, L, shape, replica_p, zipf):
    p, loads = _random_plan(torch.Generator().manual_seed(seed), Topology(*shape), M, L, replica_p, zipf)
    got = token_split(p, loads)
    with mock.patch.object(plan, "_even_receive", ref.even_receive):
        want = token_split(p, loads)
    assert torch.equal(got, want)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 6), shape=st.sampled_from([(1, 4, 8, 2), (2, 2, 8, 3)]),
       replica_p=st.sampled_from([0.3, 0.9]))
def test_align_slots_as_the_torch_loop(seed, M, shape, replica_p):
    p, _ = _random_plan(torch.Generator().manual_seed(seed), Topology(*shape), M, 2, replica_p, 1.0)
    se, El = p.slot_expert_MLGJ, p.topology.experts_per_gpu
    for m in range(1, M, 2):  # the previous micro-batch's copies in other slots (one GPU holds an expert once)
        se[m, ..., El:] = se[m - 1, ..., El:].roll(1, -1)
        se[m, 0, 0, -1] = -1
    for first in (p.topology.experts_per_gpu, p.topology.slots_per_gpu):
        assert _same(balance.align_slots(se, p.slot_tokens_MLGJ, first), ref.align_slots(se, p.slot_tokens_MLGJ, first))
