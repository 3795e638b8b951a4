"""The lower bound (relibra_torch/sim/bound.py): no system and no valid plan beats it.

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots, N nodes.
"""

import dataclasses
import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import Topology, static_plan
from _replay_helpers import skewed_routing_file
from relibra_torch.sim import CostModel, CostOptions, SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.bound import a2a_lower_bound_ML, bound_step_cost, must_cross_pairs_MLN
from relibra_torch.sim.simulator import SYSTEMS
from relibra_torch.sim.workload import workload_from_file

from test_sim_simulator import MODEL

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

HW = get_hardware("h200")
DISPATCH = ("flat", "hierarchical")


@st.composite
def traces(draw):
    """Small count traces: each token picks K distinct experts, per-rank skewed preferences."""
    N, g = draw(st.sampled_from([(2, 2), (2, 1), (1, 4), (2, 4)]))
    E = draw(st.sampled_from([8, 16]))
    R = draw(st.integers(0, 2))
    K = draw(st.integers(1, 3))
    M = draw(st.integers(1, 2))
    tokens = draw(st.sampled_from([16, 200, 2000]))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    S, L = N * g, 1
    loads = torch.zeros(1, M, L, S, E, dtype=torch.int64)
    for m in range(M):
        for s in range(S):
            w = torch.rand(E, generator=gen) ** 4 + 1e-3
            picks = torch.multinomial(w.expand(tokens, E), K, replacement=False, generator=gen)
            loads[0, m, 0, s] = torch.bincount(picks.flatten(), minlength=E)
    model = dataclasses.replace(MODEL, num_experts=E, top_k=K, num_layers=L, num_moe_layers=L)
    return Topology(N, g, E, R), model, loads


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(traces(), st.sampled_from(DISPATCH), st.booleans())
def test_no_system_is_ever_below_the_bound(trace, dispatch, overlap):
    topo, model, loads = trace
    wl = workload_from_loads(loads, model, topo)
    cfg = SimConfig(model, HW, topo, SYSTEMS, CostOptions(dispatch=dispatch, overlap_replication=overlap))
    figs = simulate(wl, cfg).figures()
    bound = figs["bound"]["step_time_s"]
    for name, f in figs.items():
        assert f["step_time_s"] >= bound * (1 - 1e-12), (name, f["step_time_s"], bound)
        assert f["fraction_of_bound"] <= 1 + 1e-12
        assert figs["bound"]["attention_dense_s"] == f["attention_dense_s"]


def test_no_system_is_below_the_bound_with_exact_hierarchical_counts(tmp_path):
    """A routing file: hierarchical crossings counted per token, exactly."""
    E, K, L = 16, 4, 2
    path = str(tmp_path / "r.safetensors")
    skewed_routing_file(path, E, K, L, 48, 20, 80, seed=5)
    model = dataclasses.replace(MODEL, num_experts=E, top_k=K, num_layers=L, num_moe_layers=L)
    topo = Topology(2, 2, E, replica_slots=1)
    wl = workload_from_file(path, model, topo, num_micro_batches=2)
    assert wl.routing is not None
    figs = simulate(wl, SimConfig(model, HW, topo, SYSTEMS, CostOptions(dispatch="hierarchical"))).figures()
    for name, f in figs.items():
        assert f["fraction_of_bound"] <= 1 + 1e-12, name


def test_random_valid_plans_never_beat_the_bound():
    """2 x 2 GPUs, up to 8 experts, R <= 1, M <= 2: every planner's plan, random valid plans
    and a hill climb from the best, each priced by the cost model (benchmarks/bound_gap.py;
    the search asserts each plan against the bound). The bound is not just under today's
    systems: on these instances it sits well below the best plan found (docs/simulator.md)."""
    import bound_gap

    hw = get_hardware("h200")
    for i, (E, R, M) in enumerate(((8, 1, 2), (4, 0, 1), (8, 0, 2))):
        for dispatch in DISPATCH:
            model = dataclasses.replace(bound_gap.MODEL, num_experts=E)
            cost = CostModel(model, hw, CostOptions(dispatch=dispatch))
            loads, tokens = bound_gap.instance(i, E=E, M=M)
            bound, best, n, relibra = bound_gap.search(loads, tokens, Topology(2, 2, E, R), cost, 12, 24, i)
            assert n >= 60 and bound <= best <= relibra


def test_the_steady_rule_prices_every_searched_plan_without_migration():
    """``bound_gap.search(..., steady=True)``: the scoreboard's rule (a warm-up step on the
    same loads). Without climbs both rules price the same plans, so the best found can only
    fall; relibra's second plan is never below the bound, and on ``flat E=8 R=1 M=1`` at 8,192
    tokens, where its one-step plan pays a move's migration, it prices lower."""
    import bound_gap

    hw = get_hardware("h200")
    cost = CostModel(dataclasses.replace(bound_gap.MODEL, num_experts=8), hw, CostOptions(dispatch="flat"))
    loads, tokens = bound_gap.instance(5, E=8, M=1, tokens=8192)
    one = bound_gap.search(loads, tokens, Topology(2, 2, 8, 1), cost, 8, 0, 5)
    steady = bound_gap.search(loads, tokens, Topology(2, 2, 8, 1), cost, 8, 0, 5, steady=True)
    assert steady[0] == one[0] and steady[0] <= steady[1] <= one[1]
    assert steady[0] <= steady[3] < one[3]


