"""The baselines at their best: DeepSeek-semantics EPLB (per-replica split, relabeling,
rebalance interval) and the online planners (online-node, online-global), in the planners
and in the simulator.

Small shapes (up to 2 nodes x 4 GPUs, 32 experts, a few micro-batches and layers).
Legend: X steps, M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import (PLANNER_NAMES, EPLBPlanner, Topology, eplb_plan, eplb_replica_table,
                                    evaluate, make_planner, online_global_plan, online_node_plan,
                                    token_split, validate_plan)
from relibra_torch.planning.assignment import max_weight_assignment
from relibra_torch.sim import SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.baselines import BaselineOptions, baseline_options
from relibra_torch.sim.presets import ModelSpec

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw, max_m=3, max_l=2):
    nodes, gpus = draw(st.sampled_from([(1, 2), (2, 2), (1, 4), (2, 4)]))
    per_gpu = draw(st.sampled_from([1, 2, 4]))
    replicas = draw(st.integers(0, 2))
    topo = Topology(nodes, gpus, nodes * gpus * per_gpu, replicas)
    M, L = draw(st.integers(1, max_m)), draw(st.integers(1, max_l))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    G, E = topo.num_gpus, topo.num_experts
    shape = draw(st.sampled_from(["skewed", "uniform", "one_expert", "zeros"]))
    if shape == "skewed":
        loads = (torch.rand(M, L, G, E, generator=gen) ** 6 * 300).long()
    elif shape == "uniform":
        loads = torch.randint(0, 30, (M, L, G, E), generator=gen)
    elif shape == "one_expert":
        loads = torch.zeros(M, L, G, E, dtype=torch.int64)
        loads[..., int(torch.randint(0, E, (1,), generator=gen))] = 2000
    else:
        loads = torch.zeros(M, L, G, E, dtype=torch.int64)
    return topo, loads


def per_replica_gpu_loads(table_LGJ: torch.Tensor, loads_MLSE: torch.Tensor) -> list:
    """DeepSeek's split written out by hand: replica ``i`` (slot order) of an expert with ``n``
    replicas gets ``load // n + (i < load % n)``; summed per GPU. ``[M][L][G]`` lists."""
    M, L, _, E = loads_MLSE.shape
    _, G, J = table_LGJ.shape
    table = table_LGJ.tolist()
    load = loads_MLSE.sum(2).tolist()
    out = []
    for m in range(M):
        per_l = []
        for l in range(L):
            n = [0] * E
            for gpu in range(G):
                for j in range(J):
                    n[table[l][gpu][j]] += 1
            seen, gpu_load = [0] * E, [0] * G
            for gpu in range(G):
                for j in range(J):
                    e = table[l][gpu][j]
                    x = load[m][l][e]
                    gpu_load[gpu] += x // n[e] + (seen[e] < x % n[e])
                    seen[e] += 1
            per_l.append(gpu_load)
        out.append(per_l)
    return out


# ------------------------------------------------------------------------------- EPLB


@SETTINGS
@given(cases(), st.booleans())
def test_eplb_gpu_loads_are_the_per_replica_split_of_its_own_table(case, oracle):
    topo, loads = case
    planner = EPLBPlanner(topo, oracle=oracle)
    if not oracle:  # give the history planner a past that differs from the step
        past = loads.flip(-1)
        planner.commit(planner.plan(past), past)
    table = planner.replica_table(loads)
    plan = planner.plan(loads)
    validate_plan(plan, loads)
    assert evaluate(plan, loads).gpu_load_MLG.tolist() == per_replica_gpu_loads(table, loads)
    # every physical replica of the table is in the plan (merged per GPU), nothing else
    L, G, J = table.shape
    for l in range(L):
        for gpu in range(G):
            assert set(table[l, gpu].tolist()) == set(plan.slot_expert_MLGJ[0, l, gpu].tolist()) - {-1}


