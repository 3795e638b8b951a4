"""ReplayBalancedMoE on 4 gloo ranks as 2 nodes x 2 GPUs, against the same layer on one
process with the same logical weights.

One RankPool for the whole module; hypothesis runs dozens of cases inside it. fp32
tolerance: max |error| <= 1e-5 x max |reference| (``_moe_fns.close``). Budget: ~60 s on
2 busy cores (most of it process start-up).
"""

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import _moe_fns as fns
from relibra_torch.moe import layer_plans
from relibra_torch.planning import evaluate, make_planner
from relibra_torch.testing import RankPool

pytestmark = pytest.mark.slow

N, GPN = 2, 2
G = N * GPN
PLANS = ["none", "random-native", "random-intra", "random-general", "static", "eplb", "eplb-oracle",
         "relibra"]


@pytest.fixture(scope="module")
def pool():
    with RankPool(G, timeout_s=240, grace_s=5) as p:
        yield p


@st.composite
def cases(draw, num_nodes=N, gpus_per_node=GPN, max_tokens=8):
    G = num_nodes * gpus_per_node
    E = draw(st.sampled_from([G, 2 * G]))
    K = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["random", "skewed", "one", "sparse"]))
    tokens = draw(st.lists(st.integers(0, max_tokens), min_size=G, max_size=G))
    ids = fns.make_routing(mode, tokens, E, K, gen)
    case = fns.Case(num_nodes, gpus_per_node, E, K, draw(st.integers(0, 2)), seed, ids,
                    refetch=draw(st.booleans()), shared=draw(st.booleans()),
                    score_func=draw(st.sampled_from(["softmax", "sigmoid"])),
                    route_norm=draw(st.booleans()), place_before_load=draw(st.booleans()))
    kind = draw(st.sampled_from(PLANS))
    if kind == "none":
        # No plan: the layer gathers counts and runs its placement (random or identity).
        if draw(st.booleans()):
            case = dataclasses.replace(case, placement_E=torch.randperm(E, generator=gen))
        return case
    return fns.with_plan(case, fns.planner_plan(kind, case.topology(), fns.loads_of(ids, E), gen))


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(case=cases())
def test_numerics_match_one_process(pool, case):
    results = pool.run(fns.run_case, case)
    fills = any(res["fills"] for res in results)
    event(f"R={case.replica_slots} plan={case.plan is not None} fills={fills} refetch={case.refetch}")
    fns.check_case(case, results)


@pytest.mark.parametrize("refetch", [False, True])
def test_every_planner_with_replicas(pool, refetch):
    """Fixed coverage next to the random cases: every plan source with R = 2, fills present."""
    gen = torch.Generator().manual_seed(11 + refetch)
    for kind in PLANS[1:]:
        ids = fns.make_routing("skewed", [9, 1, 6, 0], 8, 3, gen)
        case = fns.Case(N, GPN, 8, 3, 2, 50, ids, refetch=refetch, shared=True)
        plan = fns.planner_plan(kind, case.topology(), fns.loads_of(ids, 8), gen)
        case = fns.with_plan(case, plan)
        results = pool.run(fns.run_case, case)
        fns.check_case(case, results)
        if kind in ("random-intra", "random-general", "eplb-oracle", "relibra"):
            assert any(res["fills"] for res in results), kind
        if kind == "relibra":  # its cross-node traffic replicas are executed exactly too
            assert evaluate(plan, fns.loads_of(ids, 8)).fill_cross_node_MLGJ.any()
        peak = max(res["replica_peak"] for res in results)
        assert (peak > 0) == any(res["fills"] for res in results)
        assert all(res["replica_live"] == 0 for res in results)  # freed after backward


def test_replay_that_disagrees_with_the_plan_degrades_to_the_one_process_result(pool):
    """Rank 1 replays other ids than the step was planned from: every rank runs that forward on
    the current placement without replicas; the result is the one-process result of the ids
    actually replayed, with one warning per rank and the micro-batch counted."""
    gen = torch.Generator().manual_seed(31)
    planned = fns.make_routing("skewed", [7, 5, 6, 4], 8, 2, gen)
    replayed = [ids.clone() for ids in planned]
    replayed[1] = (replayed[1] + 3) % 8
    case = fns.Case(N, GPN, 8, 2, 2, 60, replayed, shared=True)
    results = pool.run(fns.run_degraded, case, planned)
    fns.check_case(case, results)
    for res in results:
        assert res["degraded"] == [0], res["degraded"]
        assert len(res["warnings"]) == 1 and "EP ranks [1]" in res["warnings"][0]
        assert res["fills"] == []  # degraded: no replicas


