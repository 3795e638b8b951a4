"""The planner hook in a real training loop on 4 gloo ranks (2 nodes x 2 GPUs).

fp32 tolerances: 1e-5 relative (summation order differs between placements and between
one process and four).
"""

import dataclasses

import pytest
import torch

import _hook_fns
from relibra_torch.hook import count_loads
from relibra_torch.planning import Topology
from relibra_torch.planning.pricing import priced_config
from relibra_torch.testing import RankFailure, RankPool

CFG = _hook_fns.custom_loop.LoopConfig(steps=10, micro_batches=2, samples_per_micro_batch=2,
                                        max_tokens_per_micro_batch=48)
TOPO = Topology(CFG.nodes, CFG.gpus_per_node, CFG.num_experts, CFG.replica_slots)
RTOL = 1e-5


@pytest.fixture(scope="module")
def pool():
    with RankPool(CFG.nodes * CFG.gpus_per_node, timeout_s=600) as p:
        yield p


@pytest.fixture(scope="module")
def static_run(pool):
    return pool.run(_hook_fns.train, CFG, "static")[0]


def _assert_same_training(a_losses, a_state, b_losses, b_state):
    torch.testing.assert_close(torch.tensor(a_losses, dtype=torch.float64),
                               torch.tensor(b_losses, dtype=torch.float64), rtol=RTOL, atol=0)
    assert a_state.keys() == b_state.keys()
    for k in a_state:
        scale = a_state[k].abs().max().clamp(min=1e-6)
        err = (a_state[k] - b_state[k]).abs().max() / scale
        assert err <= RTOL, f"{k}: relative difference {err:.2e}"


def _losses(run):
    return [h["loss"] for h in run["history"]]


def test_reordering_before_every_step_matches_no_reordering(pool, static_run):
    """Ten AdamW steps, a new placement (experts + optimizer state moved) before each."""
    shuffled = pool.run(_hook_fns.train, CFG, _hook_fns.ShufflePlanner(TOPO))[0]
    assert all(h["migrated"] > 0 for h in shuffled["history"])
    _assert_same_training(_losses(static_run), static_run["state"], _losses(shuffled), shuffled["state"])


def test_relibra_matches_one_process_and_balances(pool, static_run):
    # planner priced for the layers' (tiny) expert size: moving and copying experts is cheap;
    # collective latency unpriced (priced, 2 x 25 us per layer's first copy, no copy of this
    # toy's few tokens pays, and the layer would rightly run static's plan)
    config = priced_config(CFG.dim, CFG.hidden_dim, "h200", nvlink_latency_s=0.0, inter_node_latency_s=0.0)
    runs = pool.run(_hook_fns.train_checking_schedules, CFG, "relibra", {"config": config})
    # every rank (ranks 2 and 3 plan no layer) installs the one-pair path's schedules, with the
    # token splits gathered from the ranks' shares, and no forward degrades
    assert all(not run["differ"] and not any(run["degraded"]) for run in runs), [
        (run["differ"], run["degraded"]) for run in runs]
    relibra = runs[0]
    reference = _hook_fns.reference_single_process(CFG)
    _assert_same_training(reference["losses"], reference["state"], _losses(relibra), relibra["state"])
    # balance measured from the layers' counters (the loop also asserts, per rank and
    # micro-batch, that the executed tokens equal the plan's prediction exactly)
    mean = lambda run: torch.tensor([v for h in run["history"] for mb in h["measured_imbalance_ML"] for v in mb]).mean()
    assert mean(relibra) < mean(static_run) - 0.2


def test_planner_failure_on_one_rank_falls_back_everywhere(pool, static_run):
    runs = pool.run(_hook_fns.train_catching_warnings, CFG, _hook_fns.FailOnRankOne(TOPO))
    for rank, run in enumerate(runs):
        assert all(h["fell_back"] for h in run["history"])
        assert run["warnings"], f"rank {rank} did not warn"
    assert "exploded on rank 1" in runs[1]["warnings"][0]
    assert "another EP rank" in runs[0]["warnings"][0]
    # slower, never wrong
    _assert_same_training(_losses(static_run), static_run["state"], _losses(runs[0]), runs[0]["state"])


def test_split_planning_failure_on_one_rank_falls_back_everywhere(pool, static_run):
    """Split planning (relibra, 2 layers on 4 ranks: ranks 2 and 3 plan nothing), rank 1's
    share raises: every rank falls back, builds the fallback's schedules (and splits) itself,
    equal to the one-pair path's, no forward degrades, and it trains as static does."""
    cfg = dataclasses.replace(CFG, steps=3)
    runs = pool.run(_hook_fns.train_checking_schedules, cfg, _hook_fns.FailShareOnRankOne(TOPO))
    for rank, run in enumerate(runs):
        assert all(h["fell_back"] for h in run["history"]), rank
        assert not run["differ"] and not any(run["degraded"]), (rank, run["differ"], run["degraded"])
        assert run["warnings"], f"rank {rank} did not warn"
    assert "exploded on rank 1" in runs[1]["warnings"][0]
    assert "another EP rank" in runs[0]["warnings"][0] and "another EP rank" in runs[3]["warnings"][0]
    torch.testing.assert_close(torch.tensor(_losses(runs[0]), dtype=torch.float64),
                               torch.tensor(_losses(static_run)[:3], dtype=torch.float64), rtol=RTOL, atol=0)