def test_eplb_replica_counts_follow_deepseeks_rule():
    """Global policy: one more replica at a time to the highest load per replica."""
    topo = Topology(2, 2, 8, 2)
    w = torch.tensor([[50.0, 1.0, 7.0, 20.0, 3.0, 3.0, 9.0, 0.0]])
    table = eplb_replica_table(w, topo)
    count = [1] * 8
    for _ in range(topo.num_gpus * topo.slots_per_gpu - 8):
        hot = max(range(8), key=lambda e: (w[0, e].item() / count[e], -e))
        count[hot] += 1
    assert torch.bincount(table.flatten(), minlength=8).tolist() == count


def test_two_replicas_on_one_gpu_get_two_shares():
    """An expert with 3 replicas, 2 of them on GPU 0: GPU 0 runs 2/3 of its tokens, and the old
    per-instance split gives it 1/2."""
    topo = Topology(1, 2, 2, 2)                     # 2 GPUs x (1 native + 2 replica slots)
    table = torch.tensor([[[0, 0, 1], [0, 1, 1]]])  # expert 0: 3 replicas, expert 1: 3 replicas
    loads = torch.tensor([[[[60, 30], [0, 0]]]])
    replica = eplb_plan(loads, topo, table_LGJ=table)
    instance = eplb_plan(loads, topo, table_LGJ=table, split="instance")
    validate_plan(replica, loads)
    validate_plan(instance, loads)
    assert replica.slot_expert_MLGJ[0, 0].tolist() == [[0, -1, 1], [0, 1, -1]]
    assert replica.slot_tokens_MLGJ[0, 0].tolist() == [[40, 0, 10], [20, 20, 0]]
    assert instance.slot_tokens_MLGJ[0, 0].sum(-1).tolist() == [30 + 15, 30 + 15]


def test_assignment_is_the_maximum():
    w = [[3, 1, 4], [1, 5, 9], [2, 6, 5]]
    best = max(sum(w[i][p[i]] for i in range(3)) for p in
               ([0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]))
    perm = max_weight_assignment(w)
    assert sorted(perm) == [0, 1, 2] and sum(w[i][perm[i]] for i in range(3)) == best


@SETTINGS
@given(cases(max_m=2), st.integers(0, 2**31 - 1))
def test_relabeling_never_moves_more_experts(case, seed):
    topo, loads = case
    L, E = loads.shape[1], topo.num_experts
    gen = torch.Generator().manual_seed(seed)
    prev = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    weight = loads.double().sum((0, 2)) + torch.rand(L, E, generator=gen)
    moved = {}
    for relabel in (True, False):
        plan = eplb_plan(loads, topo, weight, prev, relabel=relabel)
        validate_plan(plan, loads)
        moved[relabel] = int(evaluate(plan, loads).migrated_L.sum())
    assert moved[True] <= moved[False]


# Found by hypothesis: the relabeling keeps experts with their owners, not experts in place, so
# EPLB's unchanged table relabelled against its own placement moved two experts.
_RELABEL_MOVES = (Topology(2, 2, 8, 2), torch.tensor([[
    [[8, 11, 0, 286, 5, 0, 0, 57], [0, 0, 0, 134, 0, 44, 0, 62],
     [21, 0, 85, 2, 0, 61, 0, 69], [3, 149, 59, 0, 0, 0, 0, 0]],
    [[25, 217, 0, 0, 0, 26, 0, 16], [208, 122, 0, 215, 62, 16, 259, 66],
     [2, 3, 0, 5, 10, 53, 46, 0], [193, 5, 0, 0, 204, 0, 1, 0]]]]))


@SETTINGS
@given(cases(max_m=2))
@example(_RELABEL_MOVES)
def test_identical_consecutive_loads_move_nothing(case):
    topo, loads = case
    for name in ("eplb-oracle", "eplb-oracle-instance"):
        planner = make_planner(name, topo)
        planner.commit(planner.plan(loads), loads)
        again = planner.plan(loads)
        assert int(evaluate(again, loads).migrated_L.sum()) == 0
    history = make_planner("eplb", topo)          # step 1 plans from a uniform guess
    for _ in range(2):
        history.commit(history.plan(loads), loads)
    assert int(evaluate(history.plan(loads), loads).migrated_L.sum()) == 0


