"""ReplayBalancedMoE on 8 gloo ranks as 2 nodes x 4 GPUs, against one process.

Same checks as test_moe_dist4 at the larger layout (fewer random cases: 8 processes share
2 cores). fp32 tolerance: max |error| <= 1e-5 x max |reference|. Budget: ~90 s, most of it
process start-up.
"""

import dataclasses

import pytest
import torch
from hypothesis import event, given, settings

import _moe_fns as fns
from relibra_torch.moe import layer_plans
from relibra_torch.planning import evaluate, make_planner
from relibra_torch.testing import RankPool
from test_moe_dist4 import PLANS, cases

pytestmark = pytest.mark.slow

N, GPN = 2, 4
G = N * GPN


@pytest.fixture(scope="module")
def pool():
    with RankPool(G, timeout_s=300, grace_s=5) as p:
        yield p


@settings(max_examples=14, deadline=None, derandomize=True, database=None)
@given(case=cases(num_nodes=N, gpus_per_node=GPN, max_tokens=6))
def test_numerics_match_one_process(pool, case):
    results = pool.run(fns.run_case, case)
    event(f"fills={any(res['fills'] for res in results)} refetch={case.refetch}")
    fns.check_case(case, results)


def test_every_planner_with_replicas(pool):
    gen = torch.Generator().manual_seed(8)
    for i, kind in enumerate(PLANS[1:]):
        ids = fns.make_routing("skewed", [7, 0, 3, 9, 2, 5, 1, 6], 16, 2, gen)
        case = fns.Case(N, GPN, 16, 2, 1 + i % 2, 60 + i, ids, refetch=bool(i % 2), shared=i % 3 == 0)
        case = fns.with_plan(case, fns.planner_plan(kind, case.topology(), fns.loads_of(ids, 16), gen))
        results = pool.run(fns.run_case, case)
        fns.check_case(case, results)
        if kind in ("random-intra", "random-general", "relibra"):
            assert any(res["fills"] for res in results), kind


def test_counters_show_the_predicted_balance(pool):
    gen = torch.Generator().manual_seed(17)
    E, K, M = 16, 2, 2
    ids_m = [fns.make_routing("skewed", [20, 9, 31, 12, 0, 25, 14, 18], E, K, gen) for _ in range(M)]
    loads = torch.cat([fns.loads_of(ids, E) for ids in ids_m])
    base = fns.Case(N, GPN, E, K, 2, 6, ids_m[0])
    plan = make_planner("relibra", base.topology()).plan(loads)
    metrics = evaluate(plan, loads)
    case = dataclasses.replace(base, placement_E=plan.placement_LE[0])
    results = pool.run(fns.run_balance, case, [layer_plans(plan, loads, m)[0] for m in range(M)], ids_m)
    executed = torch.tensor([[res[m][0] for res in results] for m in range(M)])
    assert torch.equal(executed, metrics.gpu_load_MLG[:, 0])
    assert torch.equal(executed.max(1).values.double() / executed.double().mean(1), metrics.imbalance_ML[:, 0])


def test_training_with_reordering_matches_one_process(pool):
    gen = torch.Generator().manual_seed(19)
    ids = fns.make_routing("random", [4, 2, 3, 5, 1, 0, 3, 2], 16, 2, gen)
    case = fns.Case(N, GPN, 16, 2, 0, 33, ids)
    placements = [torch.randperm(16, generator=gen), None]
    results = pool.run(fns.run_training, case, placements)
    ref = fns.reference_training(case, len(placements))
    for res in results:
        for k in ref:
            fns.close(res[k], ref[k], k)


def test_bad_input_raises_on_every_rank(pool):
    for msgs in pool.run(fns.run_errors, N, GPN):
        assert "not divisible by the EP mesh size 8" in msgs["divide"]
        assert "another topology" in msgs["topology"]
        assert "do not match the installed plan on EP ranks [1]" in msgs["mismatch"]


def test_checkpoint_of_one_layout_loads_on_another(pool):
    gen = torch.Generator().manual_seed(23)
    case = fns.Case(N, GPN, 16, 2, 1, 35, [])
    results = pool.run(fns.run_reshard, case, torch.randperm(16, generator=gen), torch.randperm(16, generator=gen))
    logical = fns.logical_state(case)
    for res in results:
        for k, v in res.items():
            assert torch.equal(torch.from_numpy(v), logical[k]), k


