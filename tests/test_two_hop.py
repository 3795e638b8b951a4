"""Two-hop replicas (planning.two_hop): the hub rule against a brute-force walk, and the
simulator's counts and prices of second hops (NVLink, after the first hop)."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytest import approx

from relibra_torch.planning import StepPlan, Topology, evaluate
from relibra_torch.planning.residency import residencies
from relibra_torch.sim import CostModel, get_hardware, get_model, transfer_counts
from relibra_torch.sim.transfers import layer_collectives_ML


def walk_residencies(se, owner, tokens, G, J, g):
    """Every cross-node residency with tokens as (slot x, expert, node, a, b), by walking."""
    M, X = se.shape
    out = []
    for x in range(X):
        gpu = x // J
        m = 0
        while m < M:
            e = int(se[m, x])
            if e < 0 or int(owner[e]) // g == gpu // g:   # empty, or not a cross-node fill
                m += 1
                continue
            end = m
            while end + 1 < M and int(se[end + 1, x]) == e:
                end += 1
            active = [q for q in range(m, end + 1) if tokens[q, x] > 0]
            if active:
                out.append((x, e, gpu // g, active[0], active[-1]))
            m = end + 1
    return out


def brute_hubs(res_list, M, X):
    hub = torch.full((M, X), -1, dtype=torch.int64)

    def covers(y, x):
        return (y is not x and y[1] == x[1] and y[2] == x[2] and y[3] <= x[3] and y[4] >= x[4]
                and (y[3] < x[3] or y[4] > x[4] or y[0] < x[0]))

    direct = [r for r in res_list if not any(covers(y, r) for y in res_list)]
    for r in res_list:
        if r in direct:
            continue
        h = min(y[0] for y in direct if covers(y, r))
        hub[r[3]:r[4] + 1, r[0]] = h
    return hub


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_hubs_match_a_walk_and_stay_within_two_hops(data):
    N, g, El, R = 2, data.draw(st.integers(1, 3)), 1, 2
    topo = Topology(N, g, N * g * El, R)
    G, J, E = topo.num_gpus, topo.slots_per_gpu, topo.num_experts
    M = data.draw(st.integers(1, 5))
    placement = topo.static_placement(1)
    native = torch.arange(E).view(G, El)
    # replica slots hold experts 0 or 1 (both owned on node 0) or nothing; one instance per GPU
    se = torch.full((M, 1, G, J), -1, dtype=torch.int64)
    se[..., :El] = native
    tokens = torch.zeros(M, 1, G, J, dtype=torch.int64)
    for m in range(M):
        for q in range(G):
            picks = data.draw(st.lists(st.sampled_from([-1, 0, 1]), min_size=R, max_size=R))
            seen = set(native[q].tolist())
            for j, e in enumerate(picks):
                if e >= 0 and e not in seen:
                    se[m, 0, q, El + j] = e
                    seen.add(e)
                    tokens[m, 0, q, El + j] = data.draw(st.integers(0, 2))
    plan = StepPlan(topo, placement, se, tokens, "hand")
    res = residencies(plan)
    owner = placement[0] // El
    want = brute_hubs(walk_residencies(se[:, 0].reshape(M, -1), owner, tokens[:, 0].reshape(M, -1), G, J, g),
                      M, G * J)
    got = res.hub_MLGJ[:, 0].reshape(M, -1)
    assert torch.equal(got, want), (se[:, 0].tolist(), tokens[:, 0].tolist(), got.tolist(), want.tolist())
    hub = res.hub_MLGJ.reshape(M, -1)
    for m, x in (hub >= 0).nonzero().tolist():
        h = int(hub[m, x])
        assert h // J // g == x // J // g and h // J != x // J          # same node, other GPU
        assert int(se.reshape(M, -1)[m, h]) == int(se.reshape(M, -1)[m, x])
        assert int(hub[m, h]) == -1 and bool(res.held_MLGJ.reshape(M, -1)[m, h])  # the hub is direct, held
    assert (res.hubs(refetch=True) == -1).all()


# --- the simulator: counts and prices --------------------------------------------------------

MODEL = get_model("qwen3-30b-a3b")
HW = get_hardware("h200")


def _two_copies_plan():
    """2 nodes x 2 GPUs, 1 native expert each + 1 replica slot; expert 0 (GPU 0) is copied
    to both GPUs of node 1: GPU 2 over micro-batches 0-2, GPU 3 over 1-2 (covered: a second
    hop from GPU 2). Node 1's tokens for expert 0 stay on node 1."""
    topo = Topology(2, 2, 4, 1)
    placement = topo.static_placement(1)
    M = 3
    se = torch.tensor([[0, -1], [1, -1], [2, 0], [3, 0]]).expand(M, 1, 4, 2).clone()
    se[0, 0, 3, 1] = -1
    loads = torch.zeros(M, 1, 4, 4, dtype=torch.int64)
    loads[:, 0, :, 1:] = 2
    loads[:, 0, 2:, 0] = 6                       # node 1 wants expert 0
    tokens = torch.zeros(M, 1, 4, 2, dtype=torch.int64)
    tokens[:, 0, :, 0] = torch.tensor([0, 8, 8, 8])  # expert 0's 12 tokens all on node 1's copies
    tokens[0, 0, 2, 1] = 12
    tokens[1:, 0, 2, 1] = 6
    tokens[1:, 0, 3, 1] = 6
    return topo, StepPlan(topo, placement, se, tokens, "hand", placement.clone()), loads