def test_relabeling_keeps_a_permuted_placement_in_place():
    """The same layout with its GPUs shuffled: relabeling finds the shuffle, nothing moves."""
    topo = Topology(2, 2, 8, 1)
    gen = torch.Generator().manual_seed(3)
    loads = (torch.rand(2, 1, 4, 8, generator=gen) ** 3 * 100).long()
    w = loads.double().sum((0, 2))
    first = eplb_plan(loads, topo, w)
    shuffled = first.placement_LE.clone()
    # swap the two nodes and the GPUs inside them: a relabelled copy of the same layout
    El = topo.experts_per_gpu
    gpu_map = torch.tensor([3, 2, 1, 0])
    shuffled = gpu_map[shuffled // El] * El + shuffled % El
    plan = eplb_plan(loads, topo, w, shuffled)
    assert int(evaluate(plan, loads).migrated_L.sum()) == 0
    unlabelled = eplb_plan(loads, topo, w, shuffled, relabel=False)
    assert int(evaluate(unlabelled, loads).migrated_L.sum()) > 0


def test_rebalance_interval_keeps_the_table_in_between():
    topo = Topology(2, 2, 8, 1)
    gen = torch.Generator().manual_seed(1)
    steps = [(torch.rand(2, 1, 4, 8, generator=gen) ** 4 * 100).long() for _ in range(5)]
    planner = EPLBPlanner(topo, interval=3)
    tables, moved = [], []
    for loads in steps:
        tables.append(planner.replica_table(loads))
        plan = planner.plan(loads)
        validate_plan(plan, loads)
        moved.append(int(evaluate(plan, loads).migrated_L.sum()))
        planner.commit(plan, loads)
    # step 0 has no history (uniform guess), step 1 rebalances from it, steps 2-3 keep step
    # 1's table, step 4 rebalances again
    assert not torch.equal(tables[1], tables[0])
    assert torch.equal(tables[2], tables[1]) and torch.equal(tables[3], tables[1])
    assert moved[2] == moved[3] == 0
    assert not torch.equal(tables[4], tables[1])


# ------------------------------------------------------------------------------ online


@pytest.mark.parametrize("planner_fn", [online_node_plan, online_global_plan])
def test_online_on_uniform_loads_makes_no_replica(planner_fn):
    topo = Topology(2, 4, 16, 2)
    loads = torch.full((3, 2, 8, 16), 500)
    plan = planner_fn(loads, topo)
    validate_plan(plan, loads)
    assert (plan.slot_expert_MLGJ[..., topo.experts_per_gpu:] == -1).all()


def test_online_planners_balance_a_skewed_step():
    topo = Topology(2, 4, 16, 2)
    gen = torch.Generator().manual_seed(0)
    loads = (torch.rand(4, 2, 8, 16, generator=gen) ** 4 * 2000).long()
    static = evaluate(make_planner("static", topo).plan(loads), loads).imbalance_ML
    node = evaluate(online_node_plan(loads, topo), loads)
    glob = evaluate(online_global_plan(loads, topo, min_replica_tokens=1), loads)
    assert (node.imbalance_ML <= static + 1e-12).all() and (glob.imbalance_ML <= static + 1e-12).all()
    assert glob.imbalance_ML.mean() < node.imbalance_ML.mean() < static.mean()
    # online-node keeps replicas inside the owner's node
    validate_plan(online_node_plan(loads, topo), loads, intra_node_replicas=True)


TINY = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                 num_experts=16, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)


