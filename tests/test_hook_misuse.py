"""A user's first hour with the balancer and the layer: misuse fails on every rank at once with
one clear line, or works (a cast model trains, a replay for another model is refused).

Two gloo ranks for what needs EP; the rest in one process.
"""

from __future__ import annotations

import pytest
import torch

import _hook_fns
from relibra_torch.moe import ReplayBalancedMoE
from relibra_torch.replay.counts import checked_counts
from relibra_torch.testing import RankPool


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, timeout_s=120) as p:   # a hang fails in 2 minutes
        yield p


@pytest.mark.parametrize("kind, message", [
    ("id out of range", r"= 7 is out of range"),
    ("top-k", r"top-k 3, but the layers route to top_k 2; the replay was recorded for another model"),
    ("nan counts", r"counts_MLE\[0, 0, 0\] = nan; allowed: whole token counts"),
])
def test_a_bad_replay_on_one_rank_raises_on_every_rank_without_hanging(pool, kind, message):
    import re
    bad, good = pool.run(_hook_fns.bad_replay_on_one_rank, kind)[::-1]
    assert re.search(message, bad), bad
    assert good.startswith("ValueError: the replay of EP rank(s) [1] was refused"), good


def test_moving_experts_without_the_optimizer_warns_once(pool):
    for caught in pool.run(_hook_fns.migration_without_optimizer):
        assert len(caught) == 1 and "without an optimizer" in caught[0] and "plan_step(ids, optimizer)" in caught[0]


def test_counts_are_checked_before_any_cast():
    assert checked_counts(torch.tensor([[[1.0, 2.0]]]), 1, 2).dtype == torch.int64
    with pytest.raises(ValueError, match=r"counts_MLE\[0, 0, 1\] = 2.5; allowed: whole token counts"):
        checked_counts(torch.tensor([[[1.0, 2.5]]]), 1, 2)
    with pytest.raises(ValueError, match=r"counts_MLE\[0, 0, 0\] = -1 is negative"):
        checked_counts(torch.tensor([[[-1, 2]]]), 1, 2)
    with pytest.raises(ValueError, match=r"counts_MLE has shape \(1, 1, 3\); allowed: \[M, 1, 2\]"):
        checked_counts(torch.zeros(1, 1, 3), 1, 2)


def test_a_cast_model_trains_and_keeps_exact_counts():
    """``.bfloat16()`` on the whole model: training forwards run (the token counter stays fp32)."""
    torch.manual_seed(0)
    layer = ReplayBalancedMoE(16, 8, 8, 2).bfloat16()
    assert layer.tokens_per_expert_E.dtype == torch.float32
    for _ in range(3):
        layer(torch.randn(300, 16, dtype=torch.bfloat16)).float().sum().backward()
    assert layer.tokens_per_expert_E.sum().item() == 3 * 300 * 2   # exact past bf16's 256
    with pytest.raises(TypeError, match=r"x has dtype torch.float64; allowed: float32, float16 or bfloat16"):
        layer.float()(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"routed_experts has dtype torch.uint8; allowed: a signed integer dtype, int16, int32 or int64"):
        layer.float()(torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.uint8))


def test_layers_of_different_top_k_are_refused():
    from relibra_torch.hook import ReplayBalancer
    with pytest.raises(ValueError, match=r"different top_k \[1, 2\]"):
        ReplayBalancer([ReplayBalancedMoE(8, 4, 4, 2), ReplayBalancedMoE(8, 4, 4, 1)])


def test_planner_inputs_fail_with_one_line():
    from relibra_torch.planning import ReLibraConfig, Topology, relibra_plan, validate_plan
    topo = Topology(2, 2, 8, 1)
    loads = torch.randint(0, 9, (3, 2, 4, 8), generator=torch.Generator().manual_seed(0))
    for part in (loads[:0], loads[:, :0]):   # nothing to plan: a valid empty plan
        validate_plan(relibra_plan(part, topo), part)
    with pytest.raises(ValueError, match=r"previous_placement_LE\[0\] is not a permutation of 0..7"):
        relibra_plan(loads, topo, torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"previous_placement_LE has shape \(3, 8\); allowed: \[L, E\] = \[2, 8\]"):
        relibra_plan(loads, topo, topo.static_placement(3))
    plan = relibra_plan(loads, topo, topo.static_placement(2).int())        # int32 is taken
    assert plan.previous_placement_LE.dtype == torch.int64
    with pytest.raises(TypeError, match=r"config is dict; allowed: a ReLibraConfig"):
        relibra_plan(loads, topo, config={"reorder": False})
    assert ReLibraConfig  # the type the message names


def test_pool_refuses_an_unpicklable_task_at_once():
    with RankPool(2, timeout_s=600) as p:
        with pytest.raises(TypeError, match=r"must be picklable"):
            p.run(lambda: 1)


def test_saving_into_a_missing_folder_names_the_folder(tmp_path):
    from relibra_torch.replay.fileio import write_tensors
    with pytest.raises(FileNotFoundError, match=r"the folder '.*nope' does not exist; create it first"):
        write_tensors(tmp_path / "nope" / "x.safetensors", {"x": torch.zeros(1)}, {})