def test_a_second_copy_fills_from_the_first_over_nvlink_after_it():
    topo, plan, loads = _two_copies_plan()
    metrics = evaluate(plan, loads)
    res = metrics.residency
    assert res.hub_MLGJ[:, 0, 3, 1].tolist() == [-1, 2 * 2 + 1, 2 * 2 + 1]  # GPU 3's hub: GPU 2 slot 1
    assert (res.hub_MLGJ[:, 0, 2, 1] == -1).all()
    cost = CostModel(MODEL, HW)
    c = cost.replica_counts(plan, metrics)
    # one inter-node fill and one inter-node return for two copies
    assert c["fetch_recv_cross"][:, 0].tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert c["fetch_send_cross"][:, 0].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert c["return_send_cross"][:, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    # the hub was filled in micro-batch 0: the copy rides in micro-batch 1's first-hop exchange
    assert c["fetch_recv_intra"][:, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert c["fetch_send_intra"][:, 0].tolist() == [[0, 0, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    assert int(c["fetch2_recv"].sum()) == 0 and int(c["fetch2_send"].sum()) == 0
    # both return in micro-batch 2: the copy reduces into the hub first, in its own exchange
    assert c["return2_send"][:, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]
    assert c["return2_recv"][:, 0].tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]]
    w, gb = cost.expert_weight_bytes, cost.expert_grad_bytes
    nvl, ib = HW.nvlink_gbps * 1e9, HW.inter_node_gbps * 1e9
    fill, grad = cost.replica_s(c)
    assert fill[:, 0].tolist() == [approx(w / ib), approx(w / nvl), 0.0]
    # micro-batch 2's backward: reduce into the hub over NVLink, then the hub returns the sum
    assert grad[:, 0].tolist() == [0.0, 0.0, approx(gb / nvl + gb / ib)]
    # a first and a second hop in one micro-batch: one after the other
    plan.slot_expert_MLGJ[0, 0, 3, 1] = 0
    plan.slot_tokens_MLGJ[0, 0, 3, 1] = 6
    plan.slot_tokens_MLGJ[0, 0, 2, 1] = 6
    c2 = cost.replica_counts(plan, evaluate(plan, loads))
    assert c2["fetch2_recv"][0, 0].tolist() == [0, 0, 0, 1] and c2["fetch2_send"][0, 0].tolist() == [0, 0, 1, 0]
    fill2, _ = cost.replica_s(c2)
    assert fill2[0, 0].item() == approx(w / ib + w / nvl)
    assert layer_collectives_ML(residencies(plan), topo)[0, 0].item() == 5 + 2
    # a copy that returns before its hub reduces into it in its own micro-batch's return exchange
    _, plan, _ = _two_copies_plan()
    plan.slot_tokens_MLGJ[2, 0, 3, 1] = 0
    plan.slot_expert_MLGJ[2, 0, 3, 1] = -1
    plan.slot_tokens_MLGJ[2, 0, 2, 1] = 12
    c3 = cost.replica_counts(plan, evaluate(plan, loads))
    assert c3["return_send_intra"][:, 0, 3].tolist() == [0, 1, 0] and c3["return_recv_intra"][:, 0, 2].tolist() == [0, 1, 0]
    assert int(c3["return2_send"].sum()) == 0
    assert layer_collectives_ML(residencies(plan), topo)[:, 0].tolist() == [5 + 1, 5 + 2, 5 + 1]
    # collectives: plan check + 4 exchange, + first-hop fill (mb 0), second-hop fill (mb 1),
    # second-hop reduction and first-hop return (mb 2)
    _, plan, _ = _two_copies_plan()
    n = layer_collectives_ML(residencies(plan), topo)[:, 0].tolist()
    assert n == [5 + 1, 5 + 1, 5 + 2]
    sim = transfer_counts(plan, loads, expert_params=MODEL.expert_params(), param_bytes=2, grad_bytes=4)
    assert sim["fill_bytes_intra"][:, 0, 3].tolist() == [0, w, 0]       # NVLink bytes count as intra
    assert sim["grad_return_bytes_intra"][:, 0, 3].tolist() == [0, 0, gb]
    assert int(sim["fill_bytes_cross"].sum()) == w and int(sim["grad_return_bytes_cross"].sum()) == gb
    # re-fetched replicas keep nothing to forward: every copy crosses
    refetch = transfer_counts(plan, loads, refetch=True, expert_params=MODEL.expert_params())
    assert int(refetch["fill_bytes_intra"].sum()) == 0


def test_a_copy_outliving_the_first_is_not_covered_and_fills_from_the_owner():
    topo, plan, loads = _two_copies_plan()
    plan.slot_tokens_MLGJ[2, 0, 2, 1] = 0           # GPU 2's copy ends at micro-batch 1
    plan.slot_tokens_MLGJ[2, 0, 3, 1] = 12
    res = residencies(plan)
    assert (res.hub_MLGJ == -1).all()
    c = CostModel(MODEL, HW).replica_counts(plan, evaluate(plan, loads))
    assert int(c["fetch_recv_cross"].sum()) == 2 and int(c["fetch2_recv"].sum()) == 0


def test_relibra_spreads_a_hot_remote_expert_over_the_node_for_one_crossing():
    """The collapsed-router case in small: node 1's tokens almost all want node 0's expert 0.
    relibra's traffic replica keeps them home; with two hops balancing splits it over node
    1's GPUs for one inter-node fill (the copy fills from the first over NVLink), and the
    step is shorter than without (where a second copy would need a second crossing)."""
    import dataclasses

    from relibra_torch.planning import relibra_plan
    from relibra_torch.planning.pricing import priced_config

    topo = Topology(2, 2, 4, 2)
    M = 3
    loads = torch.full((M, 1, 4, 4), 10, dtype=torch.int64)
    loads[:, 0, :, 0] = 3000
    cost = CostModel(MODEL, HW)
    tokens, pairs = torch.full((M, 4), 3030), torch.full((M, 4), 3030 * 3031 / 2)
    steps = {}
    for two_hop in (True, False):
        cfg = priced_config(MODEL.hidden_size, MODEL.moe_ffn, "h200", reorder=False, two_hop=two_hop)
        plan = relibra_plan(loads, topo, config=cfg)
        metrics = evaluate(plan, loads)
        res = metrics.residency
        copies = ((plan.slot_expert_MLGJ[:, 0, 2:] == 0).sum((-1, -2))).tolist()
        crossing = res.fill_start_MLGJ & res.cross_node_MLGJ & (res.hub_MLGJ < 0)
        assert int(crossing.sum()) == 1, two_hop                 # one inter-node fill either way
        assert copies == ([2] * M if two_hop else [1] * M), (two_hop, copies)
        steps[two_hop] = cost.step_cost(plan, metrics, tokens, pairs).step_s
    assert steps[True] < steps[False], steps
    assert dataclasses.replace(cfg, two_hop=True).min_cross_replica_tokens < cfg.min_cross_replica_tokens
