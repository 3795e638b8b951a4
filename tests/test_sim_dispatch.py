"""Dispatch modes of the cost model (flat, hierarchical) and cross_node_recv_imbalance.

Small shapes keep this file at a few seconds. Legend: X steps, M micro-batches, L layers,
S source ranks, E experts, G GPUs, J slots, N nodes, T tokens, K top-k.
"""

import dataclasses
import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.moe.schedule import LayerPlan, assign_slots, build_rank_schedule
from relibra_torch.planning import ReLibraConfig, StaticPlanner, Topology, evaluate, make_planner, token_split
from _replay_helpers import skewed_routing_file
from relibra_torch.replay import RoutingReplay
from relibra_torch.sim import CostModel, CostOptions, SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.dispatch import (approx_cross_tokens, approx_gpu_copies, exact_copies, exact_cross_tokens,
                                        hierarchical_metrics, hierarchical_traffic,
                                        uniform_remote_node_probability)
from relibra_torch.sim.presets import ModelSpec
from relibra_torch.sim.workload import workload_from_file

from test_sim_simulator import MODEL, skewed_loads

from relibra_torch.sim.baselines import BaselineOptions

HW = get_hardware("h200")
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "sim_flat_expected.json")


def test_flat_mode_reproduces_the_numbers_stored_before_dispatch_modes():
    # tests/fixtures/sim_flat_expected.json was written by the simulator at commit 565ce41
    # (before this change) for exactly this workload and config; planner_s (wall time) left out.
    with open(FIXTURE) as fh:
        expected = json.load(fh)
    # Only the systems whose plans no later change touched: static's plan is fixed and uniform
    # is a formula, so their figures test the flat cost model itself (the planners of eplb
    # and relibra changed on purpose after the fixture was written: issues 11 and 12). The
    # fixture's "ideal" and "fraction_of_ideal" keys were renamed "uniform" and
    # "fraction_of_uniform" with the reference (issue 21); the values are the ones written.
    expected = {k: v for k, v in expected.items() if k in ("static", "uniform")}
    wl = workload_from_loads(skewed_loads(X=2, seed=3, tokens=256), MODEL, Topology(2, 2, 8, 1))
    # the tiny model's forward pass (microseconds) cannot hide host planning; the fixture
    # predates its charge (tests/test_sim_host_charge.py), so a window hides it here
    # the fixture also predates the collectives' fixed latency: zero it to compare the rest
    no_latency = dataclasses.replace(HW, inter_node_latency_us=0.0, nvlink_latency_us=0.0)
    res = simulate(wl, SimConfig(MODEL, no_latency, Topology(2, 2, 8, 1), ("static", "uniform"), warmup_steps=1,
                                 baseline_options=BaselineOptions(planning_overlap_s=1e9)))
    assert res.config.cost_options.dispatch == "flat"
    figures = res.figures()
    assert set(figures) - {"bound"} == set(expected) == {"static", "uniform"}
    for name, exp in expected.items():
        for key, value in exp.items():
            if key == "speedup_vs_eplb_oracle":  # a ratio to eplb-oracle, which is not run here
                continue
            got = figures[name][key]
            assert got == pytest.approx(value, rel=1e-12, abs=0), (name, key)
        assert "cross_node_recv_imbalance" in figures[name]
    assert figures["uniform"]["cross_node_recv_imbalance"] == 1.0


def one_token_plan():
    """2 nodes x 2 GPUs, 4 experts (expert e on GPU e), one token on rank 0 routed to {2, 3}."""
    topo = Topology(2, 2, 4, replica_slots=0)
    loads = torch.zeros(1, 1, 4, 4, dtype=torch.int64)
    loads[0, 0, 0, 2] = loads[0, 0, 0, 3] = 1
    plan = StaticPlanner(topo).plan(loads)
    return topo, loads, plan


def test_hierarchical_one_token_by_hand():
    topo, loads, plan = one_token_plan()
    split = token_split(plan, loads)[0]  # [L, S, G, J]
    ids = torch.tensor([[[2, 3]]])
    exact = exact_cross_tokens(split, plan.slot_expert_MLGJ[0], ids, torch.tensor([0]), topo)
    approx = approx_cross_tokens(split, plan.slot_expert_MLGJ[0], torch.tensor([1, 0, 0, 0]), 2, topo)
    assert exact.tolist() == [[[0, 1], [0, 0], [0, 0], [0, 0]]]
    assert torch.allclose(approx, exact.double())
    cs, cr, is_, ir = hierarchical_traffic(split.sum(-1), exact, topo)
    # crosses once (rank 0 -> GPU 2, local index 0 of node 1), GPU 2 forwards expert 3's pair
    assert cs.tolist() == [[1, 0, 0, 0]] and cr.tolist() == [[0, 0, 1, 0]]
    assert is_.tolist() == [[0, 0, 1, 0]] and ir.tolist() == [[0, 0, 0, 1]]
    flat = evaluate(plan, loads)
    assert flat.cross_send_MLG[0].tolist() == [[2, 0, 0, 0]]
    assert flat.cross_recv_MLG[0].tolist() == [[0, 0, 1, 1]]


