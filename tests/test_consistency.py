"""The layer sends what the cost model prices: one test of both public interfaces.

Plans from static, eplb-oracle and relibra (with cross-node traffic replicas and replica
residencies over several micro-batches, and two-hop groups: more copies of a remote expert
on a node filled from its first copy, ``planning.two_hop``) and a random plan (tokenless replica micro-batches,
mid-step refills, migration from a previous placement) run through

* the layer: ``relibra_torch.testing.run_plan_transfers`` (real ``ReplayBalancedMoE`` layers
  and ``ReplayBalancer`` on 4 gloo ranks, 2 nodes x 2 GPUs, forward + backward of every
  micro-batch), and
* the simulator: ``relibra_torch.sim.transfer_counts`` / ``hook_step_collectives`` (the
  numbers the cost model prices: ``CostModel.replica_counts`` is the same
  ``replica_traffic``),

with kept and with re-fetched replicas, in flat and in hierarchical dispatch; every count (token rows across / inside nodes, fill
bytes, gradient-return bytes, collectives per micro-batch, layer and GPU; the hook's
collectives per step) must be equal. Any change to either side must keep this green.
Budget: one 4-rank pool, 8 runs, ~60 s on 2 busy cores.
"""

import pytest
import torch

import _step_fns as sf
from relibra_torch.moe.counters import COUNT_KEYS as LAYER_KEYS
from relibra_torch.planning import ReLibraConfig, Topology, evaluate, make_planner, static_plan
from relibra_torch.sim import CostModel, CostOptions, get_hardware, get_model, hook_step_collectives, transfer_counts
from relibra_torch.sim.transfers import COUNT_KEYS
from relibra_torch.testing import RankPool, routing_from_loads, run_plan_transfers

pytestmark = pytest.mark.slow

N, GPN, E, R, M, L, K = 2, 2, 8, 2, 3, 2, 2
DIM, HIDDEN = 16, 8
TOPO = Topology(N, GPN, E, R)
# Cheap fills, so that the small test loads make relibra replicate (across nodes too).
CHEAP = ReLibraConfig(compute_s_per_token=4.8e-8, cross_node_s_per_token=3.6e-7,
                      replica_fill_s_per_expert=1e-7, cross_replica_fill_s_per_expert=1e-6)


def _loads() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    loads = torch.randint(0, 4, (M, L, N * GPN, E), generator=gen)
    loads[:, :, 2:, 0] += 30   # node 1 wants node 0's expert 0 in every micro-batch
    loads[:, 1, :2, 6] += 25   # layer 1: node 0 wants node 1's expert 6
    loads[1, 0, 2:, 1] += 20   # a hot expert in one micro-batch only
    return loads


def _plans(loads):
    relibra = make_planner("relibra", TOPO, config=CHEAP).plan(loads)
    rand = sf.random_step_plan(TOPO, loads, torch.Generator().manual_seed(5))
    rand.previous_placement_LE = TOPO.static_placement(L)
    return {"static": static_plan(loads, TOPO), "eplb-oracle": make_planner("eplb-oracle", TOPO).plan(loads),
            "relibra": relibra, "random": rand}


@pytest.fixture(scope="module")
def pool():
    with RankPool(N * GPN, timeout_s=240, grace_s=5) as p:
        yield p


def test_the_plans_have_what_the_claims_rest_on():
    loads = _loads()
    plans = _plans(loads)
    for name in ("eplb-oracle", "relibra", "random"):
        res = evaluate(plans[name], loads).residency
        assert res.cross_node_MLGJ.any(), name                     # cross-node fills
    res = evaluate(plans["relibra"], loads).residency
    assert ((res.active_MLGJ.sum(0) >= 2) & (res.fill_start_MLGJ.sum(0) == 1)).any()  # kept over micro-batches
    assert (plans["relibra"].slot_expert_MLGJ[:, :, :, TOPO.experts_per_gpu:] >= 0).any()  # traffic replicas
    # two-hop groups (planning.two_hop): second hops filled with their hub and after it,
    # reducing into a hub that returns in the same micro-batch
    hub = res.hub_MLGJ
    assert ((hub >= 0) & res.fill_start_MLGJ).any() and ((hub >= 0) & res.grad_return_MLGJ).any()
    for name in ("eplb-oracle", "relibra"):
        assert (evaluate(plans[name], loads).residency.hub_MLGJ >= 0).any(), name
    res = evaluate(plans["random"], loads).residency
    assert (res.fill_MLGJ & ~res.active_MLGJ).any()               # replica micro-batches without tokens
    assert not torch.equal(plans["random"].placement_LE, plans["random"].previous_placement_LE)  # migration


