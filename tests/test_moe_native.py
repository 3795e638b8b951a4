"""Native layers (``moe.native``, ``schedule_batch.native_layers``): a layer the plan keeps
without copies for the whole step runs the native path, and what it runs must be what the
plan says.

* Mixed plans (layers native in every micro-batch, layers with copies in some micro-batches
  only, layers with copies throughout; zero counts; one GPU, ``R = 0``, several nodes):
  ``native_layers`` marks exactly the layers without a copy, the schedule the native path
  builds at run time equals the one-pair path's field for field, and the token splits in
  chunks of any size equal one ``token_split`` call per micro-batch.
* ``NativeSchedules`` keeps no stale template (placements replaced, mutated in place).
* A layer with ``check_plan=False`` exchanges no counts at run time, so its native plans
  are scheduled (by ``plan_step``, or at install); ``NATIVE`` never runs a run-time
  planner's plan and is refused for another placement, as any plan is.

Budget: ~5 s.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _moe_fns as fns
import _step_fns as sf
import relibra_torch.moe.schedule_batch as batch_mod
from relibra_torch.moe.native import NATIVE, NativeSchedules
from relibra_torch.moe.schedule import build_rank_schedule, check_layer_plan, layer_plans, native_layer_plan
from relibra_torch.moe.schedule_batch import native_layers, rank_schedules, share_splits, step_splits
from relibra_torch.planning import Topology, static_plan, token_split, validate_plan
from test_schedule_batch import _fields_differ, pair_differs

TOPOLOGIES = [(1, 1, 3, 0), (1, 1, 4, 2), (1, 3, 6, 0), (2, 2, 8, 0), (2, 2, 8, 2), (3, 2, 12, 1)]


def strip_copies(plan, loads, rows_ML: torch.Tensor):
    """``plan`` with the replica slots of the (micro-batch, layer) rows ``rows_ML`` emptied
    (their native slots then take the experts' whole loads)."""
    El = plan.topology.experts_per_gpu
    se, st_ = plan.slot_expert_MLGJ.clone(), plan.slot_tokens_MLGJ.clone()
    load_MLE = loads.sum(2)
    for m, l in rows_ML.nonzero().tolist():
        se[m, l, :, El:], st_[m, l, :, El:] = -1, 0
        st_[m, l, :, :El] = load_MLE[m, l][se[m, l, :, :El]]
    return dataclasses.replace(plan, slot_expert_MLGJ=se, slot_tokens_MLGJ=st_)


def mixed_plan(topo: Topology, M: int, L: int, seed: int):
    """``(plan, loads)``: random copies (persistent, refilled, tokenless) with every layer
    made native in all, some or none of its micro-batches."""
    gen = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, 6, (M, L, topo.num_gpus, topo.num_experts), generator=gen)
    loads *= torch.rand(loads.shape, generator=gen) > 0.3
    plan = sf.random_step_plan(topo, loads, gen)
    mode_L = torch.randint(0, 3, (L,), generator=gen)   # 0: native, 1: copies in some micro-batches
    rows = (mode_L == 0) | ((mode_L == 1) & (torch.rand(M, L, generator=gen) > 0.5))
    plan = strip_copies(plan, loads, rows.expand(M, L))
    validate_plan(plan, loads)
    return plan, loads


@settings(max_examples=25, deadline=None, derandomize=True)
@given(shape=st.sampled_from(TOPOLOGIES), M=st.integers(1, 4), L=st.integers(1, 3), seed=st.integers(0, 10_000),
       rows=st.sampled_from([1, 2, 5, 32]))