@pytest.mark.parametrize("overlap", [False, True])
def test_online_on_uniform_loads_takes_static_time_plus_planning(overlap):
    from relibra_torch.sim.cost import CostOptions
    topo = Topology(2, 2, 16, 2)
    M, L = 3, TINY.num_moe_layers
    loads = torch.full((1, M, L, 4, 16), 32)
    wl = workload_from_loads(loads, TINY, topo)
    opts = BaselineOptions(online_plan_latency_us=123.0, planning_overlap_s=1e9)  # static's host work hidden
    res = simulate(wl, SimConfig(TINY, get_hardware("h200"), topo,
                                 systems=("static", "online-node", "online-global", "uniform"),
                                 cost_options=CostOptions(overlap_replication=overlap),
                                 baseline_options=opts))
    figs = res.figures()
    for name in ("online-node", "online-global"):
        assert figs[name]["replica_bytes"] == 0
        # no shared experts in TINY: planning is exposed with or without overlap
        assert figs[name]["step_time_s"] == pytest.approx(figs["static"]["step_time_s"] + M * L * 123e-6,
                                                          rel=1e-12)
        assert figs[name]["planning_exposed_s"] == pytest.approx(M * L * 123e-6, rel=1e-12)


def test_planning_hides_behind_shared_experts_only_with_overlap():
    from dataclasses import replace

    from relibra_torch.sim.cost import CostModel, CostOptions
    shared = replace(TINY, num_shared_experts=1, shared_ffn=4096)
    tokens = torch.full((2, 4), 4096)
    pairs = tokens.double() * 100
    for overlap in (False, True):
        cost = CostModel(shared, get_hardware("h200"), CostOptions(overlap_replication=overlap))
        dense = cost.dense_s(tokens, pairs)
        zero = torch.zeros(2, 1, dtype=torch.float64)
        c = cost._combine(zero, zero, zero, zero, zero, dense, 0.0, 0, 0.0, 0, 0, 0.0, plan_latency_s=1e-3)
        expect = (1e-3 - dense["shared_layer_fwd"]).clamp(min=0) if overlap else torch.full((2,), 1e-3)
        assert torch.allclose(c.planning_exposed_s_ML.flatten(), expect.to(torch.float64))
    assert float(dense["shared_layer_fwd"][0]) > 0


# ------------------------------------------------------------------- every system


@SETTINGS
@given(cases())
def test_every_system_conserves_tokens(case):
    topo, loads = case
    for name in PLANNER_NAMES:
        planner = make_planner(name, topo)
        if name in ("eplb", "eplb-instance"):
            planner.commit(planner.plan(loads.roll(1, -1)), loads.roll(1, -1))
        plan = planner.plan(loads)
        validate_plan(plan, loads)                             # quotas sum to each expert's load
        split_MLSGJ = token_split(plan, loads)
        se = plan.slot_expert_MLGJ.unsqueeze(2).expand_as(split_MLSGJ)
        M, L, S, G, J = split_MLSGJ.shape
        E = topo.num_experts
        got = torch.zeros(M, L, S, E + 1, dtype=torch.int64).scatter_add_(
            3, (se + 1).reshape(M, L, S, G * J), split_MLSGJ.reshape(M, L, S, G * J))
        assert torch.equal(got[..., 1:], loads), name    # every (source, expert) count, once
        assert torch.equal(split_MLSGJ.sum(2), plan.slot_tokens_MLGJ), name


def test_baseline_settings_are_checked():
    assert baseline_options({"eplb": {"interval": "4"}, "online": {"plan_latency_us": "12.5"}}) == \
        BaselineOptions(eplb_interval=4, online_plan_latency_us=12.5)
    with pytest.raises(ValueError, match=r"eplb.interval = 0; allowed: an int >= 1"):
        baseline_options({"eplb": {"interval": "0"}})
    with pytest.raises(ValueError, match=r"eplb.step is not a setting; allowed: eplb.interval"):
        baseline_options({"eplb": {"step": 3}})
    with pytest.raises(ValueError, match=r"online.plan_latency_us = 'fast'; allowed: a number"):
        baseline_options({"online": {"plan_latency_us": "fast"}})


