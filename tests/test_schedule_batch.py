"""The step's schedules built at once (``moe.schedule_batch.rank_schedules``) equal the
one-pair path the layer used to run before every forward (``layer_plans``, then
``check_layer_plan`` and ``build_rank_schedule``), field for field, on plans with copies,
two-hop hubs and residencies over several micro-batches. A native layer (every expert on its
owner for the whole step) gets ``NATIVE`` instead: the schedule its native path builds at
run time (``moe.native.NativeSchedules``) must then equal the one-pair path's. Budget: ~10 s."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.moe.native import NATIVE, NativeSchedules
from relibra_torch.moe.schedule import LayerPlan, RankSchedule, build_rank_schedule, check_layer_plan, layer_plans
from relibra_torch.moe.schedule_batch import native_layers, rank_schedules, share_splits
from relibra_torch.planning import Topology, make_planner, static_plan

TOPOLOGIES = [(1, 2, 4, 1), (1, 4, 8, 2), (2, 2, 8, 2), (2, 2, 4, 1), (2, 4, 8, 3), (3, 2, 12, 2), (1, 1, 3, 0)]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and torch.equal(a, b))
    if isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _fields_differ(a, b, skip=()) -> list[str]:
    return [f.name for f in dataclasses.fields(a)
            if f.name not in skip and not _equal(getattr(a, f.name), getattr(b, f.name))]


def pair_differs(lp, sched, ref_lp, ref, loads_SE: torch.Tensor) -> list[str]:
    """The fields in which a ``rank_schedules`` pair differs from the one-pair path's
    ``(ref_lp, ref)`` (``loads_SE``: the pair's counts). A ``NATIVE`` pair is compared with
    the schedule the layer's native path builds from those counts at run time; its layer
    plan must hold no copy."""
    assert isinstance(lp, LayerPlan)
    out = _fields_differ(lp, ref_lp)
    if sched is not NATIVE:
        assert isinstance(sched, RankSchedule)
        return out + _fields_differ(sched, ref)
    out += ["a replica slot"] if (ref_lp.slot_expert_GJ[:, ref_lp.topology.experts_per_gpu:] >= 0).any() else []
    native = NativeSchedules(ref_lp.topology, ref.rank).schedule(ref_lp.placement_E, loads_SE)
    return out + _fields_differ(native, ref, ("micro_batch", "device"))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(shape=st.sampled_from(TOPOLOGIES), M=st.integers(1, 4), L=st.integers(1, 3), seed=st.integers(0, 10_000),
       kind=st.sampled_from(["relibra", "eplb-oracle", "static"]), hot=st.integers(0, 60))
def test_batched_schedules_equal_the_one_pair_path(shape, M, L, seed, kind, hot):
    N, g, E, R = shape
    topo = Topology(N, g, E, R)
    gen = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, 12, (M, L, topo.num_gpus, E), generator=gen)
    loads[..., int(torch.randint(0, E, (1,), generator=gen))] += hot   # a hot expert: copies pay
    # some experts idle in some micro-batches: step-long copies then hold slots without tokens
    loads *= torch.rand(M, 1, 1, E, generator=gen) > 0.3
    plan = static_plan(loads, topo) if kind == "static" else make_planner(kind, topo).plan(loads)
    native_L = native_layers(plan, loads)
    for rank in range(topo.num_gpus):
        got = rank_schedules(plan, loads, rank)
        assert len(got) == M and all(len(row) == L for row in got)
        for m in range(M):
            for l, ref_lp in enumerate(layer_plans(plan, loads, m)):
                lp, sched = got[m][l]
                assert (sched is NATIVE) == bool(native_L[l])
                ref_lp = check_layer_plan(ref_lp, topo, plan.placement_LE[l])
                ref = build_rank_schedule(topo, plan.placement_LE[l], ref_lp, rank).to("cpu")
                differ = pair_differs(lp, sched, ref_lp, ref, loads[m, l])
                assert not differ, (m, l, rank, differ)


def test_native_layers_are_the_layers_without_copies():
    """A layer is native exactly when every micro-batch keeps every expert on its owner
    with the expert's load as quota: a copy in one micro-batch, an empty native slot, a
    swapped native slot or a quota off by one makes it scheduled (not native)."""
    topo = Topology(2, 2, 8, 2)
    loads = torch.randint(1, 9, (3, 2, 4, 8), generator=torch.Generator().manual_seed(2))
    plan = static_plan(loads, topo)
    assert native_layers(plan, loads).tolist() == [True, True]
    copy = dataclasses.replace(plan, slot_expert_MLGJ=plan.slot_expert_MLGJ.clone())
    copy.slot_expert_MLGJ[1, 0, 3, 2] = 0                   # a copy of GPU 0's expert 0 on GPU 3
    swap = dataclasses.replace(plan, slot_expert_MLGJ=plan.slot_expert_MLGJ.clone())
    swap.slot_expert_MLGJ[2, 0, 0, :2] = swap.slot_expert_MLGJ[2, 0, 0, :2].flip(0)
    quota = dataclasses.replace(plan, slot_tokens_MLGJ=plan.slot_tokens_MLGJ.clone())
    quota.slot_tokens_MLGJ[0, 0, 1, 0] += 1
    empty = dataclasses.replace(plan, slot_expert_MLGJ=plan.slot_expert_MLGJ.clone())
    empty.slot_expert_MLGJ[0, 0, 2, 1] = -1
    for bad in (copy, swap, quota, empty):
        assert native_layers(bad, loads).tolist() == [False, True]


def test_the_batch_covers_fills_and_hubs():
    """The property above sees plans with fills, second-hop hubs and multi-micro-batch
    residencies (else it would compare empty lists)."""
    topo = Topology(2, 2, 8, 2)
    loads = torch.full((3, 2, 4, 8), 2)
    loads[..., 0] += 80
    plan = make_planner("relibra", topo).plan(loads)
    scheds = [rank_schedules(plan, loads, r) for r in range(topo.num_gpus)]
    flat = [s for rs in scheds for row in rs for _, s in row if s is not NATIVE]
    assert any(s.fill_slots for s in flat)
    assert any(int((s.hub_GJ >= 0).sum()) for s in flat)
    assert any(int((s.fill_mb_GJ >= 0).sum()) and int((s.fill_mb_GJ != s.return_mb_GJ).sum()) for s in flat)


@pytest.mark.parametrize("native", [True, False], ids=["native", "scheduled"])
def test_install_uses_the_schedules_built_by_plan_step(monkeypatch, native):
    """``plan_step`` builds every micro-batch's schedules; ``install`` then only copies them
    (the one-pair builder is never called), and its plans are ``layer_plans``'; a schedule
    built for another placement is not used (the plan is checked again and refused). On one
    GPU every layer is native (``NATIVE``: nothing built, the forward counts at run time);
    ``scheduled`` makes ``rank_schedules`` schedule it anyway."""
    import _moe_fns as fns

    import relibra_torch.moe.engine as engine_mod
    import relibra_torch.moe.schedule_batch as batch_mod
    from relibra_torch.hook import ReplayBalancer

    if not native:
        monkeypatch.setattr(batch_mod, "native_layers", lambda plan, loads: torch.zeros(plan.num_layers, dtype=torch.bool))
    m, gen, ids = _one_gpu_layer()
    balancer = ReplayBalancer(m, planner="relibra")
    plan = balancer.plan_step(ids)
    assert balancer.report.schedules_s > 0

    def refuse(*args, **kwargs):
        raise AssertionError("install rebuilt a schedule")

    monkeypatch.setattr(engine_mod, "build_rank_schedule", refuse)
    # the schedules were moved to the layer's device in plan_step, all at once: installing a
    # micro-batch copies nothing (a blocking copy to a GPU waits for the queued work)
    monkeypatch.setattr(RankSchedule, "to", refuse)
    for mb in range(3):
        x = torch.randn(5, fns.DIM, generator=gen)
        balancer.install(mb)
        sched = m.engine._schedule
        ref = check_layer_plan(layer_plans(plan, balancer.loads_MLSE, mb)[0], m.topology, plan.placement_LE[0])
        if native:
            assert sched is None and balancer._schedules[mb][0][1] is NATIVE
        else:
            assert sched.device == torch.device("cpu") and len(sched.fill_single_offsets) == len(sched.fill_counts)
        assert not _fields_differ(m.plan, ref)
        y = m(x, ids[mb][:, 0])
        m.set_plan(None)
        assert torch.allclose(y, m(x, ids[mb][:, 0]), atol=1e-6)   # the same as a layer without a plan
    with pytest.raises(ValueError, match="outside the plan"):
        balancer.install(3)
    monkeypatch.undo()
    lp = balancer._schedules[0][0][0]
    schedule = build_rank_schedule(m.topology, plan.placement_LE[0], check_layer_plan(
        layer_plans(plan, balancer.loads_MLSE, 0)[0], m.topology, plan.placement_LE[0]), 0)
    # a schedule of another rank, or a plan of another topology, is not used as given
    m.set_plan(lp, dataclasses.replace(schedule, rank=1))
    assert m.engine._schedule.rank == 0
    with pytest.raises(ValueError, match="another topology"):
        m.set_plan(dataclasses.replace(lp, topology=Topology(1, 1, 6, 1)), schedule)
    m.apply_placement(torch.arange(6).flip(0))
    with pytest.raises(ValueError, match="apply_placement"):
        m.set_plan(lp, schedule)


def test_a_plan_step_that_raises_leaves_the_previous_step_installable():
    """A planner whose plan fails ``validate_plan`` (here: quotas that do not sum to the loads)
    makes ``plan_step`` raise in ``rank_schedules``; the balancer must then hold the previous
    step's plan, schedules, placement and planner state together (not the new plan with the
    old schedules, nor a placement applied for a plan that never runs)."""
    import _moe_fns as fns
    import dataclasses as dc

    from relibra_torch.hook import ReplayBalancer
    from relibra_torch.planning import ReLibraPlanner

    class BrokenSecondStep(ReLibraPlanner):
        steps = 0

        def plan(self, loads_MLSE, pairs_LEE=None):
            plan = super().plan(loads_MLSE)
            if self.steps == 1:   # a new placement and quotas that double the loads
                plan = dc.replace(plan, placement_LE=plan.placement_LE.flip(1),
                                  slot_tokens_MLGJ=plan.slot_tokens_MLGJ * 2)
            return plan

        def commit(self, plan, loads_MLSE):
            super().commit(plan, loads_MLSE)
            self.steps += 1

    m, gen, ids = _one_gpu_layer()
    balancer = ReplayBalancer(m, planner=BrokenSecondStep(m.topology))
    first = balancer.plan_step(ids)
    placement = m.placement_cpu.clone()
    with pytest.raises(ValueError, match="invalid step plan"):
        balancer.plan_step(ids)
    assert balancer.plan is first
    assert torch.equal(m.placement_cpu, placement) and torch.equal(balancer.planner.placement_LE[0], placement)
    for mb in range(3):   # the previous step's plan still installs and runs
        balancer.install(mb)
        ref = check_layer_plan(layer_plans(first, balancer.loads_MLSE, mb)[0], m.topology, placement)
        assert not _fields_differ(m.plan, ref)
        m(torch.randn(5, fns.DIM, generator=gen), ids[mb][:, 0])


def test_install_before_plan_step_and_after_clear():
    """``install`` before any ``plan_step`` names the fix; ``clear`` removes the installed
    plans (native forwards), and a later ``install`` puts the step's prepared ones back."""
    import _moe_fns as fns

    from relibra_torch.hook import ReplayBalancer

    case = fns.Case(1, 1, 6, 2, 0, 3, ids_per_rank=[])
    m = fns.build(case, None)
    gen = torch.Generator().manual_seed(1)
    ids = [fns.make_routing("skewed", [5], 6, 2, gen)[0].unsqueeze(1) for _ in range(2)]
    balancer = ReplayBalancer(m, planner="relibra")
    with pytest.raises(RuntimeError, match=r"install\(\) before plan_step\(\)"):
        balancer.install(0)
    balancer.plan_step(ids)
    balancer.install(1)
    assert m.plan is balancer._schedules[1][0][0]
    balancer.clear()
    assert m.plan is None
    m(torch.randn(5, fns.DIM, generator=gen), ids[1][:, 0])   # native forward, no plan
    balancer.install(1)
    assert m.plan is balancer._schedules[1][0][0]