def test_relibra_is_within_5_percent_of_the_best_plan_found_on_tiny_instances():
    """The issue's alternative to 0.85 of the bound: on the tiny instances of
    benchmarks/bound_gap.py (2 x 2 GPUs, 4 or 8 experts, R 0 or 1, M 1 or 2, both dispatch
    modes), relibra's plan as the simulator configures it is within 5% of the best plan
    found by every planner, random valid plans, the enumeration of every fill-free placement
    where E = 4 and R = 0, and two hill climbs (one from relibra's own plan)."""
    import bound_gap

    hw = get_hardware("h200")
    for dispatch in DISPATCH:
        for i in range(8):
            R, M, E = (0, 1)[i % 2], 1 + (i // 2) % 2, (4, 8)[(i // 4) % 2]
            cost = CostModel(dataclasses.replace(bound_gap.MODEL, num_experts=E), hw, CostOptions(dispatch=dispatch))
            loads, tokens = bound_gap.instance(i, E=E, M=M)
            bound, best, n, relibra = bound_gap.search(loads, tokens, Topology(2, 2, E, R), cost, 6, 12, i)
            assert relibra <= 1.05 * best, (dispatch, E, R, M, relibra / best)


def test_bound_by_hand():
    """2 nodes x 1 GPU, 2 experts, R = 0 (J = 1): each GPU and node holds one expert. Rank 0
    sends 6 pairs of expert 0 and 2 of expert 1, rank 1 the reverse of 3 and 5. A node keeps
    at most its top expert: rank 0 must send >= 2 across, rank 1 >= 3."""
    topo = Topology(2, 1, 2, 0)
    loads = torch.tensor([[[[6, 2], [3, 5]]]])
    model = dataclasses.replace(MODEL, num_experts=2, top_k=1)
    cost = CostModel(model, HW)
    assert must_cross_pairs_MLN(loads, topo).tolist() == [[[2.0, 3.0]]]
    a2a = a2a_lower_bound_ML(loads, torch.tensor([[8, 8]]), topo, cost, 1)
    per_pair = cost.token_bytes / cost.inter_node_bytes_per_s
    assert float(a2a) == pytest.approx(3 * per_pair, rel=1e-12)
    # static placement (expert e on GPU e) moves exactly that: rank 0 sends 2, rank 1 sends 3
    plan = static_plan(loads, topo)
    from relibra_torch.planning import evaluate
    step = cost.step_cost(plan, evaluate(plan, loads), torch.tensor([[8, 8]]), torch.tensor([[8.0, 8.0]]))
    bound = bound_step_cost(cost, loads, topo, torch.tensor([[8, 8]]), torch.tensor([[8.0, 8.0]]))
    assert float(step.all_to_all_s_ML.sum()) == pytest.approx(float(bound.all_to_all_s_ML.sum()), rel=1e-12)
    # compute at the mean load rounded up: 8 pairs per GPU; static runs 9 on GPU 0
    assert float(bound.expert_s_ML.sum()) == pytest.approx(float(step.expert_s_ML.sum()) * 8 / 9, rel=1e-12)
    # hierarchical with top-1: a copy per pair, the same bound
    hier = CostModel(model, HW, CostOptions(dispatch="hierarchical"))
    assert float(a2a_lower_bound_ML(loads, torch.tensor([[8, 8]]), topo, hier, 1)) == pytest.approx(float(a2a))


def test_bound_on_one_node_is_the_nvlink_must_leave():
    """One node of 2 GPUs, 4 experts, R = 0: a GPU holds 2 experts, so rank s sends at least
    its pairs minus its top two experts over NVLink; nothing crosses nodes."""
    topo = Topology(1, 2, 4, 0)
    loads = torch.tensor([[[[5, 4, 3, 1], [1, 1, 1, 9]]]])
    cost = CostModel(dataclasses.replace(MODEL, num_experts=4), HW)
    a2a = a2a_lower_bound_ML(loads, torch.tensor([[7, 6]]), topo, cost, 2)
    assert float(a2a) == pytest.approx(cost.token_bytes * 4 / cost.nvlink_bytes_per_s, rel=1e-12)
    assert float(must_cross_pairs_MLN(loads, topo).sum()) == 0.0


def test_bound_gap_script_runs(capsys):
    import bound_gap

    out = bound_gap.main(["--instances", "1", "--samples", "4", "--climb", "4"])
    assert set(out) == {"flat", "hierarchical"}
    for v in out.values():
        assert 0 < v["min"] <= v["median"] <= v["max"] <= 1.0
    for v in out.values():
        assert 1.0 <= v["relibra_over_best_max"]
    assert "relibra/best" in capsys.readouterr().out
    random.seed(0)
