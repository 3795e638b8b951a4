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
