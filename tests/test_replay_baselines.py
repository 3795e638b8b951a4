"""The baselines fed the same replay as relibra: eplb-node-demand and online-global-planned.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots, N nodes.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import (OnlinePlanner, Topology, eplb_node_demand_plan, evaluate, make_planner,
                                    validate_plan)
from relibra_torch.planning.eplb import eplb_replica_table
from relibra_torch.planning.replay_baselines import node_demand_replicas
from relibra_torch.sim import CostModel, SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.simulator import default_planner_factory

from test_sim_simulator import MODEL, skewed_loads

HW = get_hardware("h200")


@st.composite
def cases(draw):
    N, g = draw(st.sampled_from([(2, 2), (2, 4), (4, 2)]))
    El = draw(st.integers(1, 3))
    E = N * g * El
    R = draw(st.integers(0, 4))
    M, L = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    seed = draw(st.integers(0, 10_000))
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(L, 1, E, generator=gen) ** 4
    loads = (torch.rand(M, L, N * g, E, generator=gen) * w * 400).to(torch.int64)
    return Topology(N, g, E, R), loads, draw(st.sampled_from([0.0, 1e-4]))


def traffic_slots(plan):
    """bool [M, L, G, J]: the traffic slots (the last R // 2 of every GPU)."""
    topo = plan.topology
    r = topo.replica_slots // 2 if topo.num_nodes > 1 else 0
    mask = torch.zeros_like(plan.slot_expert_MLGJ, dtype=torch.bool)
    if r:
        mask[..., topo.slots_per_gpu - r:] = True
    return mask


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_node_demand_plan_is_valid_deterministic_and_keeps_the_slot_budget(case):
    topo, loads, fill_s = case
    plan = eplb_node_demand_plan(loads, topo, None, 1, 3.3e-7, fill_s)
    validate_plan(plan, loads)
    again = eplb_node_demand_plan(loads, topo, None, 1, 3.3e-7, fill_s)
    assert torch.equal(plan.slot_expert_MLGJ, again.slot_expert_MLGJ)
    assert torch.equal(plan.slot_tokens_MLGJ, again.slot_tokens_MLGJ)
    assert torch.equal(plan.placement_LE, again.placement_LE)
    # step-long: the same slots in every micro-batch
    assert (plan.slot_expert_MLGJ == plan.slot_expert_MLGJ[:1]).all()
    M, L, G, J = plan.slot_expert_MLGJ.shape
    N, g, El, R = topo.num_nodes, topo.gpus_per_node, topo.experts_per_gpu, topo.replica_slots
    r = R // 2 if N > 1 else 0
    se, quota = plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ
    # the first J - r slots of every GPU are EPLB-oracle's table on R - r redundant slots
    table = eplb_replica_table(loads.double().sum((0, 2)), Topology(N, g, topo.num_experts, R - r),
                               topo.static_placement(L))
    head = se[0, :, :, :J - r]
    assert torch.equal(head[head >= 0], table[head >= 0])
    # traffic slots: the node-demand replicas (remote: no EPLB instance on the node) take
    # exactly the node's tokens in every micro-batch; where none paid, EPLB's redundant experts
    _, _, traffic_LGr, _ = node_demand_replicas(loads, topo, topo.static_placement(L), 1, 3.3e-7, fill_s)
    assert traffic_LGr.shape == (L, G, r)
    demand_MLNE = loads.view(M, L, N, g, -1).sum(3)
    for l in range(L):
        for q in range(G):
            n = q // g
            for i in range(r):
                e, j = int(traffic_LGr[l, q, i]), J - r + i
                assert int(se[0, l, q, j]) == e or e < 0
                if e >= 0:
                    assert not bool((table[l, n * g:(n + 1) * g] == e).any())   # remote to the node
                    assert torch.equal(quota[:, l, q, j], demand_MLNE[:, l, n, e])


def test_node_demand_replicas_are_the_top_demand_remote_experts_by_hand():
    """2 nodes x 2 GPUs, 8 experts, R = 2 (one traffic slot per GPU, two per node). Node 0's
    ranks want experts 4 and 6 most among node 1's (and 5 a little), node 1's want 1 and 2
    most among node 0's. Uniform aggregate loads keep EPLB's table free of redundant copies
    on the other node; the traffic replicas are then exactly those experts, with exactly the
    node's tokens."""
    topo = Topology(2, 2, 8, replica_slots=2)
    M, L, S, E = 2, 1, 4, 8
    loads = torch.full((M, L, S, E), 10, dtype=torch.int64)
    loads[:, 0, 0:2, 4] += 30            # node 0's sources: 4 and 6 hot, 5 warm
    loads[:, 0, 0:2, 6] += 20
    loads[:, 0, 0:2, 5] += 5
    loads[:, 0, 2:4, 1] += 40            # node 1's sources: 1 and 2 hot
    loads[:, 0, 2:4, 2] += 25
    plan = eplb_node_demand_plan(loads, topo, None, 1, 3.3e-7, 0.0)
    validate_plan(plan, loads)
    owner_node = plan.owner_gpu_LE()[0] // 2
    traffic = plan.slot_expert_MLGJ[0, 0, :, -1]                        # the last slot of each GPU
    node0 = set(traffic[:2].tolist())
    node1 = set(traffic[2:].tolist())
    remote0 = [e for e in range(E) if int(owner_node[e]) == 1]
    remote1 = [e for e in range(E) if int(owner_node[e]) == 0]
    demand0 = loads[0, 0, 0:2].sum(0)
    demand1 = loads[0, 0, 2:4].sum(0)
    table = eplb_replica_table(loads.double().sum((0, 2)), Topology(2, 2, 8, 1), topo.static_placement(1))
    on0 = set(table[0, :2].flatten().tolist())
    on1 = set(table[0, 2:].flatten().tolist())
    want0 = sorted((e for e in remote0 if e not in on0), key=lambda e: (-int(demand0[e]), e))[:2]
    want1 = sorted((e for e in remote1 if e not in on1), key=lambda e: (-int(demand1[e]), e))[:2]
    assert node0 == set(want0) and node1 == set(want1)
    assert 4 in node0 or 4 in on0
    # quotas: exactly the node's tokens for the expert, in every micro-batch
    for q in range(4):
        e = int(traffic[q])
        src = slice(0, 2) if q < 2 else slice(2, 4)
        for m in range(M):
            assert int(plan.slot_tokens_MLGJ[m, 0, q, -1]) == int(loads[m, 0, src, e].sum())
    # a replica that does not pay its fill over the step is not made: leftover slots get
    # EPLB's redundant experts instead
    costly = eplb_node_demand_plan(loads, topo, None, 1, 3.3e-7, 1.0)
    validate_plan(costly, loads)
    assert (node_demand_replicas(loads, topo, topo.static_placement(1), 1, 3.3e-7, 1.0)[2] < 0).all()
    last = costly.slot_expert_MLGJ[0, 0, :, -1]
    assert (last >= 0).all()
    # EPLB's rule: every extra instance goes to an expert with the most load per instance
    weight = loads.double().sum((0, 2))[0]
    count = torch.bincount(table[0].flatten(), minlength=E).double()
    assert float((weight / count)[last].min()) >= float((weight / count).sort(descending=True).values[5])


def test_node_demand_fills_are_counted_once_per_step():
    topo = Topology(2, 2, 8, replica_slots=2)
    loads = skewed_loads(X=1, M=3, S=4, E=8, tokens=256)[0]
    cost = CostModel(MODEL, HW)
    planner = default_planner_factory("eplb-node-demand", topo, cost)
    plan = planner.plan(loads)
    metrics = evaluate(plan, loads)
    traffic = traffic_slots(plan) & metrics.fill_cross_node_MLGJ
    assert traffic.any()
    # a step-long cross-node residency starts at micro-batch 0 only
    assert (metrics.fill_start_MLGJ[1:] & traffic[1:]).sum() == 0
    counts = cost.replica_counts(plan, metrics)
    assert int(counts["fetch_recv_cross"].sum()) >= int(traffic[0].sum())
    step = cost.step_cost(plan, metrics, loads.sum(-1) // 2, (loads.sum(-1) // 2).double())
    assert step.replica_bytes > 0 and float(step.replica_s_ML.sum()) > 0
    # the planner got relibra's prices from the cost model
    w = cost.reorder_weights()
    assert planner.cross_replica_fill_s_per_expert == w.cross_replica_fill_s_per_expert > 0


def test_online_global_planned_is_online_global_without_its_latency():
    topo = Topology(2, 2, 8, replica_slots=2)
    loads = skewed_loads(X=1, M=3, S=4, E=8, tokens=512)
    wl = workload_from_loads(loads, MODEL, topo)
    res = simulate(wl, SimConfig(MODEL, HW, topo, ("static", "online-global", "online-global-planned")))
    a = make_planner("online-global", topo).plan(loads[0])
    b = make_planner("online-global-planned", topo).plan(loads[0])
    assert torch.equal(a.slot_expert_MLGJ, b.slot_expert_MLGJ) and torch.equal(a.slot_tokens_MLGJ, b.slot_tokens_MLGJ)
    assert isinstance(make_planner("online-global-planned", topo), OnlinePlanner)
    assert make_planner("online-global-planned", topo).plan_latency_s == 0.0
    f = res.figures()
    assert f["online-global-planned"]["planning_exposed_s"] == 0.0
    M, L = 3, MODEL.num_moe_layers
    assert f["online-global"]["step_time_s"] == pytest.approx(
        f["online-global-planned"]["step_time_s"] + M * L * 67e-6, rel=1e-12)
    assert f["online-global-planned"]["fraction_of_bound"] <= 1.0