def test_native_layers_run_what_the_plan_says(shape, M, L, seed, rows):
    topo = Topology(*shape)
    plan, loads = mixed_plan(topo, M, L, seed)
    El = topo.experts_per_gpu
    copies_L = (plan.slot_expert_MLGJ[..., El:] >= 0).flatten(2).any(-1).any(0)
    native_L = native_layers(plan, loads)
    assert torch.equal(native_L, ~copies_L)
    per_mb = torch.cat([token_split(plan.micro_batch(m), loads[m:m + 1]) for m in range(M)])
    old_rows = batch_mod.SPLIT_ROWS
    try:
        batch_mod.SPLIT_ROWS = rows
        assert torch.equal(step_splits(plan, loads), per_mb)
    finally:
        batch_mod.SPLIT_ROWS = old_rows
    # the shares' masks and splits joined (as the hook gathers them) are the whole step's
    shares = [plan.layers(torch.arange(k, L, 2)) for k in range(2)]
    joined = [share_splits(part, loads[:, k::2]) for k, part in enumerate(shares)]
    assert torch.equal(torch.stack([joined[l % 2][1][l // 2] for l in range(L)]), native_L)
    for rank in range(topo.num_gpus):
        got = rank_schedules(plan, loads, rank)
        told = rank_schedules(plan, loads, rank, native_L=native_L)   # told the mask: the same pairs
        forced = rank_schedules(plan, loads, rank, scheduled_L=torch.ones(L, dtype=torch.bool))
        for m in range(M):
            for l, ref_lp in enumerate(layer_plans(plan, loads, m)):
                ref_lp = check_layer_plan(ref_lp, topo, plan.placement_LE[l])
                ref = build_rank_schedule(topo, plan.placement_LE[l], ref_lp, rank).to("cpu")
                lp, sched = got[m][l]
                assert (sched is NATIVE) == bool(native_L[l]) == (told[m][l][1] is NATIVE)
                assert not pair_differs(lp, sched, ref_lp, ref, loads[m, l]), (m, l, rank)
                assert not pair_differs(*told[m][l], ref_lp, ref, loads[m, l]), (m, l, rank)
                assert forced[m][l][1] is not NATIVE          # scheduled where asked
                assert not pair_differs(*forced[m][l], ref_lp, ref, loads[m, l]), (m, l, rank)


def test_the_template_follows_the_placement():
    """One ``NativeSchedules`` over placements replaced, copied and mutated in place (the
    cache compares values, not the tensor object) gives the reference every time."""
    topo = Topology(2, 2, 8, 2)
    gen = torch.Generator().manual_seed(0)
    for rank in range(topo.num_gpus):
        natives, place = NativeSchedules(topo, rank), torch.randperm(8, generator=gen)
        for i in range(12):
            if i % 3 == 0:
                place.copy_(torch.randperm(8, generator=gen))   # same object, new values
            elif i % 3 == 1:
                place = place.flip(0)
            counts = torch.randint(0, 5, (4, 8), generator=gen) * (torch.rand(4, 8, generator=gen) > 0.3)
            ref = build_rank_schedule(topo, place, native_layer_plan(topo, place, counts), rank)
            assert not _fields_differ(natives.schedule(place, counts), ref, ("device",)), (rank, i)


def test_a_plan_of_another_dtype_is_named_not_crashed_on():
    """Every layer native skips ``validate_plan``; a plan with int32 tensors must still get
    its message (not a scatter error, nor be accepted)."""
    topo = Topology(1, 2, 4, 1)
    loads = torch.randint(1, 5, (2, 2, 2, 4), generator=torch.Generator().manual_seed(1))
    plan = static_plan(loads, topo)
    assert native_layers(plan, loads).all()
    for name in ("placement_LE", "slot_expert_MLGJ", "slot_tokens_MLGJ"):
        bad = dataclasses.replace(plan, **{name: getattr(plan, name).to(torch.int32)})
        with pytest.raises(ValueError, match=f"{name} has dtype torch.int32"):
            rank_schedules(bad, loads, 0)


def _native_module(check_plan: bool):
    case = fns.Case(1, 1, 8, 2, 2, 5, ids_per_rank=[], module_kwargs={"check_plan": check_plan})
    m = fns.build(case, None)
    m.load_state_dict(fns.logical_state(case))
    m.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(3)))
    ids = torch.randint(0, 8, (6, 2), generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(ids.reshape(-1), minlength=8).view(1, 8)
    plan = dataclasses.replace(native_layer_plan(m.topology, m.placement_cpu, counts), micro_batch=1)
    return m, ids, plan


def test_native_plans_without_check_plan_are_scheduled(monkeypatch):
    """``check_plan=False``: no count exchange at run time (no host sync, no collective the
    cost model's ``check_plan=False`` counts leave out), so ``NATIVE`` is scheduled at install
    and ``plan_step`` builds those layers' schedules ahead; the result is unchanged."""
    import relibra_torch.moe.engine as engine_mod
    from relibra_torch.hook import ReplayBalancer

    m, ids, plan = _native_module(check_plan=False)
    x = torch.randn(6, fns.DIM)
    local = m(x, ids).detach()

    def no_gather(*a, **k):
        raise AssertionError("a layer with check_plan=False gathered counts")

    monkeypatch.setattr(engine_mod, "gather_counts", no_gather)
    m.set_plan(plan, NATIVE)
    assert m.engine._schedule is not None and m.plan.micro_batch == 1
    fns.close(m(x, ids).detach().numpy(), local.numpy(), "scheduled native output")
    balancer = ReplayBalancer([m], planner="static")
    balancer.plan_step([ids.view(6, 1, 2)])
    assert balancer._schedules[0][0][1] is not NATIVE
    balancer.install(0)
    fns.close(m(x, ids).detach().numpy(), local.numpy(), "planned output")
    m.check_plan = True
    balancer.plan_step([ids.view(6, 1, 2)])
    assert balancer._schedules[0][0][1] is NATIVE


def test_native_is_the_plan_not_a_run_time_planner_nor_another_placement():
    """A run-time planner (inference) plans forwards without a plan, not an installed native
    plan; a native plan of another placement is refused like any plan."""
    m, ids, plan = _native_module(check_plan=True)
    calls = []
    m.engine.runtime_planner = lambda counts_SE: calls.append(1) or native_layer_plan(
        m.topology, m.placement_cpu, counts_SE)
    m.set_plan(plan, NATIVE)
    m(torch.randn(6, fns.DIM), ids)
    assert not calls and m.engine.degraded_forwards == 0
    m.engine.runtime_planner = None
    m.apply_placement(m.placement_cpu.flip(0))
    with pytest.raises(ValueError, match="apply_placement"):
        m.set_plan(plan, NATIVE)