def test_pad_ids_through_the_planners_and_the_layer(pool):
    """-1 pads (whole tokens and single slots) on every rank: counted nowhere, planned by every
    planner with replicas, executed exactly (one-process reference, pads skipped there too)."""
    gen = torch.Generator().manual_seed(41)
    for kind in ("static", "eplb-oracle", "relibra"):
        ids = fns.with_pads(fns.make_routing("skewed", [8, 3, 6, 5], 8, 3, gen), gen)
        case = fns.Case(N, GPN, 8, 3, 2, 70, ids, shared=True, route_norm=True)
        loads = fns.loads_of(ids, 8)
        assert int(loads.sum()) == sum(int((i >= 0).sum()) for i in ids)
        case = fns.with_plan(case, fns.planner_plan(kind, case.topology(), loads, gen))
        results = pool.run(fns.run_case, case)
        fns.check_case(case, results)
        assert sum(res["expert_tokens"] for res in results) == int(loads.sum())


def test_self_routing_and_one_node_flat_mesh(pool):
    gen = torch.Generator().manual_seed(0)
    ids = fns.make_routing("random", [5, 3, 0, 6], 8, 2, gen)
    # Own router, expert bias steering the choice, no plan: ids come from the scores.
    case = fns.Case(N, GPN, 8, 2, 1, 21, ids, expert_bias=True, shared=True, self_route=True,
                    placement_E=torch.randperm(8, generator=gen))
    results = pool.run(fns.run_case, case)
    fns.check_case(case, results)
    # A 1-D mesh is one node of 4 GPUs; relibra replicates across all of them.
    flat = fns.Case(1, 4, 8, 2, 2, 22, fns.make_routing("skewed", [6, 6, 2, 7], 8, 2, gen), flat_mesh=True)
    flat = fns.with_plan(flat, fns.planner_plan("relibra", flat.topology(), fns.loads_of(flat.ids_per_rank, 8), gen))
    results = pool.run(fns.run_case, flat)
    fns.check_case(flat, results)
    assert any(res["fills"] for res in results)


def test_two_layers_interleave_backward_collectives(pool):
    gen = torch.Generator().manual_seed(3)
    layers = []
    for l, (kind, refetch) in enumerate([("random-general", False), ("random-intra", True), ("relibra", False)]):
        ids = fns.make_routing("skewed", [7, 2, 5, 4], 8, 2, gen)
        case = fns.Case(N, GPN, 8, 2, 2, 100 + l, ids, refetch=refetch)
        layers.append(fns.with_plan(case, fns.planner_plan(kind, case.topology(), fns.loads_of(ids, 8), gen)))
    results = pool.run(fns.run_stack, layers)
    ref = fns.reference_stack(layers)
    start = 0
    for r, res in enumerate(results):
        T = layers[0].ids_per_rank[r].shape[0]
        fns.close(res["out"], ref["out"][start : start + T], f"rank {r} output")
        fns.close(res["x_grad"], ref["x_grad"][start : start + T], f"rank {r} input gradient")
        start += T
    for l in range(len(layers)):
        fns.close(sum(res["gate_grad"][l] for res in results), ref["gate_grad"][l], f"layer {l} router gradient")
        for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
            per_rank = [{"native": res["native"][l], n: res[n][l]} for res in results]
            fns.close(fns.assemble_logical(per_rank, n, 8), ref[n][l], f"layer {l} {n}")


