"""Replicas kept over a step, on 4 gloo ranks (2 nodes x 2 GPUs) against one process.

Steps of a two-layer residual stack with several micro-batches each: residencies spanning
micro-batches (filled once, gradient accumulated on the replica's GPU and sent home in the
backward of its last micro-batch with tokens), slots refilled with another expert mid-step,
tokenless replica micro-batches, migration at the step boundary (and a slot holding the
same expert across the boundary, which must be refilled with the updated weights), the
compiled layer (aot_eager), re-fetched replicas. Outputs, input gradients, each step's
accumulated weight gradients and the weights after SGD all match the one-process run at
fp32 1e-5 (``_moe_fns.close``). Misuse raises on every rank. Budget: ~40 s.
"""

import pytest
import torch

import _moe_fns as fns
import _step_fns as sf
from relibra_torch.planning import Topology, evaluate, make_planner, validate_plan
from relibra_torch.testing import RankPool

pytestmark = pytest.mark.slow

N, GPN, E, K, R, M, L = 2, 2, 8, 2, 2, 4, 2


@pytest.fixture(scope="module")
def pool():
    with RankPool(N * GPN, timeout_s=240, grace_s=5) as p:
        yield p


def _case(seed: int, refetch: bool = False, compile: bool = False) -> sf.StepCase:
    gen = torch.Generator().manual_seed(seed)
    topo = Topology(N, GPN, E, R)
    ids = [sf.random_routing(N * GPN, M, L, E, K, gen) for _ in range(2)]
    case = sf.StepCase(N, GPN, E, K, R, seed, [], ids, refetch=refetch, compile=compile)
    # step 0: random plan with persistent, refilled and tokenless replicas (any GPU)
    plan0 = sf.random_step_plan(topo, case.loads(0), gen)
    # step 1: layer 0 keeps its placement and starts with the slot contents step 0 ended
    # with (a residency across the boundary must be refilled: the weights changed);
    # layer 1 moves to relibra's placement (migration) with relibra's replicas
    loads1 = case.loads(1)
    rel = make_planner("relibra", topo).plan(loads1)
    placement = torch.stack([plan0.placement_LE[0], rel.placement_LE[1]])
    plan1 = sf.random_step_plan(topo, loads1, gen, placement_LE=placement,
                                start={0: plan0.slot_expert_MLGJ[-1, 0]})
    plan1.slot_expert_MLGJ[:, 1] = rel.slot_expert_MLGJ[:, 1]
    plan1.slot_tokens_MLGJ[:, 1] = rel.slot_tokens_MLGJ[:, 1]
    case.plans = [plan0, plan1]
    return case


def _check(case, results):
    ref = sf.reference_steps(case)
    for r, res in enumerate(results):
        for i, ((out, xg), (rout, rxg)) in enumerate(zip(res["outs"], ref["outs"])):
            step, mb = divmod(i, M)
            T = case.ids[step][mb][r].shape[0]
            start = sum(case.ids[step][mb][q].shape[0] for q in range(r))
            fns.close(out, rout[start:start + T], f"rank {r} step {step} mb {mb} output")
            fns.close(xg, rxg[start:start + T], f"rank {r} step {step} mb {mb} input grad")
    res = results[0]
    for step, (got, want) in enumerate(zip(res["grads"], ref["grads"])):
        for l in range(L):
            for name in (*sf.PARAMS, "gate"):
                fns.close(got[l][name], want[l][name], f"step {step} layer {l} {name} grad")
    for l in range(L):
        for name in sf.PARAMS:
            fns.close(res["final"][l][name], ref["final"][l][name], f"layer {l} {name} after SGD")
    assert all(res["live"] == 0 for res in results)  # every buffer freed at the end


def test_plan_has_the_residency_patterns():
    """The generated plans really contain what the numerics test claims to cover."""
    case = _case(3)
    res0 = evaluate(case.plans[0], case.loads(0)).residency
    spans = (res0.held_MLGJ.sum(0) >= 2) & (res0.fill_start_MLGJ.sum(0) == 1)
    assert spans.any()                                     # a residency over >= 2 micro-batches
    changed = res0.fill_MLGJ[1:] & res0.fill_MLGJ[:-1] & (
        case.plans[0].slot_expert_MLGJ[1:] != case.plans[0].slot_expert_MLGJ[:-1])
    assert changed.any()                                   # a slot refilled with another expert
    assert (res0.fill_MLGJ & ~res0.active_MLGJ).any()      # a replica micro-batch without tokens
    assert res0.cross_node_MLGJ.any()
    assert not torch.equal(case.plans[1].placement_LE[1], case.plans[0].placement_LE[1])  # migration
    across = (case.plans[0].slot_expert_MLGJ[-1, 0] == case.plans[1].slot_expert_MLGJ[0, 0]) & \
        res0.fill_MLGJ[-1, 0] & evaluate(case.plans[1], case.loads(1)).fill_start_MLGJ[0, 0]
    assert across.any()                                    # same expert across the boundary: refilled


@pytest.mark.parametrize("refetch", [False, True])
def test_steps_match_one_process(pool, refetch):
    case = _case(3, refetch=refetch)
    _check(case, pool.run(sf.run_steps, case))


