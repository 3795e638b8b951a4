"""relibra's fast path (planning/fastpath.py) gives exactly the plan of the full search when
it is taken, and it is taken at real micro-batch sizes where nothing pays."""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import relibra_torch.planning.relibra as relibra_mod
from relibra_torch.planning import Topology, relibra_plan
from relibra_torch.planning.fastpath import nothing_pays
from relibra_torch.planning.pricing import priced_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from standin_loads import standin_loads  # noqa: E402


def full_search(monkeypatch, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setattr(relibra_mod, "fast_plan", lambda *a, **k: None)
        return relibra_plan(*args, **kwargs)


def same_plan(a, b):
    return (torch.equal(a.placement_LE, b.placement_LE) and torch.equal(a.slot_expert_MLGJ, b.slot_expert_MLGJ)
            and torch.equal(a.slot_tokens_MLGJ, b.slot_tokens_MLGJ))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), tokens=st.sampled_from([1, 4, 16, 64, 512]), k=st.sampled_from([1, 2, 4]),
       zipf=st.sampled_from([0.0, 0.5, 1.5]), collapse=st.sampled_from([0.0, 0.95]),
       dispatch=st.sampled_from(["flat", "hierarchical"]), shuffled=st.booleans(), choose=st.booleans())
def test_fast_path_equals_the_full_search(monkeypatch, seed, tokens, k, zipf, collapse, dispatch, shuffled, choose):
    topo = Topology(2, 2, 16, 2)
    loads = standin_loads(16, k, 2, 2, 4, tokens, steps=1, zipf=zipf, collapse=collapse, seed=seed)[0]
    cfg = priced_config(2048, 768, "h200", dispatch=dispatch, top_k=k, choose=choose)
    g = torch.Generator().manual_seed(seed)
    prev = torch.stack([torch.randperm(16, generator=g) for _ in range(2)]) if shuffled else None
    fast = relibra_plan(loads, topo, prev, cfg)
    full = full_search(monkeypatch, loads, topo, prev, cfg)
    assert same_plan(fast, full)


@pytest.mark.parametrize("tokens", [16, 64])
def test_fast_path_is_taken_at_real_micro_batch_sizes_and_matches(monkeypatch, tokens):
    """128 experts top-8 at EP 32 (4 x 8), 16-64 tokens per GPU, mild skew: no copy and no
    move pays, the fast path proves it, and the full search agrees."""
    topo = Topology(4, 8, 128, 2)
    loads = standin_loads(128, 8, 4, 8, 32, tokens, steps=1, zipf=0.3, seed=1)[0]
    cfg = priced_config(2048, 768, "h200", dispatch="hierarchical", top_k=8)
    prev = topo.static_placement(4)
    assert nothing_pays(loads, topo, prev, cfg)
    fast = relibra_plan(loads, topo, prev, cfg)
    assert bool((fast.slot_expert_MLGJ[..., topo.experts_per_gpu:] < 0).all())
    assert same_plan(fast, full_search(monkeypatch, loads, topo, prev, cfg))


def test_fast_path_is_not_taken_where_copies_pay():
    topo = Topology(4, 8, 128, 2)
    loads = standin_loads(128, 2, 2, 4, 32, 64, steps=1, collapse=0.95, factor=16, seed=2)[0]
    cfg = priced_config(2048, 768, "h200", dispatch="hierarchical", top_k=2)
    assert not nothing_pays(loads, topo, topo.static_placement(2), cfg)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(1, 4, 16), (2, 2, 16), (2, 4, 32), (4, 2, 32), (2, 4, 8),
                                                   (8, 2, 32), (6, 1, 12)]),
       R=st.sampled_from([0, 1, 2, 3]), M=st.sampled_from([2, 4, 8]), tokens=st.sampled_from([4, 16, 64, 256]),
       k=st.sampled_from([1, 2, 8]), zipf=st.sampled_from([0.3, 1.0, 1.5]), collapse=st.sampled_from([0.0, 0.95]),
       factor=st.sampled_from([1, 8]), dispatch=st.sampled_from(["flat", "hierarchical"]),
       model=st.sampled_from([(2048, 768), (768, 3072), (4096, 14336)]), shuffled=st.booleans(), choose=st.booleans())
def test_fast_path_equals_the_full_search_on_skewed_and_collapsed_loads(monkeypatch, seed, shape, R, M, tokens, k, zipf,
                                                                        collapse, factor, dispatch, model, shuffled,
                                                                        choose):
    """The per-swap reordering bounds and the exactly planned balancing rows (fastpath.py)
    on Zipf 1.0-1.5 and collapsed routers, top-1/2/8, 1 to 8 nodes (a move priced at ``4 / N``
    of a transfer per ``g`` moves beyond 4, reorder_greedy.move_price_s), ``R = 0`` (GPU swaps inside
    a node, planning/gpu_pack.py) to 3: taken or not, the plan is the full search's."""
    N, g, E = shape
    topo = Topology(N, g, E, R)
    loads = standin_loads(E, k, 2, M, N * g, tokens, steps=1, zipf=zipf, collapse=collapse, factor=factor,
                          seed=seed)[0]
    cfg = priced_config(*model, "h200", dispatch=dispatch, top_k=k, choose=choose)
    gen = torch.Generator().manual_seed(seed)
    prev = torch.stack([torch.randperm(E, generator=gen) for _ in range(2)]) if shuffled else None
    fast = relibra_plan(loads, topo, prev, cfg)
    full = full_search(monkeypatch, loads, topo, prev, cfg)
    assert same_plan(fast, full)