@pytest.mark.parametrize("refetch", [False, True])
def test_replica_memory_peak_keep_vs_refetch(pool, refetch):
    """Kept replicas live until their layer's backward (peak = sum over layers, plus the
    gradient buffer of the layer in backward); re-fetched ones live only inside one layer's
    forward or backward (peak = max over layers)."""
    gen = torch.Generator().manual_seed(13)
    layers = []
    for l in range(3):
        ids = fns.make_routing("one", [8, 6, 7, 5], 8, 2, gen)
        case = fns.Case(N, GPN, 8, 2, 2, 200 + l, ids, refetch=refetch)
        layers.append(fns.with_plan(case, fns.planner_plan("random-intra", case.topology(),
                                                           fns.loads_of(ids, 8), gen)))
    per_fill = 3 * fns.DIM * fns.HIDDEN * 4  # w1, w2, w3 rows in fp32
    results = pool.run(fns.run_memory, layers)
    assert sum(sum(res["fills"]) for res in results) > 0
    for res in results:
        per_layer = [f * per_fill for f in res["fills"]]
        assert res["live"] == 0
        if refetch:
            assert res["after_forward"] == 0
            assert res["peak"] == max(per_layer)
        else:
            assert res["after_forward"] == sum(per_layer)
            # backward runs the last layer first; each layer's gradient buffer (fp32, the
            # weights' size) lives beside the weights of the layers not yet backwarded
            assert res["peak"] == max(sum(per_layer[: l + 1]) + per_layer[l] for l in range(len(per_layer)))


def test_counters_show_the_predicted_balance(pool):
    """Skewed replayed routing, relibra plan over 3 micro-batches: executed per-GPU expert
    tokens equal evaluate()'s prediction exactly, so max/mean does too."""
    gen = torch.Generator().manual_seed(7)
    E, K, M = 8, 2, 3
    ids_m = [fns.make_routing("skewed", [24, 10, 31, 17], E, K, gen) for _ in range(M)]
    loads = torch.cat([fns.loads_of(ids, E) for ids in ids_m])  # [M, 1, S, E]
    base = fns.Case(N, GPN, E, K, 2, 5, ids_m[0])
    planner = make_planner("relibra", base.topology())
    plan = planner.plan(loads)
    metrics = evaluate(plan, loads)
    case = dataclasses.replace(base, placement_E=plan.placement_LE[0])
    plans = [layer_plans(plan, loads, m)[0] for m in range(M)]
    results = pool.run(fns.run_balance, case, plans, ids_m)
    executed = torch.tensor([[res[m][0] for res in results] for m in range(M)])
    assert torch.equal(executed, torch.tensor([[res[m][1] for res in results] for m in range(M)]))
    assert torch.equal(executed, metrics.gpu_load_MLG[:, 0])
    imbalance = executed.max(1).values.double() / executed.double().mean(1)
    assert torch.equal(imbalance, metrics.imbalance_ML[:, 0])
    static = evaluate(fns.planner_plan("static", base.topology(), loads[:1], gen), loads[:1])
    assert metrics.imbalance_ML[0, 0] < static.imbalance_ML[0, 0]  # the skew was real


def test_training_with_reordering_matches_one_process(pool):
    """AdamW steps with the placement changed (weights + Adam state moved) between steps."""
    gen = torch.Generator().manual_seed(9)
    ids = fns.make_routing("random", [4, 6, 3, 5], 8, 2, gen)
    case = fns.Case(N, GPN, 8, 2, 0, 31, ids, shared=True)
    placements = [torch.randperm(8, generator=gen), torch.randperm(8, generator=gen), None]
    results = pool.run(fns.run_training, case, placements)
    ref = fns.reference_training(case, len(placements))
    for res in results:
        for k in ref:
            fns.close(res[k], ref[k], k)


def test_checkpoints_are_logical_across_placements_and_layouts(pool, tmp_path):
    gen = torch.Generator().manual_seed(4)
    ids = fns.make_routing("random", [3, 4, 5, 2], 8, 2, gen)
    case = fns.Case(N, GPN, 8, 2, 1, 41, ids, shared=True)
    pa, pb = torch.randperm(8, generator=gen), torch.randperm(8, generator=gen)
    path = str(tmp_path / "experts.safetensors")
    results = pool.run(fns.run_checkpoint, case, pa, pb, path)
    logical = fns.logical_state(case)
    for res in results:
        assert res["dtensor"] == "DTensor"
        for k, v in logical.items():
            assert np.array_equal(res["sd_a"][k], v.numpy()), k  # bit-exact, logical order
            assert np.array_equal(res["sd_b"][k], v.numpy()), k
        for k in ("w1_EFD", "w2_EDF", "w3_EFD"):
            assert np.array_equal(res["logical_c"][k], logical[k].numpy()), k
        assert np.array_equal(res["out_a"], res["out_b"])
    # The 2 x 2 checkpoint loads on one process (a different EP size) with the same function.
    one = fns.build(case, None)
    one.load_state_dict({k: torch.from_numpy(v) for k, v in results[0]["sd_a"].items()})
    ref = fns.reference(dataclasses.replace(case))
    xs, _ = fns.inputs(case)
    out = one(torch.cat(xs), torch.cat(ids)).detach().numpy()
    fns.close(out, ref["out"], "one-process output from the EP checkpoint")
    from relibra_torch.moe import load_expert_safetensors
    two = fns.build(case, None)
    two.apply_placement(torch.randperm(8, generator=gen))
    load_expert_safetensors(two, path)
    for k, v in two.logical_expert_weights().items():
        assert torch.equal(v, logical[k]), k