def _assert_equal_to_one_pair_path(plan, loads, topo):
    for rank in range(topo.num_gpus):
        got = rank_schedules(plan, loads, rank)
        for m in range(plan.num_micro_batches):
            for l, ref_lp in enumerate(layer_plans(plan, loads, m)):
                ref_lp = check_layer_plan(ref_lp, topo, plan.placement_LE[l])
                ref = build_rank_schedule(topo, plan.placement_LE[l], ref_lp, rank).to("cpu")
                lp, sched = got[m][l]
                assert not pair_differs(lp, sched, ref_lp, ref, loads[m, l]), (plan.planner, m, l, rank)


def test_every_planner_and_the_fallback_over_steps():
    """Every planner name (placements that change from step to step, committed), a
    hierarchical relibra priced with co-activation, and the hook's fallback plan on the
    previous placement; an all-idle micro-batch and an all-zero step included."""
    from relibra_torch.planning import PLANNER_NAMES, ReLibraConfig, native_plan
    from relibra_torch.replay.counts import count_pairs

    topo = Topology(2, 2, 8, 2)
    gen = torch.Generator().manual_seed(3)
    variants = [(n, {}) for n in PLANNER_NAMES] + [
        ("relibra", {"config": ReLibraConfig(dispatch="hierarchical", top_k=2)})]
    for name, kwargs in variants:
        planner = make_planner(name, topo, **kwargs)
        for step in range(3):
            loads = torch.randint(0, 8, (2, 2, topo.num_gpus, 8), generator=gen)
            loads[..., step] += 60
            loads[1] *= step != 1          # step 1: micro-batch 1 has no token at all
            loads *= step != 2 or name != "relibra"   # an all-zero step
            args = (loads,)
            if getattr(planner, "uses_coactivation", False):
                args += (count_pairs(torch.randint(0, 8, (16, 2, 2), generator=gen), 8),)
            plan = planner.plan(*args)
            _assert_equal_to_one_pair_path(plan, loads, topo)
            previous = planner.previous_placement(2).clone()
            _assert_equal_to_one_pair_path(native_plan(loads, topo, previous, "fallback", previous), loads, topo)
            planner.commit(plan, loads)


