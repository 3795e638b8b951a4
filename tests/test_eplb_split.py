"""EPLB's planners plan any share of the layers exactly as the whole step (split planning).

The simulator (``sim.simulator.plan_as_run``) and the training hook run a planner with
``splits_layers`` as EP ranks that each plan ``planning.base.layer_share`` of the layers;
the shares are joined (``join_layer_shares``) and committed once. Over several steps (so
that EPLB's history window and rebalance interval matter) the joined plan must equal the
whole-step plan of a twin planner that plans on the whole tensors (no layer slicing)
exactly, and both planners' state must stay equal.

Small shapes (up to 2 nodes x 4 GPUs, 16 experts, 3 micro-batches, 5 layers, 4 steps).
Legend: X steps, M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import (EPLBNodeDemandPlanner, EPLBPlanner, StepPlan, Topology, eplb_plan,
                                    eplb_node_demand_plan, eplb_replica_table, make_planner, validate_plan)
from relibra_torch.planning.base import join_layer_shares, layer_share

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class WholeStepEPLB(EPLBPlanner):
    """The reference: EPLB planned on the whole ``[L, E]`` tensors at once, no layer slicing
    (what ``EPLBPlanner.plan`` did before it split), sharing only ``commit``."""

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        L = loads_MLSE.shape[1]
        previous_LE = self.previous_placement(L)
        if not self.rebalances():
            table_LGJ = self.replicas_LGJ
        else:
            if self.oracle:
                weight_LE = loads_MLSE.to(torch.float64).sum((0, 2))
            elif self.history:
                weight_LE = torch.stack(self.history[-self.window:]).mean(0)
            else:
                weight_LE = torch.ones(L, self.topology.num_experts, dtype=torch.float64)
            table_LGJ = eplb_replica_table(weight_LE, self.topology, previous_LE, self.num_groups, self.relabel,
                                               self.replicas_LGJ)
        self._planned_rows = dict(enumerate(table_LGJ))
        return eplb_plan(loads_MLSE, self.topology, None, previous_LE, self.num_groups, self.name, self.split,
                         table_LGJ=table_LGJ)

    def plan_layers(self, loads_MLSE, layers):
        raise AssertionError("the reference plans whole steps only")


class WholeStepNodeDemand(EPLBNodeDemandPlanner):
    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:  # every layer in one call, no slicing
        return eplb_node_demand_plan(loads_MLSE, self.topology, self.previous_placement(loads_MLSE.shape[1]),
                                     self.num_groups, self.cross_node_s_per_token,
                                     self.cross_replica_fill_s_per_expert, self.name)

    def plan_layers(self, loads_MLSE, layers):
        raise AssertionError("the reference plans whole steps only")


def make(kind: str, topo: Topology, interval: int, window: int, whole: bool = False):
    if kind == "eplb-node-demand":
        return (WholeStepNodeDemand if whole else EPLBNodeDemandPlanner)(topo, cross_replica_fill_s_per_expert=1e-6)
    oracle, split = kind.startswith("eplb-oracle"), "instance" if kind.endswith("-instance") else "replica"
    return (WholeStepEPLB if whole else EPLBPlanner)(topo, oracle=oracle, window=window, interval=interval,
                                                     split=split)


@st.composite
def steps(draw):
    nodes, gpus = draw(st.sampled_from([(1, 2), (2, 2), (1, 4), (2, 4)]))
    topo = Topology(nodes, gpus, nodes * gpus * draw(st.sampled_from([1, 2])), draw(st.integers(0, 2)))
    X, M, L = draw(st.integers(2, 4)), draw(st.integers(1, 3)), draw(st.integers(2, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    G, E = topo.num_gpus, topo.num_experts
    loads_X = [(torch.rand(M, L, G, E, generator=gen) ** draw(st.sampled_from([1, 6])) * 200).long()
               for _ in range(X)]
    return topo, loads_X, draw(st.integers(1, 3)), draw(st.integers(1, 3))


def _split_step(planner, loads_MLSE: torch.Tensor, ranks: int):
    """The step as ``ranks`` EP ranks plan it (``sim.simulator.plan_as_run``'s split path)."""
    L = loads_MLSE.shape[1]
    parts = [planner.plan_layers(loads_MLSE, layer_share(r, ranks, L)) for r in range(min(ranks, L))]
    return join_layer_shares(parts, ranks, planner.previous_placement(L), planner.name)


@SETTINGS
@pytest.mark.parametrize("kind", ["eplb", "eplb-oracle", "eplb-instance", "eplb-oracle-instance",
                                  "eplb-node-demand"])
@given(case=steps())
def test_split_shares_join_to_the_whole_step_plan_step_after_step(kind, case):
    topo, loads_X, interval, window = case
    split, whole = make(kind, topo, interval, window), make(kind, topo, interval, window, whole=True)
    assert split.splits_layers
    for loads in loads_X:
        joined, plan = _split_step(split, loads, topo.num_gpus), whole.plan(loads)
        validate_plan(joined, loads)
        for name in ("placement_LE", "slot_expert_MLGJ", "slot_tokens_MLGJ", "previous_placement_LE"):
            assert torch.equal(getattr(joined, name), getattr(plan, name)), name
        assert joined.planner == plan.planner
        split.commit(joined, loads)
        whole.commit(plan, loads)
        if isinstance(whole, EPLBPlanner):
            assert torch.equal(split.replicas_LGJ, whole.replicas_LGJ)
            assert (split.steps_since_rebalance, split._blind) == (whole.steps_since_rebalance, whole._blind)


def test_history_and_interval_shape_the_split_plans():
    """The case the property test must cover: interval 2, window 2, a skewed step that
    changes hot experts, so history, the kept table and rebalances all differ by step."""
    topo = Topology(2, 2, 8, 1)
    gen = torch.Generator().manual_seed(3)
    loads_X = [(torch.rand(2, 5, 4, 8, generator=gen) ** 6 * 300).long() for _ in range(5)]
    split, whole = EPLBPlanner(topo, window=2, interval=2), WholeStepEPLB(topo, window=2, interval=2)
    tables = []
    for loads in loads_X:
        joined, plan = _split_step(split, loads, topo.num_gpus), whole.plan(loads)
        assert torch.equal(joined.slot_expert_MLGJ, plan.slot_expert_MLGJ)
        assert torch.equal(joined.slot_tokens_MLGJ, plan.slot_tokens_MLGJ)
        assert torch.equal(joined.placement_LE, plan.placement_LE)
        split.commit(joined, loads)
        whole.commit(plan, loads)
        tables.append(split.replicas_LGJ)
    # step 0 blind, 1 rebalances from history, 2 keeps it, 3 rebalances, 4 keeps it
    assert not torch.equal(tables[1], tables[0]) and torch.equal(tables[2], tables[1])
    assert not torch.equal(tables[3], tables[2]) and torch.equal(tables[4], tables[3])


def test_a_rank_keeps_only_its_layers_and_refuses_others_between_rebalances():
    """Under the hook each rank plans its own share every step: its table holds those rows
    only (left out of the ranks' input digest), and asking it for another layer's kept
    table is an error that names the layers, not a silent wrong plan."""
    topo = Topology(1, 2, 4, 1)
    loads = (torch.rand(1, 4, 2, 4, generator=torch.Generator().manual_seed(0)) * 50).long()
    rank0 = make_planner("eplb", topo, interval=3)
    assert "replicas_LGJ" in rank0.rank_local_state
    for _ in range(2):  # blind step, then a rebalance from history; the next keeps the table
        part = rank0.plan_layers(loads, layer_share(0, 2, 4))
        full = _split_step(make_planner("eplb", topo), loads, 2)  # any valid plan of all layers
        full.placement_LE[[0, 2]] = part.placement_LE
        rank0.commit(full, loads)
    assert (rank0.replicas_LGJ[[1, 3]] == -1).all() and (rank0.replicas_LGJ[[0, 2]] >= 0).all()
    assert not rank0.rebalances()
    rank0.plan_layers(loads, [0, 2])
    with pytest.raises(ValueError, match=r"eplb has no replica table for layers \[1, 3\]"):
        rank0.plan(loads)