def test_native_layers_next_to_kept_replicas_match_one_process(pool):
    """Schedules built ahead (``rank_schedules``), as the hook installs them: step 0's layer 0
    and step 1's layer 1 (after migration) are native for the whole step (``NATIVE``: the
    native path, counts exchanged at run time) while the other layer keeps replicas over
    micro-batches, and layer 1's step-0 residencies end at step 1's native install. As one
    process, fp32 1e-5, every buffer freed."""
    from relibra_torch.moe.schedule_batch import native_layers
    from test_moe_native import strip_copies

    case = _case(3)
    case.batched = True
    for step, l in ((0, 0), (1, 1)):
        loads, rows = case.loads(step), torch.zeros(M, L, dtype=torch.bool)
        rows[:, l] = True
        case.plans[step] = strip_copies(case.plans[step], loads, rows)
        assert native_layers(case.plans[step], loads).tolist() == [l == 0, l == 1]
    res0 = evaluate(case.plans[0], case.loads(0)).residency
    assert ((res0.held_MLGJ.sum(0) >= 2) & (res0.fill_start_MLGJ.sum(0) == 1))[1].any()
    assert not torch.equal(case.plans[1].placement_LE[1], case.plans[0].placement_LE[1])
    _check(case, pool.run(sf.run_steps, case))


def test_compiled_steps_match_one_process(pool):
    case = _case(5, compile=True)
    _check(case, pool.run(sf.run_steps, case))


def _force_copies(plan, loads, l: int, owner_gpu: int, spans: dict) -> None:
    """Copy ``owner_gpu``'s first native expert of layer ``l`` into the last slot of the GPUs
    in ``spans`` (``{gpu: (first, last micro-batch)}``), one token each, after removing
    its other copies; whatever those slots held goes back to its owner."""
    topo = plan.topology
    El, J = topo.experts_per_gpu, topo.slots_per_gpu
    se, st = plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ
    e = int(plan.native_experts_LGl()[l, owner_gpu, 0])

    def give_home(m, gpu, j):
        x = int(se[m, l, gpu, j])
        if x >= 0 and j >= El:
            og, oj = (se[m, l, :, :El] == x).nonzero()[0].tolist()
            st[m, l, og, oj] += st[m, l, gpu, j]
            se[m, l, gpu, j], st[m, l, gpu, j] = -1, 0

    for m in range(plan.num_micro_batches):
        for gpu, j in (se[m, l, :, El:] == e).nonzero().tolist():
            give_home(m, gpu, El + j)
        for gpu, (a, b) in spans.items():
            if a <= m <= b:
                give_home(m, gpu, J - 1)
                assert st[m, l, owner_gpu, 0] >= 1, "pick a seed whose expert has tokens"
                se[m, l, gpu, J - 1], st[m, l, gpu, J - 1] = e, 1
                st[m, l, owner_gpu, 0] -= 1
    validate_plan(plan, loads)


def test_two_hop_steps_match_one_process(pool):
    """Two-hop groups (planning.two_hop): layer 0's node-1 copies of GPU 0's expert, one over
    the whole step (the hub) and one over micro-batches 1-2 (filled from the hub after it,
    reducing into it before the hub's return); layer 1's node-0 copies of GPU 3's expert
    over the same span (first and second hop in one forward, reduce then return in one
    backward). Outputs, input and weight gradients at the owners, weights after SGD: as one
    process, fp32 1e-5."""
    case = _case(8)   # a seed whose two experts have tokens in every micro-batch
    loads = case.loads(0)
    plan = case.plans[0]
    _force_copies(plan, loads, 0, 0, {2: (0, M - 1), 3: (1, 2)})
    _force_copies(plan, loads, 1, 3, {0: (0, M - 1), 1: (0, M - 1)})
    J = plan.topology.slots_per_gpu
    hub = evaluate(plan, loads).residency.hub_MLGJ
    assert hub[1:3, 0, 3, J - 1].tolist() == [2 * J + J - 1] * 2 and (hub[:, 0, 2] == -1).all()
    assert hub[:, 1, 1, J - 1].tolist() == [J - 1] * M and (hub[:, 1, 0] == -1).all()
    _check(case, pool.run(sf.run_steps, case))


def test_forward_only_and_misuse(pool):
    case = _case(3)
    res0 = evaluate(case.plans[0], case.loads(0)).residency
    # the first micro-batch after whose backward some residency still owes its gradient
    owing = res0.held_MLGJ & ~res0.grad_return_MLGJ
    cut = int(owing.flatten(1).any(1).nonzero()[0, 0])
    results = pool.run(sf.run_misuse, case, cut)
    ref = sf.reference_steps(case)
    for r, res in enumerate(results):
        for mb, out in enumerate(res["eval_outs"]):
            T = case.ids[0][mb][r].shape[0]
            start = sum(case.ids[0][mb][q].shape[0] for q in range(r))
            # no_grad outputs equal the training run's (same weights before the first SGD step)
            fns.close(out, ref["outs"][mb][0][start:start + T], f"rank {r} mb {mb} eval output")
        assert res["eval_live"] == 0 and res["eval_held"] == 0
        assert "never sent to their owners" in res["cut_short"], res["cut_short"]
        assert "forward order" in res["one_backward"], res["one_backward"]