def test_splits_of_empty_steps_and_shares():
    """No micro-batch or no layer: empty splits of the right shape, every layer native."""
    topo = Topology(1, 2, 4, 1)
    for M, L in ((0, 2), (2, 0)):
        loads = torch.zeros(M, L, 2, 4, dtype=torch.int64)
        split, native = share_splits(static_plan(loads, topo), loads)
        assert tuple(split.shape) == (M, L, 2, 2, 3) and native.tolist() == [True] * L


def test_plan_step_plans_and_schedules_on_one_thread_then_restores_the_callers_count(monkeypatch):
    """The planner's tensors are small: ``plan_step`` plans and builds the schedules with torch on
    one thread (as the simulator charges and the guard is calibrated), whatever the process set,
    and gives the caller's thread count back."""
    import relibra_torch.hook as hook_mod
    from relibra_torch.hook import ReplayBalancer
    from relibra_torch.planning.relibra import ReLibraPlanner

    seen = {}

    class Spy(ReLibraPlanner):
        def plan(self, *args, **kwargs):
            seen["plan"] = torch.get_num_threads()
            return super().plan(*args, **kwargs)

    def schedules(*args, **kwargs):
        seen["schedules"] = torch.get_num_threads()
        return rank_schedules(*args, **kwargs)

    monkeypatch.setattr(hook_mod, "rank_schedules", schedules)
    m, gen, ids = _one_gpu_layer()
    balancer = ReplayBalancer(m, planner=Spy(m.topology))
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        balancer.plan_step(ids)
        assert seen == {"plan": 1, "schedules": 1}
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def _one_gpu_layer():
    """``(layer, generator, ids)``: a one-GPU layer of 6 experts (top-2, 3 replica slots) in its
    logical state, and 3 micro-batches of 5 skewed tokens' expert ids, ``[5, 1, 2]`` each."""
    import _moe_fns as fns
    case = fns.Case(1, 1, 6, 2, 0, 3, ids_per_rank=[])
    m = fns.build(case, None)
    m.load_state_dict(fns.logical_state(case))
    gen = torch.Generator().manual_seed(0)
    return m, gen, [fns.make_routing("skewed", [5], 6, 2, gen)[0].unsqueeze(1) for _ in range(3)]
