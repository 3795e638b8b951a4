"""benchmarks/replay_gain.py: relibra fed the step's mean loads makes valid plans for the real loads."""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import never_behind as nb  # noqa: E402
import replay_gain  # noqa: E402

from relibra_torch.planning.plan import validate_plan  # noqa: E402

SETTINGS = argparse.Namespace(layers=2, micro_batches=3, steps=2, replica_slots=2, hardware="h200", seed=0,
                              vary_seed=False)


def test_step_totals_plan_is_refitted_to_each_micro_batch(tmp_path):
    case = nb.Case("olmoe", "domains", 16, 8, 2, 8)
    loads, workload, config = nb.case_workload(case, SETTINGS, nb._options([]), tmp_path)
    from relibra_torch.sim.cost import CostModel
    from relibra_torch.sim.simulator import default_planner_factory
    inner = default_planner_factory("relibra", config.topology, CostModel(config.model, config.hardware,
                                                                          config.cost_options))
    planner = replay_gain.FromTotals(inner)
    loads_MLSE = workload.loads_XMLSE[0]
    plan = planner.plan(loads_MLSE)
    validate_plan(plan, loads_MLSE)  # every (m, l, e)'s real load carried exactly
    # the same instances in every micro-batch: planned from the step's totals
    assert torch.equal(plan.slot_expert_MLGJ, plan.slot_expert_MLGJ[:1].expand_as(plan.slot_expert_MLGJ))
    row = replay_gain.stand_in(case, SETTINGS, tmp_path)
    assert set(row["steps"]) == set(replay_gain.SYSTEMS) and row["mb_imbalance"] >= row["step_imbalance"] * 0.99