def test_cli_takes_the_new_sections_and_names(tmp_path, capsys):
    import json

    from relibra_torch.cli import main
    from relibra_torch.planning.pricing import (LIGHT_SHARE, PLAN_FLOOR_NODES_S, PLAN_FLOOR_S, PLAN_LAYER_NODES_S,
                                                PLAN_LAYER_S, PLAN_SCHEDULE_S)
    cfg = tmp_path / "c.toml"
    cfg.write_text('[online]\nplan_latency_us = 10\nmin_replica_tokens = 8\n[eplb]\ninterval = 3\n')
    out = tmp_path / "r.json"
    argv = ["simulate", "--nodes", "1", "--gpus-per-node", "4", "--micro-batches", "2",
            "--micro-batch-tokens", "64", "--steps", "2", "--no-progress", "--config", str(cfg), "--ignore-memory",
            "--systems", "eplb,eplb-oracle-instance,online-node,online-global",
            "--set", "eplb.interval=2", "--json", str(out)]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["baseline_options"] == {
        "eplb_interval": 2, "eplb_window": 8, "eplb_num_groups": 1,          # --set beats the file
        "online_plan_latency_us": 10.0, "online_min_replica_tokens": 8, "planning_overlap_s": None,
        "planning_split": True,
        "relibra_cross_node_replicas": True, "relibra_reorder": True, "relibra_traffic_search": True,
        "relibra_balance": True, "relibra_two_hop": True, "relibra_choose": False, "relibra_spread_fills": True,
        "relibra_relay": True,
        "relibra_max_swap_rounds": 64,
        "relibra_swap_candidates": 8, "relibra_plan_floor_s": PLAN_FLOOR_S, "relibra_plan_floor_nodes_s": PLAN_FLOOR_NODES_S,
        "relibra_plan_layer_s": PLAN_LAYER_S, "relibra_plan_layer_nodes_s": PLAN_LAYER_NODES_S,
        "relibra_light_share": LIGHT_SHARE, "relibra_plan_schedule_s": PLAN_SCHEDULE_S,
        "relibra_host_scale": None, "relibra_host_scale_nodes": None}  # no relibra run: nothing measured
    assert list(doc["systems"]) == ["static", "eplb", "eplb-oracle-instance", "online-node",
                                    "online-global", "uniform", "bound"]
    assert "run-time planning 10.0 us per layer" in " ".join(capsys.readouterr().out.split())
    assert doc["systems"]["online-node"]["planning_exposed_s"] > 0
    assert main(argv[:-4] + ["--set", "online.plan_latency_us=-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "online.plan_latency_us" in err and "allowed" in err and len(err.splitlines()) == 1


def test_every_system_table_fits_80_columns():
    """Every system's row and header, uncut, on an 80-column terminal."""
    import io

    from rich.console import Console

    from relibra_torch.sim.report import print_table
    from relibra_torch.sim.simulator import SYSTEMS
    fig = {k: 1.0 for k in ("imbalance_mean", "imbalance_p50", "imbalance_p99", "speedup_vs_static",
                            "speedup_vs_eplb_oracle", "fraction_of_bound")}
    fig.update(moe_layer_time_s=308.71, step_time_s=346.72, cross_node_bytes=130_383e9,
               intra_node_bytes=11_585e9, replica_bytes=4_035e9, migrated_experts=11_599,
               migrated_bytes=1_234e9, planner_s=22.8, balanced_at_own_bytes_s=301.5)
    import dataclasses

    from relibra_torch.sim.presets import MODELS
    doc = {"config": {"model": dataclasses.asdict(MODELS["qwen3-235b-a22b"]), "hardware": {"name": "h200"}, "nodes": 4,
                      "gpus_per_node": 8, "ep_size": 32, "replica_slots": 2, "micro_batches": 32,
                      "measured_steps": 1, "cost_options": {"overlap_replication": False},
                      "baseline_options": {"online_plan_latency_us": 67.0}, "source": "s", "notes": {}},
           "systems": {name: dict(fig) for name in SYSTEMS}}
    out = io.StringIO()
    print_table(doc, Console(file=out, width=80, force_terminal=False))
    lines = out.getvalue().splitlines()
    rows = [line for line in lines if line.strip().split(" ")[0] in SYSTEMS or line.startswith("system ")]
    assert len(rows) == 2 * (len(SYSTEMS) + 1)
    assert all("…" not in line and len(line.rstrip()) <= 80 for line in rows)