@pytest.mark.parametrize("tokens,zipf,collapse,drift", [(64, 0.3, 0.0, 0), (64, 0.3, 0.0, 2), (16, 1.0, 0.0, 0),
                                                         (16, 0.3, 0.95, 0)])
def test_fast_path_is_taken_on_skewed_small_micro_batches(monkeypatch, tokens, zipf, collapse, drift):
    """Where the whole-step bounds fall short (a swap's and the residency plans' are needed,
    as at 48 layers x 32 micro-batches in benchmarks/planner.py): the plan is the full
    search's, with and without choose, and the fast path is taken exactly where that plan
    has no copy and no move (on 64 tokens at Zipf 0.3 and on the collapsed router the
    step-long set over every free slot, planning.step_set, pays). ``drift`` seeds torch's
    global generator, which standin_loads' per-micro-batch drift draws from (unseeded, the
    loads depended on the tests run before: at drift 2 relibra makes no copy without
    ``choose`` and ``choose`` copies from its plain plan without traffic replicas, which the
    fast path once left unbounded)."""
    topo = Topology(4, 8, 128, 2)
    torch.manual_seed(drift)
    loads = standin_loads(128, 8, 4, 32, 32, tokens, steps=1, zipf=zipf, collapse=collapse, seed=0)[0]
    El = topo.experts_per_gpu
    for choose in (False, True):
        cfg = priced_config(2048, 768, "h200", dispatch="hierarchical", top_k=8, choose=choose)
        full = full_search(monkeypatch, loads, topo, None, cfg)
        idle = not bool((full.slot_expert_MLGJ[..., El:] >= 0).any()) and torch.equal(
            full.placement_LE, topo.static_placement(4))
        assert nothing_pays(loads, topo, topo.static_placement(4), cfg) == idle
        assert same_plan(relibra_plan(loads, topo, None, cfg), full)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(1, 4, 16), (2, 2, 16), (4, 2, 32)]),
       R=st.sampled_from([1, 2, 3]), r0=st.sampled_from([0, 1]), need=st.sampled_from([1, 5, 20]))
def test_replicate_node_rows_are_those_of_replicate(seed, shape, R, r0, need):
    from relibra_torch.planning.balance import replicate, replicate_node_rows
    N, g, E = shape
    topo, M, L = Topology(N, g, E, R), 4, 3
    r0 = min(r0, R)
    loads = standin_loads(E, 2, L, M, N * g, 32, steps=1, zipf=1.0, seed=seed)[0]
    gen = torch.Generator().manual_seed(seed)
    place = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    pre = None if not r0 else (torch.full((M, L, N * g, r0), -1), torch.zeros(M, L, N * g, r0, dtype=torch.int64))
    se, st_ = replicate(loads, topo, place, need, pre, need + 3)
    El = topo.experts_per_gpu
    natives = torch.empty_like(place).scatter_(1, place, torch.arange(E).expand(L, E)).view(L, N, g, El)
    node_L = torch.randint(0, N, (L,), generator=gen)
    rows = torch.arange(L)
    home = loads.view(M, L, N, g, E).sum(3)[:, rows, node_L]
    rep, load = replicate_node_rows(loads.sum(2), home, natives[rows, node_L], R, r0, need, need + 3)
    se_n = se.view(M, L, N, g, -1)[:, rows, node_L]
    assert torch.equal(rep, se_n[..., El:])
    assert torch.equal(load, st_.view(M, L, N, g, -1)[:, rows, node_L].sum(-1))


def test_fast_path_weighs_the_step_long_set_at_one_slot(monkeypatch):
    """At ``R = 1`` on two nodes traffic replicas reserve no slot (``R // 2 = 0``), so the
    plain plan balances without them and ``replicate_step`` also weighs its step-long set
    (plan ``c``): the fast path must bound it there too (it took ``R`` for ``R // 2`` and
    returned the plan without copies where the full search makes 16; found by hypothesis)."""
    E = 32
    topo = Topology(2, 4, E, 1)
    loads = standin_loads(E, 8, 2, 8, 8, 4, steps=1, zipf=1.0, collapse=0.0, factor=8, seed=6034)[0]
    cfg = priced_config(4096, 14336, "h200", dispatch="flat", top_k=8)
    gen = torch.Generator().manual_seed(6034)
    prev = torch.stack([torch.randperm(E, generator=gen) for _ in range(2)])
    full = full_search(monkeypatch, loads, topo, prev, cfg)
    assert bool((full.slot_expert_MLGJ[..., topo.experts_per_gpu:] >= 0).any())
    assert same_plan(relibra_plan(loads, topo, prev, cfg), full)