@pytest.mark.parametrize("refetch", [False, True], ids=["kept", "refetch"])
def test_layer_counts_equal_the_cost_models(pool, refetch):
    assert LAYER_KEYS == COUNT_KEYS
    loads = _loads()
    for name, plan in _plans(loads).items():
        layer = run_plan_transfers(pool, plan, loads, refetch=refetch, top_k=K, dim=DIM, hidden=HIDDEN)
        sim = transfer_counts(plan, loads, refetch=refetch, expert_params=3 * DIM * HIDDEN,
                              param_bytes=4, grad_bytes=4)  # fp32 test layers
        for key in COUNT_KEYS:
            assert torch.equal(layer[key], sim[key]), (name, key, layer[key].tolist(), sim[key].tolist())
        assert torch.equal(layer["step_collectives"], hook_step_collectives(plan)), name
        if name == "relibra" and not refetch:
            # the counts can tell kept from per-micro-batch replicas on this plan
            per_mb = transfer_counts(plan, loads, refetch=True, expert_params=3 * DIM * HIDDEN, param_bytes=4)
            assert not torch.equal(layer["fill_bytes_cross"], per_mb["fill_bytes_cross"] // 2)


def test_the_cost_model_prices_these_counts():
    """``CostModel.replica_counts`` is the simulator side's replica schedule: its fetched and
    returned copies times the expert bytes are ``transfer_counts``' bytes."""
    loads = _loads()
    plan = _plans(loads)["relibra"]
    model = get_model("qwen3-30b-a3b")
    for refetch in (False, True):
        cost = CostModel(model, get_hardware("h200"), CostOptions(refetch_replicas=refetch))
        metrics = evaluate(plan, loads)
        counts = cost.replica_counts(plan, metrics)
        sim = transfer_counts(plan, loads, refetch=refetch, expert_params=model.expert_params(), metrics=metrics)
        hop2 = {"fetch": counts["fetch2_recv"], "return": counts["return2_send"]}
        for link in ("cross", "intra"):
            extra = {k: v if link == "intra" else 0 for k, v in hop2.items()}   # second hops: NVLink
            assert torch.equal((counts[f"fetch_recv_{link}"] + extra["fetch"]) * cost.expert_weight_bytes,
                               sim[f"fill_bytes_{link}"])
            assert torch.equal((counts[f"return_send_{link}"] + extra["return"]) * cost.expert_grad_bytes,
                               sim[f"grad_return_bytes_{link}"])
        assert torch.equal(metrics.cross_send_MLG, sim["cross_node_rows"])


@pytest.mark.parametrize("refetch", [False, True], ids=["kept", "refetch"])
def test_hierarchical_layer_counts_equal_the_cost_models(pool, refetch):
    """DeepEP-style dispatch, with the per-token routing the layer runs: its rows (one per
    (token, remote node), then per (token, destination GPU)) depend on which experts each
    token shares, so the simulator side counts them from the same ids."""
    loads = _loads()
    routed = routing_from_loads(loads, K)
    plans = _plans(loads)
    for name in (("static", "eplb-oracle", "relibra", "random") if not refetch else ("relibra",)):
        plan = plans[name]
        layer = run_plan_transfers(pool, plan, loads, routed, dispatch="hierarchical", refetch=refetch, top_k=K,
                                   dim=DIM, hidden=HIDDEN)
        sim = transfer_counts(plan, loads, routed, dispatch="hierarchical", refetch=refetch,
                              expert_params=3 * DIM * HIDDEN, param_bytes=4, grad_bytes=4)
        for key in COUNT_KEYS:
            assert torch.equal(layer[key], sim[key]), (name, key, layer[key].tolist(), sim[key].tolist())
        flat = transfer_counts(plan, loads, refetch=refetch, expert_params=3 * DIM * HIDDEN, param_bytes=4)
        assert (sim["cross_node_rows"] <= flat["cross_node_rows"]).all()  # a token crosses to a node once
    with pytest.raises(ValueError, match="needs routed_ids"):
        transfer_counts(plans["static"], loads, dispatch="hierarchical", expert_params=3 * DIM * HIDDEN)


@pytest.mark.parametrize("dispatch,check_plan", [("flat", False), ("hierarchical", True), ("hierarchical", False)])
def test_native_and_scheduled_layers_in_one_step(pool, dispatch, check_plan):
    """A step whose layer 0 the plan keeps native (``NATIVE``: counts exchanged at run time
    with ``check_plan``, scheduled ahead without) and whose layer 1 keeps replicas over
    micro-batches: the layer's counts, with and without ``check_plan``, are the cost
    model's (one collective per layer for the check or the count exchange, none without)."""
    from relibra_torch.moe.schedule_batch import native_layers
    from relibra_torch.planning import StepPlan

    loads = _loads()
    routed = routing_from_loads(loads, K)
    plans = _plans(loads)
    sta, rel = plans["static"], plans["relibra"]
    mixed = StepPlan(TOPO, torch.stack([sta.placement_LE[0], rel.placement_LE[1]]),
                     torch.stack([sta.slot_expert_MLGJ[:, 0], rel.slot_expert_MLGJ[:, 1]], 1),
                     torch.stack([sta.slot_tokens_MLGJ[:, 0], rel.slot_tokens_MLGJ[:, 1]], 1), "mixed")
    assert native_layers(mixed, loads).tolist() == [True, False]
    assert (evaluate(mixed, loads).residency.active_MLGJ[:, 1].sum(0) >= 2).any()   # kept over micro-batches
    layer = run_plan_transfers(pool, mixed, loads, routed, dispatch=dispatch, top_k=K, dim=DIM, hidden=HIDDEN,
                               check_plan=check_plan)
    sim = transfer_counts(mixed, loads, routed, dispatch=dispatch, check_plan=check_plan,
                          expert_params=3 * DIM * HIDDEN, param_bytes=4, grad_bytes=4)
    for key in COUNT_KEYS:
        assert torch.equal(layer[key], sim[key]), (key, layer[key].tolist(), sim[key].tolist())
    assert torch.equal(layer["step_collectives"], hook_step_collectives(mixed))