def test_hierarchical_rows_by_hand_one_row_per_token_and_gpu():
    """2 x 2 GPUs, 8 experts (GPU e // 2): rank 0's token routed to {4, 5, 6} crosses once
    (to GPU 2, its local index on node 1), which keeps 4 and 5 (one row, no NVLink copy)
    and forwards one row to GPU 3 for 6; rank 1's token to {0, 1, 2} sends one NVLink row
    to GPU 0 (experts 0 and 1) and keeps 2."""
    topo = Topology(2, 2, 8, replica_slots=0)
    ids = torch.tensor([[[4, 5, 6]], [[0, 1, 2]]])
    loads = torch.zeros(1, 1, 4, 8, dtype=torch.int64)
    loads[0, 0, 0, [4, 5, 6]] = 1
    loads[0, 0, 1, [0, 1, 2]] = 1
    plan = StaticPlanner(topo).plan(loads)
    split = token_split(plan, loads)[0]
    cross, copies = exact_copies(split, plan.slot_expert_MLGJ[0], ids, torch.tensor([0, 1]), topo)
    assert cross[0].tolist() == [[0, 1], [0, 0], [0, 0], [0, 0]]
    assert copies[0].tolist() == [[0, 0, 1, 1], [1, 1, 0, 0], [0] * 4, [0] * 4]
    cs, cr, is_, ir = hierarchical_traffic(copies, cross, topo)
    assert cs.tolist() == [[1, 0, 0, 0]] and cr.tolist() == [[0, 0, 1, 0]]
    assert is_.tolist() == [[0, 1, 1, 0]] and ir.tolist() == [[1, 0, 0, 1]]
    from relibra_torch.sim.dispatch import hierarchical_rows
    rows = hierarchical_rows(plan, loads, [[ids[:1], ids[1:], torch.zeros(0, 1, 3), torch.zeros(0, 1, 3)]])
    assert rows["cross_node_rows"].tolist() == [cs.tolist()] and rows["intra_node_rows"].tolist() == [is_.tolist()]
    # the count-only estimate is exact here (one token per source)
    approx = approx_gpu_copies(split, plan.slot_expert_MLGJ[0], torch.tensor([1, 1, 0, 0]), 3, topo)
    assert torch.allclose(approx, copies.double())


