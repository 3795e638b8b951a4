"""Balancing copies priced with residencies (planning.balance): slot alignment, the layer's
set check, and the step-long set a per-micro-batch threshold would refuse."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology, evaluate, relibra_plan, validate_plan
from relibra_torch.planning.balance import align_slots, replicate, replicate_step
from relibra_torch.planning.residency import residencies

# fills priced (powers of two: exact), one node: a copy needs 2000 tokens per micro-batch
TOKEN_S = 2.0 ** -27
PRICED = ReLibraConfig(reorder=False, compute_s_per_token=TOKEN_S, replica_fill_s_per_expert=2000 * TOKEN_S,
                       nvlink_latency_s=8 * TOKEN_S)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 4), scale=st.sampled_from([40, 400, 4000]))
def test_residency_aware_balancing_keeps_every_token_and_aligned_slots_keep_loads(seed, M, scale):
    topo = Topology(1, 4, 8, 2)
    gen = torch.Generator().manual_seed(seed)
    pop = torch.rand(8, generator=gen) ** 3
    loads = torch.poisson((pop / pop.sum()).expand(M, 2, 4, 8) * scale, generator=gen).long()
    plan = relibra_plan(loads, topo, config=PRICED)
    validate_plan(plan, loads)
    se, st_ = replicate(loads, topo, topo.static_placement(2))
    ae, at = align_slots(se, st_, topo.experts_per_gpu)
    for m in range(M):  # the same (GPU, expert, tokens) pairs, permuted inside the replica slots
        key = lambda e, t: sorted(zip(e[m].flatten().tolist(), t[m].flatten().tolist(),
                                      torch.arange(e[m].numel()).div(e.shape[-1], rounding_mode="floor").tolist()))
        assert key(se, st_) == key(ae, at)


def test_a_copy_repeated_all_step_is_filled_once_and_made():
    """One hot expert every micro-batch: per micro-batch a copy takes ~1500 tokens (< 2000,
    refused alone), but kept in its slot all step it is filled once and pays."""
    topo = Topology(1, 4, 4, 1)
    M = 8
    loads = torch.zeros(M, 1, 4, 4, dtype=torch.int64)
    loads[..., 0] = 1000          # expert 0 (GPU 0): 4000 tokens per micro-batch
    loads[..., 1:] = 100
    assert PRICED.min_replica_tokens_on(1) == 2000
    per_mb = replicate(loads, topo, topo.static_placement(1), 2000)
    assert (per_mb[0][..., 1:] < 0).all()                                  # refused per micro-batch
    plan = relibra_plan(loads, topo, config=PRICED)
    validate_plan(plan, loads)
    res = residencies(plan)
    assert plan.slot_expert_MLGJ[..., 1:].eq(0).any()                       # copies of expert 0 made
    assert int(res.fill_start_MLGJ.sum()) == int(res.fill_start_MLGJ[0].sum()) > 0   # all filled in m 0
    assert evaluate(plan, loads).gpu_load_MLG.amax(-1).max() < 4000 - 1000


def test_copies_whose_layer_saving_misses_the_latency_are_dropped():
    topo = Topology(1, 2, 2, 1)
    loads = torch.zeros(1, 1, 2, 2, dtype=torch.int64)
    loads[..., 0] = 1100           # GPU 0: 2200 tokens, GPU 1: 0: a copy takes 1100 >= 1000
    cfg = ReLibraConfig(reorder=False, compute_s_per_token=1e-8, replica_fill_s_per_expert=1e-5)
    se, _ = replicate_step(loads, topo, topo.static_placement(1), cfg.min_replica_tokens_on(1), None, 0, 1,
                           (1e-8, 1e-5, 0.0))
    assert (se[..., 1:] == 0).any()                                        # 1100 * 1e-8 >= 1e-5
    se, _ = replicate_step(loads, topo, topo.static_placement(1), cfg.min_replica_tokens_on(1), None, 0, 1,
                           (1e-8, 1e-5, 2e-6))
    assert (se[..., 1:] < 0).all()                                         # + 2 us latency: no longer