def test_bad_input_raises_on_every_rank(pool):
    results = pool.run(fns.run_errors, N, GPN)
    for r, msgs in enumerate(results):
        assert "not divisible by the EP mesh size 4" in msgs["divide"]
        assert "another topology" in msgs["topology"]
        assert "do not match the installed plan on EP ranks [1]" in msgs["mismatch"]
        assert "num_experts=8" in msgs["range"]
        assert msgs["after"] == (3, fns.DIM)


# ---- hierarchical dispatch (DeepEP normal mode; issue 20) ----

@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(case=cases())
def test_hierarchical_dispatch_matches_flat_and_one_process(pool, case):
    results = pool.run(fns.run_dispatch_modes, case)
    fns.check_dispatch_modes(case, results)


def check_rows_against_the_simulator(case, plan, loads, results, collectives):
    """The layer's hierarchical rows per GPU equal sim.dispatch.hierarchical_rows exactly;
    its flat rows equal evaluate()'s per-GPU pairs; collectives (forward, backward)."""
    from relibra_torch.sim.dispatch import hierarchical_rows
    want = hierarchical_rows(plan, loads, [[ids.unsqueeze(1) for ids in case.ids_per_rank]])
    metrics = evaluate(plan, loads)
    for r, res in enumerate(results):
        hier, flat = res["hierarchical"]["exchange"], res["flat"]["exchange"]
        for key, t in want.items():
            assert hier[key] == int(t[0, 0, r]), (r, key, hier, t[0, 0])
        assert (hier["collectives_forward"], hier["collectives_backward"]) == collectives
        assert flat["cross_node_rows"] == int(metrics.cross_send_MLG[0, 0, r])
        assert flat["intra_node_rows"] == int(metrics.intra_send_MLG[0, 0, r])
        assert (flat["collectives_forward"], flat["collectives_backward"]) == (2, 2)
    # a token crosses to a node at most once: never more rows than flat's pairs
    assert sum(res["hierarchical"]["exchange"]["cross_node_rows"] for res in results) <= \
        sum(res["flat"]["exchange"]["cross_node_rows"] for res in results)


def test_hierarchical_rows_equal_the_simulators_with_replicas_and_pads(pool):
    """Every plan source with R = 2 and -1 pads, cross-node replicas included: hierarchical
    equals flat and one process, and sends exactly the rows the simulator counts."""
    gen = torch.Generator().manual_seed(47)
    cross_fills = False
    for i, kind in enumerate(PLANS[1:]):
        ids = fns.with_pads(fns.make_routing("skewed", [9, 2, 7, 5], 8, 3, gen), gen)
        case = fns.Case(N, GPN, 8, 3, 2, 80 + i, ids, shared=i % 2 == 0, refetch=i % 3 == 1)
        loads = fns.loads_of(ids, 8)
        plan = fns.planner_plan(kind, case.topology(), loads, gen)
        case = fns.with_plan(case, plan)
        results = pool.run(fns.run_dispatch_modes, case)
        fns.check_dispatch_modes(case, results)
        check_rows_against_the_simulator(case, plan, loads, results, (5, 4))
        cross_fills |= bool(evaluate(plan, loads).fill_cross_node_MLGJ.any())
    assert cross_fills
    # One node (1-D mesh): no inter-node stage, only the (token, GPU) rows.
    ids = fns.with_pads(fns.make_routing("skewed", [6, 6, 2, 7], 8, 2, gen), gen)
    one = fns.Case(1, 4, 8, 2, 2, 90, ids, flat_mesh=True)
    plan = fns.planner_plan("relibra", one.topology(), fns.loads_of(ids, 8), gen)
    one = fns.with_plan(one, plan)
    results = pool.run(fns.run_dispatch_modes, one)
    fns.check_dispatch_modes(one, results)
    check_rows_against_the_simulator(one, plan, fns.loads_of(ids, 8), results, (3, 2))
