"""torchtitan integration on gloo ranks: EP through torchtitan's own parallelize path.

Each case trains the swapped model for a few steps with replayed routing, relibra planning,
replica slots and reordering, and compares per-step losses and final logical weights with
the same swapped model on one process fed the same micro-batches (the one-process run
accumulates every rank's micro-batches per step: the same gradient sum).

Budget: one pool of 2 ranks for the 2-rank cases (~40 s CPU, most of it importing torch and
torchtitan in the ranks) and one pool of 4 ranks for EP 4 (~60 s CPU); marked ``slow``.
Tolerance: fp32, 1e-5 relative to each tensor's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch

import _titan_fns as fns
import titan_fixtures as tf
from relibra_torch.testing import RankPool

pytestmark = pytest.mark.slow

RTOL = 1e-5  # fp32
FREE_MIGRATION = {"migration_s_per_expert": 0.0, "intra_migration_s_per_expert": 0.0}


@pytest.fixture(scope="module")
def pool2():
    with RankPool(2, timeout_s=600) as pool:
        yield pool


def _setup(name: str, n_layers: int, ranks: int, steps: int, seed: int, **model_kwargs):
    work = fns.make_workload(name, steps=steps, ranks=ranks, micro_batches=2, batch=1, seq=16,
                             seed=seed, n_layers=n_layers)
    full = dict(tf.build(tf.relibra_config(name, n_layers=n_layers), seed=seed + 100).named_parameters())
    full = {k: v.detach().clone() for k, v in full.items()}
    kwargs = dict(n_layers=n_layers, **model_kwargs)
    return work, full, kwargs


def _check_against_reference(name, kwargs, full, work, outs):
    ref = fns.reference_train(name, kwargs, full, work)
    for r, out in enumerate(outs):
        for step, (a, b) in enumerate(zip(out["losses"], ref["losses"])):
            assert abs(a - b) <= RTOL * abs(b), f"rank {r} step {step}: loss {a} vs one process {b}"
    params = outs[0]["params"]
    assert params.keys() == ref["params"].keys()
    for k, v in ref["params"].items():
        tf.assert_close(params[k], v, RTOL, f"logical {k}")
        # The steps really moved the weights (the comparison is not of untouched tensors).
        assert not torch.equal(v, full[k]), k


def test_ep2_two_nodes_reordering_matches_one_process(pool2):
    """EP 2 as 2 nodes x 1 GPU: the relibra planner reorders experts across the nodes."""
    work, full, kwargs = _setup("qwen3", 2, ranks=2, steps=3, seed=0, replica_slots=1, gpus_per_node=1,
                                planner_options=FREE_MIGRATION)
    outs = pool2.run(fns.ep_train, "qwen3", kwargs, full, work)
    reports = outs[0]["reports"]
    assert sum(r["relibra/migrated_experts"] for r in reports) > 0
    assert any(not torch.equal(p, torch.arange(64)) for p in outs[0]["placements"])
    assert all(r["relibra/imbalance_after/mean"] <= r["relibra/imbalance_before/mean"] for r in reports)
    _check_against_reference("qwen3", kwargs, full, work, outs)


def test_ep2_one_node_replicas_match_one_process(pool2):
    """EP 2 as 1 node x 2 GPUs, 1 replica slot each: hot experts are replicated. With
    torchtitan's default selective activation checkpointing (recomputation re-runs the
    exchanges and fills in backward)."""
    work, full, kwargs = _setup("deepseek_v3", 3, ranks=2, steps=3, seed=1, replica_slots=1,
                                gpus_per_node=2, planner_options=FREE_MIGRATION)
    outs = pool2.run(fns.ep_train, "deepseek_v3", kwargs, full, work, ac="selective")
    assert sum(o["fills"] for o in outs) > 0, "no replica slot was filled"
    reports = outs[0]["reports"]
    assert sum(r["relibra/imbalance_before/mean"] - r["relibra/imbalance_after/mean"] for r in reports) > 0
    _check_against_reference("deepseek_v3", kwargs, full, work, outs)


def test_ep2_dcp_checkpoint_to_original_and_back(pool2, tmp_path):
    """A DCP checkpoint of the reordered EP model is logical: the original torchtitan model
    loads it, and its own checkpoint loads back into an EP model with another placement."""
    import torch.distributed.checkpoint as dcp

    name = "qwen3"
    work, full, kwargs = _setup(name, 2, ranks=2, steps=2, seed=2, replica_slots=1, gpus_per_node=1,
                                planner_options=FREE_MIGRATION)
    swapped_ckpt, original_ckpt = str(tmp_path / "swapped"), str(tmp_path / "original")
    outs = pool2.run(fns.ep_dcp_roundtrip, name, kwargs, full, work, swapped_ckpt)
    assert any(not torch.equal(p, torch.arange(64)) for p in outs[0]["placements"])
    trained = outs[0]["params"]

    original = tf.build(tf.model_config(name, n_layers=2, fp32_reference=True), seed=7)
    sd = original.state_dict()
    dcp.load(sd, checkpoint_id=swapped_ckpt)
    original.load_state_dict(sd, strict=True)
    got = dict(original.named_parameters())
    for k, v in trained.items():
        assert torch.equal(got[k], v), f"{k}: the original model did not load the logical weights"
    dcp.save(original.state_dict(), checkpoint_id=original_ckpt)

    back = pool2.run(fns.ep_load_checkpoint, name, kwargs, full, original_ckpt, 3)
    assert any(not torch.equal(p, torch.arange(64)) for p in back[0]["placements"])
    for k, v in trained.items():
        assert torch.equal(back[0]["params"][k], v), f"{k} after original -> reordered EP model"


def test_relibra_trainer_on_two_ranks(pool2, tmp_path):
    """torchtitan's own training loop (RelibraTrainer): planning and replicas leave the losses
    of the static, replica-free run unchanged and lower the planned imbalance."""
    balanced = pool2.run(fns.trainer_run, str(tmp_path / "relibra"), 2,
                         {"planner": "relibra", "replica_slots": 1, "gpus_per_node": 2, "expert_dtype": None})
    static = pool2.run(fns.trainer_run, str(tmp_path / "static"), 2,
                       {"planner": "static", "replica_slots": 0, "gpus_per_node": 2, "expert_dtype": None})
    assert len(balanced[0]["losses"]) == 2
    for a, b in zip(balanced[0]["losses"], static[0]["losses"]):
        assert abs(a - b) <= RTOL * abs(b), (balanced[0]["losses"], static[0]["losses"])
    for m in balanced[0]["metrics"]:
        assert {"relibra/planner_ms", "relibra/imbalance_before/layer_0", "relibra/imbalance_after/layer_1",
                "relibra/migrated_experts", "relibra/hook_ms"} <= m.keys()
        assert m["relibra/imbalance_after/mean"] < m["relibra/imbalance_before/mean"]
    for m in static[0]["metrics"]:
        assert m["relibra/imbalance_after/mean"] == m["relibra/imbalance_before/mean"]


@pytest.fixture(scope="module")
def pool4():
    with RankPool(4, timeout_s=600) as pool:
        yield pool


def test_ep4_two_nodes_of_two_matches_one_process(pool4):
    """EP 4 as 2 nodes x 2 GPUs: reordering across nodes and replicas inside them, with the
    override's ``dispatch="hierarchical"`` (flat dispatch across nodes: the EP 2 cases)."""
    work, full, kwargs = _setup("qwen3", 2, ranks=4, steps=2, seed=4, replica_slots=1, gpus_per_node=2,
                                planner_options=FREE_MIGRATION, dispatch="hierarchical")
    outs = pool4.run(fns.ep_train, "qwen3", kwargs, full, work)
    assert sum(r["relibra/migrated_experts"] for r in outs[0]["reports"]) > 0
    assert sum(o["fills"] for o in outs) > 0
    for o in outs:  # the two-stage exchange ran (size all-gather + 2 stages x 2: rows with routes, combine)
        assert all(d == "hierarchical" and ex["collectives_forward"] == 5 for d, ex in o["exchange"])
    _check_against_reference("qwen3", kwargs, full, work, outs)


def test_reordering_refuses_experts_fsdp_sharded_inside_ep(pool4):
    """4 ranks with EP 2: each expert row is also FSDP-sharded (efsdp = 2)."""
    messages = pool4.run(fns.efsdp_reorder_error, "deepseek_v3", 3, 2)
    assert all("cannot reorder experts" in m and "FSDP-sharded" in m for m in messages), messages