def test_a_share_of_the_wrong_size_falls_back_everywhere_without_hanging():
    """``plan_layers`` returning every layer on 4 ranks with 2 layers (ranks 2 and 3 plan
    nothing): the ranks that planned fall back as on a planner failure, so every rank does."""
    cfg = dataclasses.replace(CFG, steps=1)
    with RankPool(4, timeout_s=120) as short:   # a hang fails in 2 minutes, not the pool's 10
        runs = short.run(_hook_fns.train_catching_warnings, cfg, _hook_fns.WholeStepShares(TOPO))
    for rank, run in enumerate(runs):
        assert all(h["fell_back"] for h in run["history"]), rank
    assert "plan_layers returned 2 layers for a share of 1" in runs[0]["warnings"][0]
    assert "another EP rank" in runs[2]["warnings"][0]


def test_diverging_plans_raise_on_every_rank_without_hanging(pool):
    with pytest.raises(RankFailure) as info:
        pool.run(_hook_fns.train, CFG, _hook_fns.RankDependent(TOPO))
    text = str(info.value)
    assert text.count("different step plans") == 4
    assert "did not finish" not in text


def test_every_rank_takes_the_slowest_hosts_scale(pool):
    # each rank measures its own host; one config on every rank (the planner digests agree)
    scales = pool.run(_hook_fns.agreed_host_scales)
    assert scales == [{"host_scale": 1.0, "host_scale_nodes": 2.0}] * 4


def test_split_planning_assembles_the_whole_plan(pool):
    """Each of the 4 ranks plans every 4th layer; the all-gathered plan is the plan of the
    whole step (same planner state), step after step (placements carried over)."""
    cfg = _hook_fns.custom_loop.LoopConfig(steps=3, micro_batches=2, samples_per_micro_batch=2,
                                           max_tokens_per_micro_batch=48, num_layers=6)
    for hierarchical in (False, True):  # hierarchical: co-activation counts all-reduced too
        for rank_digests in pool.run(_hook_fns.split_vs_whole_plans, cfg, 3, False, hierarchical):
            assert all(split == whole and splits for split, whole, splits in rank_digests), rank_digests
    # a planner priced differently on every rank: the input digests disagree -> every rank raises
    with pytest.raises(RankFailure) as info:
        pool.run(_hook_fns.split_vs_whole_plans, cfg, 1, True)
    assert str(info.value).count("PlanDivergence") >= 4 and "planner inputs" in str(info.value)


def test_split_eplb_plans_the_whole_plan_with_rank_local_tables(pool):
    """EPLB with history and a rebalance interval, split over the 4 ranks: every step's
    assembled plan is the whole-step plan, although each rank keeps the replica table of its
    own layers only (left out of the input digest the ranks agree on)."""
    cfg = _hook_fns.custom_loop.LoopConfig(steps=4, micro_batches=2, samples_per_micro_batch=2,
                                           max_tokens_per_micro_batch=48, num_layers=6)
    for rank, out in enumerate(pool.run(_hook_fns.eplb_split_vs_whole_plans, cfg, 4)):
        assert all(split == whole for split, whole in out["digests"]), out["digests"]
        assert out["held"] == list(range(rank, 6, 4))


def test_count_loads_and_its_errors():
    ids = [torch.tensor([[[0, 1]], [[1, 2]]]), torch.zeros(0, 1, 2, dtype=torch.int64)]
    assert count_loads(ids, 1, 3).tolist() == [[[1, 2, 1]], [[0, 0, 0]]]
    with pytest.raises(ValueError, match=r"routed_experts\[0\] has shape \(2, 1, 2\); allowed: \[\.\.\., L=2, K\]"):
        count_loads(ids, 2, 3)
    with pytest.raises(ValueError, match=r"routed_experts\[0\]\[0, 0, 1\] = 3 is out of range; allowed: expert ids in \[0, 3\)"):
        count_loads([torch.tensor([[[0, 3]]])], 1, 3)
    with pytest.raises(TypeError, match=r"routed_experts\[0\] has dtype float32; allowed: int16, int32, int64"):
        count_loads([torch.zeros(1, 1, 2)], 1, 3)


def test_balancer_needs_moe_layers():
    from relibra_torch.hook import ReplayBalancer
    with pytest.raises(ValueError, match="no relibra MoE layer"):
        ReplayBalancer(torch.nn.Linear(2, 2))