def test_hierarchical_dispatch_on_2x4(pool):
    """DeepEP-style dispatch at 2 x 4 with replicas (across nodes too) and pads: equal to flat
    and to one process, rows equal to the simulator's."""
    from test_moe_dist4 import check_rows_against_the_simulator
    gen = torch.Generator().manual_seed(29)
    for i, kind in enumerate(["random-general", "eplb-oracle", "relibra"]):
        ids = fns.with_pads(fns.make_routing("skewed", [7, 0, 3, 9, 2, 5, 1, 6], 16, 3, gen), gen)
        case = fns.Case(N, GPN, 16, 3, 2, 90 + i, ids, refetch=i == 1, shared=i == 2)
        loads = fns.loads_of(ids, 16)
        plan = fns.planner_plan(kind, case.topology(), loads, gen)
        case = fns.with_plan(case, plan)
        results = pool.run(fns.run_dispatch_modes, case)
        fns.check_dispatch_modes(case, results)
        check_rows_against_the_simulator(case, plan, loads, results, (5, 4))


def random_relays(tokens: list[int], gpus_per_node: int, gen: torch.Generator) -> torch.Tensor:
    """int64 ``[1, 1, G, g]``: every rank hands a random part of its tokens to random GPUs of
    its node (never itself), at most all of them."""
    G, g = len(tokens), gpus_per_node
    relay = torch.zeros(1, 1, G, g, dtype=torch.int64)
    for r, T in enumerate(tokens):
        k = int(torch.randint(0, T + 1, (1,), generator=gen))
        for _ in range(k):
            p = int(torch.randint(0, g, (1,), generator=gen))
            if p != r % g:
                relay[0, 0, r, p] += 1
    return relay


def test_relays_on_2x4(pool):
    """Relayed tokens (planning.relay) under hierarchical dispatch: outputs and every gradient
    equal to flat dispatch and to one process; rows per GPU, relayed rows and collectives
    equal to what the simulator counts (7 + 3 forward, 6 + 3 backward; the native path's
    count all-gather is not an exchange collective)."""
    from test_moe_dist4 import check_rows_against_the_simulator
    gen = torch.Generator().manual_seed(61)
    tokens = [7, 0, 3, 9, 2, 5, 1, 6]
    relayed = 0
    for i, kind in enumerate(["random-general", "relibra", "static"]):
        ids = fns.with_pads(fns.make_routing("skewed", tokens, 16, 3, gen), gen)
        case = fns.Case(N, GPN, 16, 3, 2, 120 + i, ids, refetch=i == 1, shared=i == 2,
                        native_install=kind == "static")  # the native path (NATIVE) relays too
        loads = fns.loads_of(ids, 16)
        plan = dataclasses.replace(fns.planner_plan(kind, case.topology(), loads, gen),
                                   relay_MLGg=random_relays(tokens, GPN, gen))
        case = fns.with_plan(case, plan)
        results = pool.run(fns.run_dispatch_modes, case)
        fns.check_dispatch_modes(case, results)
        check_rows_against_the_simulator(case, plan, loads, results, (7, 6))
        relayed += sum(res["hierarchical"]["exchange"]["relay_rows"] for res in results)
    assert relayed > 0
    # a plan that relays more tokens than a rank has (rank 1 has none): every rank degrades
    # together (the plan check's all-reduce), runs without relays, and stays exact
    ids = fns.make_routing("skewed", tokens, 16, 3, gen)
    case = fns.Case(N, GPN, 16, 3, 2, 130, ids)
    loads = fns.loads_of(ids, 16)
    bad = torch.zeros(1, 1, G, GPN, dtype=torch.int64)
    bad[0, 0, 1, 0] = 1
    plan = dataclasses.replace(fns.planner_plan("relibra", case.topology(), loads, gen), relay_MLGg=bad)
    case = fns.with_plan(case, plan)
    results = pool.run(fns.run_dispatch_modes, case)  # before the check: rank 1 raised alone, the others hung
    fns.check_dispatch_modes(case, results)
    assert all(res["hierarchical"]["exchange"]["relay_rows"] == 0 for res in results)