def random_routing(T_per_rank, S, L, E, K, seed, skew=4.0):
    """ids [S * T, L, K] (distinct per token), source of each token (rank-major)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(S * T_per_rank, L, K, dtype=torch.int64)
    for l in range(L):
        for s in range(S):
            w = torch.rand(E, generator=g) ** skew + 1e-3
            ids[s * T_per_rank:(s + 1) * T_per_rank, l] = torch.multinomial(
                w.expand(T_per_rank, E), K, replacement=False, generator=g)
    return ids, torch.arange(S).repeat_interleave(T_per_rank)


def counts(ids_TLK, source_T, S, E):
    T, L, K = ids_TLK.shape
    out = torch.zeros(1, L, S, E, dtype=torch.int64)
    for l in range(L):
        out[0, l].index_put_((source_T.repeat_interleave(K), ids_TLK[:, l].reshape(-1)),
                             torch.ones(T * K, dtype=torch.int64), accumulate=True)
    return out


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), K=st.integers(1, 3), planner=st.sampled_from(["eplb-oracle", "relibra"]))
def test_exact_follows_the_layers_slot_rule_and_never_exceeds_flat(seed, K, planner):
    topo = Topology(2, 2, 8, replica_slots=2)
    S, E, L = 4, 8, 2
    ids, src = random_routing(12, S, L, E, K, seed)
    loads = counts(ids, src, S, E)
    p = make_planner(planner, topo) if planner != "relibra" else make_planner(planner, topo, config=ReLibraConfig())
    plan = p.plan(loads)
    split = token_split(plan, loads)[0]
    exact, copies = exact_copies(split, plan.slot_expert_MLGJ[0], ids, src, topo)
    assert torch.equal(exact, exact_cross_tokens(split, plan.slot_expert_MLGJ[0], ids, src, topo))
    # independent check: the layer's own assign_slots per rank
    J, g = topo.slots_per_gpu, topo.gpus_per_node
    for l in range(L):
        lp = LayerPlan(plan.slot_expert_MLGJ[0, l], split[l])
        for s in range(S):
            dest = assign_slots(ids[src == s, l], build_rank_schedule(topo, plan.placement_LE[l], lp, s))
            node = dest // (J * g)
            need = torch.zeros(int((src == s).sum()), topo.num_nodes, dtype=torch.bool)
            need.scatter_(1, node, True)
            need[:, s // g] = False
            assert exact[l, s].tolist() == need.sum(0).tolist()
            gpus = [set((d // J).tolist()) for d in dest]
            assert copies[l, s].tolist() == [sum(h in gs for gs in gpus) for h in range(topo.num_gpus)]
    flat = evaluate(plan, loads)
    cs, cr, is_, ir = hierarchical_traffic(copies, exact, topo)
    assert (cs <= flat.cross_send_MLG[0]).all() and cs.sum() == cr.sum()
    approx = approx_cross_tokens(split, plan.slot_expert_MLGJ[0], torch.full((S,), 12), K, topo)
    assert (approx.sum(-1) <= flat.cross_send_MLG[0].double() + 1e-9).all()
    if K == 1:  # one expert per token: a copy per remote node is a copy per pair
        # (receives land on the source's local index, so only their total equals flat's)
        assert torch.equal(cs, flat.cross_send_MLG[0]) and cr.sum() == flat.cross_recv_MLG[0].sum()
        assert torch.allclose(approx.sum(-1), flat.cross_send_MLG[0].double())
    # NVLink fan-out plus node-local pairs = flat intra pairs + cross pairs not landing on their GPU
    assert int(is_.sum()) == int(ir.sum())


def test_uniform_remote_node_probability():
    assert uniform_remote_node_probability(128, 8, 4) == pytest.approx(
        1 - math.comb(96, 8) / math.comb(128, 8))
    assert uniform_remote_node_probability(128, 8, 1) == 0.0
    assert uniform_remote_node_probability(8, 1, 2) == pytest.approx(0.5)
    # the count-only estimate is exact for uniform routing: 4 x 8 GPUs, 128 experts, top-8
    topo = Topology(4, 8, 128, replica_slots=0)
    loads = torch.full((1, 1, 32, 128), 64, dtype=torch.int64)  # 1024 tokens per rank
    plan = StaticPlanner(topo).plan(loads)
    split = token_split(plan, loads)[0]
    est = approx_cross_tokens(split, plan.slot_expert_MLGJ[0], torch.full((32,), 1024), 8, topo)
    assert est.sum(-1) == pytest.approx(torch.full((1, 32), 1024 * 3 * (1 - math.comb(96, 8) / math.comb(128, 8)),
                                                   dtype=torch.float64), rel=1e-9)


def tiny_model(E=32, K=4, L=2):
    return dataclasses.replace(MODEL, num_experts=E, top_k=K, num_layers=L, num_moe_layers=L)


def test_exact_and_estimated_hierarchical_agree_on_a_routing_file(tmp_path):
    """The count-only estimate against the exact per-token count, on a routing file whose
    samples each have their own expert preferences (PL sampling without replacement).
    Stated tolerance: total cross-node bytes within 2% for every system (measured: 0.3%); the estimate's
    known bias is low (it over-states the chance of needing no expert on a node)."""
    E, K, L, S = 32, 4, 2, 8
    path = str(tmp_path / "r.safetensors")
    skewed_routing_file(path, E, K, L, 64, 20, 60, seed=7)
    model = tiny_model(E, K, L)
    topo = Topology(4, 2, E, replica_slots=1)
    wl = workload_from_file(path, model, topo, num_micro_batches=2)
    assert wl.routing is not None
    cfg = SimConfig(model, HW, topo, ("static", "eplb-oracle", "relibra", "uniform"),
                    CostOptions(dispatch="hierarchical"))
    exact = simulate(wl, cfg).figures()
    wl_est = dataclasses.replace(wl, routing=None, notes={})
    est = simulate(wl_est, cfg).figures()
    flat = simulate(dataclasses.replace(wl, notes={}), dataclasses.replace(cfg, cost_options=CostOptions())).figures()
    for name in ("static", "eplb-oracle", "relibra"):
        assert est[name]["cross_node_bytes"] == pytest.approx(exact[name]["cross_node_bytes"], rel=0.02), name
        assert exact[name]["cross_node_bytes"] < flat[name]["cross_node_bytes"]
        # NVLink rows per (token, GPU): the same estimate over GPUs (measured 0.7% low)
        assert est[name]["intra_node_bytes"] == pytest.approx(exact[name]["intra_node_bytes"], rel=0.02), name
    assert exact["uniform"]["step_time_s"] == est["uniform"]["step_time_s"]  # one definition


def test_cross_node_recv_imbalance_by_hand():
    topo = Topology(2, 2, 8, replica_slots=0)
    loads = skewed_loads(X=1, M=1, L=2)[0]
    plan = StaticPlanner(topo).plan(loads)
    metrics = evaluate(plan, loads)
    recv = torch.tensor([[[4, 0, 0, 0], [0, 0, 0, 0]]])  # layer 0: 4 / 1; layer 1: no cross traffic
    metrics = dataclasses.replace(metrics, cross_recv_MLG=recv)
    cost = CostModel(MODEL, HW)
    tokens = torch.full((1, 4), 64)
    c = cost.step_cost(plan, metrics, tokens, tokens.double())
    assert c.cross_node_recv_imbalance == pytest.approx((4.0 + 1.0) / 2)
    recv = torch.tensor([[[3, 1, 2, 2], [1, 1, 1, 1]]])
    c = cost.step_cost(plan, dataclasses.replace(metrics, cross_recv_MLG=recv), tokens, tokens.double())
    assert c.cross_node_recv_imbalance == pytest.approx((3 / 2 + 1.0) / 2)


def test_hierarchical_uniform_by_hand():
    model = tiny_model(E=8, K=2, L=2)
    loads = skewed_loads(X=1, M=2, L=2, k=2)[0]
    tokens = torch.full((2, 4), 64)
    flat = CostModel(model, HW).uniform_step_cost(loads, 2, 2, tokens, tokens.double())
    hier = CostModel(model, HW, CostOptions(dispatch="hierarchical")).uniform_step_cost(
        loads, 2, 2, tokens, tokens.double())
    token_bytes = model.hidden_size * 2
    pairs = float(loads.sum())
    p_node = 1 - math.comb(4, 2) / math.comb(8, 2)  # a token needs the other node
    assert flat.cross_node_bytes == pytest.approx(4 * token_bytes * pairs / 2)
    assert hier.cross_node_bytes == pytest.approx(4 * token_bytes * pairs / 2 * p_node)
    # NVLink: one row per (token, GPU) for the source's node-mate and the landing GPU's
    # node-mate (N (g - 1) = 2 GPUs), each holding 2 of the 8 experts
    p_gpu = 1 - math.comb(6, 2) / math.comb(8, 2)
    assert hier.intra_node_bytes == pytest.approx(4 * token_bytes * pairs / 2 * 2 * p_gpu)
    assert hier.cross_node_recv_imbalance == 1.0


def test_estimated_hierarchical_runs_on_count_only_loads_and_says_so():
    wl = workload_from_loads(skewed_loads(X=1, tokens=128), MODEL, Topology(2, 2, 8, 1))
    res = simulate(wl, SimConfig(MODEL, HW, Topology(2, 2, 8, 1), ("static", "relibra", "uniform"),
                                 CostOptions(dispatch="hierarchical")))
    assert "estimated" in res.workload.notes["dispatch"]
    f = res.figures()
    assert all(f[n]["cross_node_recv_imbalance"] >= 1.0 for n in f)
    with pytest.raises(ValueError, match="--dispatch"):
        CostOptions(dispatch="tree")


def test_hierarchical_metrics_top1_equals_flat():
    model = tiny_model(E=8, K=1, L=2)
    topo = Topology(2, 2, 8, replica_slots=1)
    loads = skewed_loads(X=1, M=2, L=2, k=1, tokens=50)[0]
    plan = make_planner("eplb-oracle", topo).plan(loads)
    flat = evaluate(plan, loads)
    tokens = loads[:, 0].sum(-1)
    hier = hierarchical_metrics(plan, flat, loads, tokens, 1)
    assert torch.allclose(hier.cross_send_MLG, flat.cross_send_MLG.double())
    assert torch.allclose(hier.cross_recv_MLG.sum(-1), flat.cross_recv_MLG.sum(-1).double())
    del model


def test_cli_dispatch_from_config_file_and_notes(tmp_path, capsys):
    from test_sim_cli import loads_file, routing_file, run
    f, r = tmp_path / "loads.safetensors", tmp_path / "routing.safetensors"
    loads_file(f)
    routing_file(r, steps=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"simulate": {"dispatch": "hierarchical", "systems": "static",
                                            "nodes": 2, "gpus_per_node": 2, "ignore_memory": True}}))
    for path, word in ((f, "estimated"), (r, "exact")):
        out_json = tmp_path / f"{word}.json"
        rc, out, err = run(capsys, str(path), "--config", str(cfg), "--no-progress", "--json", str(out_json))
        assert rc == 0, err
        doc = json.loads(out_json.read_text())
        assert doc["config"]["cost_options"]["dispatch"] == "hierarchical"
        assert word in doc["config"]["notes"]["dispatch"] and "dispatch:" in out
        assert doc["systems"]["static"]["cross_node_recv_imbalance"] >= 1.0
    rc, out, err = run(capsys, str(f), "--trace", "rank-mix", "--nodes", "2", "--gpus-per-node", "2")
    assert rc == 2 and "--trace rank-mix shapes the synthetic trace; it does not apply to the file" in err


def test_plot_clips_far_systems_and_stacks_parts_to_the_step(tmp_path):
    from relibra_torch.sim.report import STEP_PARTS, imbalance_ylim, write_plot
    top, clipped = imbalance_ylim({"static": 3.4, "eplb": 1.2, "relibra": 1.05, "uniform": 1.0, "bound": 1.0})
    assert top == 1.3 and clipped == ["static"]
    top, clipped = imbalance_ylim({"static": 1.8, "relibra": 1.02, "uniform": 1.0})
    assert clipped == [] and top == pytest.approx(1.8 * 1.02)
    wl = workload_from_loads(skewed_loads(X=1, tokens=128), MODEL, Topology(2, 2, 8, 1))
    res = simulate(wl, SimConfig(MODEL, HW, Topology(2, 2, 8, 1), ("static", "relibra", "uniform")))
    for f in res.figures().values():  # the stacked bars add up to the step time
        assert sum(f[key] for _, key, _ in STEP_PARTS) == pytest.approx(f["step_time_s"], rel=1e-12)
    write_plot(res, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_relibra_uses_co_activation_under_hierarchical_dispatch(tmp_path):
    """A routing file whose tokens choose experts in fixed pairs that static placement puts on
    different nodes: under hierarchical dispatch relibra, given the step's pair counts
    (only replay has them), places each pair on one node and sends fewer cross-node bytes
    than the same planner pricing flat dispatch (no co-activation)."""
    from relibra_torch.planning import ReLibraPlanner
    from relibra_torch.sim.simulator import default_planner_factory

    E, K, L = 16, 2, 1
    g = torch.Generator().manual_seed(3)
    n_samples, n_tok = 32, 40
    first = torch.randint(0, E // 2, (n_samples * n_tok,), generator=g)
    a = first * 2 % E
    partner = (a + E // 2 + 1) % E                             # a partner on another node
    ids = torch.stack([a, partner], -1).view(-1, L, K).to(torch.int16)
    offsets = torch.arange(0, n_samples * n_tok + 1, n_tok, dtype=torch.int64)
    path = str(tmp_path / "pairs.safetensors")
    RoutingReplay(ids, offsets, E).save(path)
    model = tiny_model(E, K, L)
    topo = Topology(2, 2, E, replica_slots=0)
    wl = workload_from_file(path, model, topo, num_micro_batches=2)
    cfg = SimConfig(model, HW, topo, ("static", "relibra", "uniform"), CostOptions(dispatch="hierarchical"),
                    baseline_options=BaselineOptions(planning_overlap_s=1e9))  # compare plans, not planner CPU

    def factory(dispatch):  # this toy step is too small to pay a migration: make moves free
        def make(name, topology, cost):
            planner = default_planner_factory(name, topology, cost)
            if name == "relibra":
                planner = ReLibraPlanner(topology, dataclasses.replace(  # and plan every layer (no guard)
                    planner.config, dispatch=dispatch, migration_s_per_expert=0.0, intra_migration_s_per_expert=0.0,
                    plan_floor_s=0.0, plan_floor_nodes_s=0.0))
            return planner
        return make
    with_pairs = simulate(wl, cfg, planner_factory=factory("hierarchical")).figures()
    without = simulate(dataclasses.replace(wl, notes={}), cfg, planner_factory=factory("flat")).figures()
    assert with_pairs["relibra"]["cross_node_bytes"] < without["relibra"]["cross_node_bytes"]
    assert with_pairs["relibra"]["step_time_s"] < without["relibra"]["step_time_s"]
