"""Host work on the critical path and relibra's ablation switches.

Tiny shapes (2 nodes x 2 GPUs, 8 experts, 2 layers) keep this to a few seconds.
Legend: X steps, M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.cli import main
from relibra_torch.planning import ReLibraConfig, Topology, relibra_plan
from relibra_torch.planning.pricing import (LIGHT_SHARE, PLAN_FLOOR_NODES_S, PLAN_FLOOR_S, PLAN_LAYER_NODES_S, PLAN_LAYER_S,
                                            PLAN_SCHEDULE_S)
from relibra_torch.sim import SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.baselines import BaselineOptions, baseline_options
from relibra_torch.sim.presets import ModelSpec
from relibra_torch.sim.simulator import forward_s

MODEL = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                  num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)
HW = get_hardware("h200")
TOPO = Topology(2, 2, 8, 2)


def _loads(X=2, M=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(X, M, 2, 1, 8, generator=g) ** 4 + 0.01).expand(X, M, 2, 4, 8).reshape(-1, 8)
    picks = torch.multinomial(w, 512, replacement=True, generator=g)  # seeded: the same loads every run
    return torch.zeros_like(w, dtype=torch.int64).scatter_add_(1, picks, torch.ones_like(picks)).view(X, M, 2, 4, 8)


def _run(options=BaselineOptions(), systems=("static", "eplb-oracle", "online-global", "relibra", "uniform")):
    wl = workload_from_loads(_loads(), MODEL, TOPO, 128)
    return simulate(wl, SimConfig(MODEL, HW, TOPO, systems, warmup_steps=1, baseline_options=options))


def test_host_work_is_charged_beyond_the_window_only():
    free = _run(BaselineOptions(planning_overlap_s=100.0)).figures()
    for name, f in free.items():  # a window longer than any planning hides it all
        assert f["planning_charged_s"] == 0.0, name
    charged = _run(BaselineOptions(planning_overlap_s=0.0))
    figs = charged.figures()
    for name in ("static", "eplb-oracle", "relibra"):
        r = charged.systems[name]
        if name == "relibra":  # planner + the token splits its layer runs on the host
            assert r.host_s[0] > r.planner_s[0] > 0.0
        elif name == "static":  # no hook: no planning, no collective
            assert r.host_s[0] == r.planner_s[0] == 0.0
        else:  # the baselines' engines split per token on the GPU: the planner only
            assert r.host_s[0] == r.planner_s[0] > 0.0
        assert r.charged_s == r.host_s  # window 0: everything is charged
        # the step is the same plan's step plus the charge
        assert figs[name]["step_time_s"] == pytest.approx(free[name]["step_time_s"] + r.charged_s[0], rel=1e-9)
    # a run-time planner pays its per-layer latency, not a step-level charge
    assert charged.systems["online-global"].charged_s == [0.0]
    assert figs["online-global"]["step_time_s"] == pytest.approx(free["online-global"]["step_time_s"])


def test_default_window_is_the_forward_pass():
    """Static's forward pass of the step, the same window for every system."""
    res = _run()
    c = res.systems["static"].costs[0]
    for name in ("static", "eplb-oracle", "relibra"):
        assert res.systems[name].window_s[0] == pytest.approx(forward_s(c)), name
    # forward = a third of compute (bwd = 2 fwd), half of the exchange and of the collectives'
    # fixed latency (fwd of dispatch + combine)
    latency_s = float(c.latency_s_ML.sum())
    assert latency_s > 0
    assert forward_s(c) == pytest.approx(float(c.expert_s_ML.sum()) / 3 + float(c.all_to_all_s_ML.sum()) / 2
                                         + c.attention_dense_s / 3 + latency_s / 2, rel=1e-12)
    assert forward_s(c) < c.step_s


def test_relibra_section_switches_each_mechanism():
    opts = baseline_options({"relibra": {"balance": "false", "traffic_search": "off", "cross_node_replicas": "no",
                                         "choose": "false"}})
    assert opts.relibra_fields() == {"cross_node_replicas": False, "reorder": True, "traffic_search": False,
                                     "balance": False, "two_hop": True, "choose": False, "spread_fills": True,
                                     "relay": True, "max_swap_rounds": 64, "swap_candidates": 8,
                                     "plan_floor_s": PLAN_FLOOR_S, "plan_floor_nodes_s": PLAN_FLOOR_NODES_S,
                                     "plan_layer_s": PLAN_LAYER_S, "plan_layer_nodes_s": PLAN_LAYER_NODES_S,
                                     "light_share": LIGHT_SHARE, "plan_schedule_s": PLAN_SCHEDULE_S,
                                     "host_scale": None, "host_scale_nodes": None}  # measured when a run needs it
    with pytest.raises(ValueError, match="relibra.balance = 'maybe'; allowed: true or false"):
        baseline_options({"relibra": {"balance": "maybe"}})
    loads_MLSE = _loads()[0]
    on = relibra_plan(loads_MLSE, TOPO, config=ReLibraConfig())
    off = relibra_plan(loads_MLSE, TOPO, config=ReLibraConfig(balance=False, cross_node_replicas=False))
    El = TOPO.experts_per_gpu
    assert bool((on.slot_expert_MLGJ[..., El:] >= 0).any())  # the skewed loads get copies
    assert bool((off.slot_expert_MLGJ[..., El:] < 0).all())  # neither balancing nor traffic copies
    with pytest.raises(TypeError, match="ReLibraConfig.balance"):
        ReLibraConfig(balance="no")


def test_cli_planning_and_relibra_sections(tmp_path):
    path = tmp_path / "o.json"
    args = ["simulate", "--nodes", "2", "--gpus-per-node", "2", "--no-progress", "--systems", "relibra",
            "--micro-batches", "2", "--micro-batch-tokens", "256", "--steps", "1", "--json", str(path),
            "--ignore-memory"]  # full-size model on a few GPUs: a memory what-if
    assert main([*args, "--set", "planning.overlap_s=0", "--set", "relibra.balance=false"]) == 0
    f = json.loads(path.read_text())["systems"]["relibra"]
    assert f["planning_charged_s"] == pytest.approx(f["host_cpu_s"]) and f["host_cpu_s"] > 0
    assert main([*args, "--set", "relibra.speed=9"]) == 2


def test_each_collective_pays_its_fixed_latency():
    """The cost model charges the layer's collectives (transfer_counts' count) their fixed
    latency: across nodes the inter-node one, on one node the NVLink one."""
    from relibra_torch.planning import evaluate, make_planner
    from relibra_torch.sim import CostModel, CostOptions
    from relibra_torch.sim.transfers import layer_collectives_ML

    loads_MLSE = _loads()[0]
    plan = make_planner("relibra", TOPO).plan(loads_MLSE)
    metrics = evaluate(plan, loads_MLSE)
    tokens_MS = loads_MLSE.sum((1, 3)) // 2
    for dispatch, per_exchange in (("flat", 4), ("hierarchical", 9)):
        opts = CostOptions(dispatch=dispatch)
        slow = dataclasses.replace(HW, inter_node_latency_us=40.0)
        free = dataclasses.replace(HW, inter_node_latency_us=0.0)
        a = CostModel(MODEL, slow, opts).step_cost(plan, metrics, tokens_MS, tokens_MS.double())
        b = CostModel(MODEL, free, opts).step_cost(plan, metrics, tokens_MS, tokens_MS.double())
        n_ML = layer_collectives_ML(metrics.residency, TOPO, dispatch)
        assert int(n_ML.min()) >= per_exchange + 1  # the exchange and the plan check, at least
        assert a.step_s - b.step_s == pytest.approx(float(n_ML.sum()) * 40e-6, rel=1e-9)


def test_split_planning_charges_the_slowest_ranks_share(monkeypatch):
    """With ``planning.split`` (the training hook's default) every EP rank plans its share of
    the layers: the plan is the same, the host work is the slowest share plus three
    collectives (inputs agreement, the plan's all-gather, the failure flag)."""
    import relibra_torch.sim.simulator as sim

    def layers_as_seconds(fn):  # a deterministic clock: one second per layer planned
        out = fn()
        return out, float(out.num_layers) if hasattr(out, "num_layers") else 0.0

    monkeypatch.setattr(sim, "one_thread_cpu", layers_as_seconds)
    window = BaselineOptions(planning_overlap_s=0.0)
    systems = ("static", "eplb", "eplb-oracle", "eplb-node-demand", "relibra")  # every one splits
    split = _run(window, systems=systems)
    whole = _run(dataclasses.replace(window, planning_split=False), systems=systems)
    assert split.systems["static"].planner_s == whole.systems["static"].planner_s == [0.0]  # no hook
    for name in systems:
        a, b = split.systems[name], whole.systems[name]
        if name != "static":
            # one thread, both layers; then the plan's digest and two collectives
            assert b.planner_s[0] == pytest.approx(2.0 + 2 * HW.inter_node_latency_us * 1e-6, rel=1e-12)
            gather_s = a.planner_s[0] - 1.0  # 4 ranks, 2 layers: one layer per busy rank
            assert 3 * HW.inter_node_latency_us * 1e-6 <= gather_s < 1e-3
        assert torch.equal(a.imbalance_XML, b.imbalance_XML)
        assert a.costs[0].moe_s == pytest.approx(b.costs[0].moe_s, rel=1e-12)
    with pytest.raises(TypeError, match="planning.split"):
        BaselineOptions(planning_split="yes")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), shape=st.sampled_from([(2, 2, 8), (1, 4, 8), (2, 4, 16), (2, 2, 4)]),
       R=st.integers(0, 3), M=st.integers(1, 3), tokens=st.sampled_from([4, 64, 900]),
       hot=st.sampled_from([0.0, 0.5, 0.9]), hot_L=st.lists(st.booleans(), min_size=4, max_size=4),
       dispatch=st.sampled_from(["flat", "hierarchical"]),
       layers=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True))
def test_relibra_plans_any_layer_share_as_the_whole_step(seed, shape, R, M, tokens, hot, hot_L, dispatch, layers):
    """Split planning assembles the ranks' shares into the step plan, so a layer's plan must
    depend on that layer alone: any subset of layers plans as the whole step restricted to it."""
    from relibra_torch.planning import ReLibraPlanner
    from relibra_torch.sim import CostModel, CostOptions

    N, g, E = shape
    topo = Topology(N, g, E, R)
    model = dataclasses.replace(MODEL, num_experts=E)
    cfg = ReLibraConfig.from_weights(CostModel(model, HW, CostOptions(dispatch=dispatch)).reorder_weights(),
                                     dispatch=dispatch, top_k=2)
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(M, 4, 1, E, generator=gen) ** 4 + 0.01
    if hot:  # a collapsed router in some layers only: layers that differ in what pays
        w[:, torch.tensor(hot_L), :, 0] = (hot * w.sum(-1) / (1 - hot))[:, torch.tensor(hot_L)]
    picks = torch.multinomial(w.expand(M, 4, N * g, E).reshape(-1, E), tokens, replacement=True, generator=gen)
    loads = torch.zeros(M * 4 * N * g, E, dtype=torch.int64).scatter_add_(1, picks, torch.ones_like(picks))
    loads = loads.view(M, 4, N * g, E)
    planner = ReLibraPlanner(topo, cfg)
    planner.placement_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(4)])
    full = planner.plan(loads)
    part = planner.plan_layers(loads, layers)
    assert torch.equal(part.placement_LE, full.placement_LE[layers])
    assert torch.equal(part.slot_expert_MLGJ, full.slot_expert_MLGJ[:, layers])
    assert torch.equal(part.slot_tokens_MLGJ, full.slot_tokens_MLGJ[:, layers])


def test_the_simulator_charges_split_bytes_only_where_splits_travel(monkeypatch):
    """Under split planning the gathered bytes the simulator charges are the hook's padded
    all-gather: placements and slot tables for every planner, and the ranks' token splits with
    each layer's native flag only for a planner whose layer splits on the host (relibra); the
    baselines' engines pick
    replicas on the GPU and gather no splits. CPU time zeroed to see the gather alone."""
    import relibra_torch.sim.simulator as sim
    from relibra_torch.planning import make_planner

    monkeypatch.setattr(sim, "one_thread_cpu", lambda fn: (fn(), 0.0))
    topo, hw, config = TOPO, HW, SimConfig(MODEL, HW, TOPO)
    M, L, G, J, E = 3, 5, 4, 4, 8
    loads = torch.randint(0, 9, (M, L, G, E), generator=torch.Generator().manual_seed(0))
    P = -(-L // G)
    for name, splits in (("eplb-oracle", 0), ("relibra", 1)):
        _, secs, _ = sim.plan_as_run(make_planner(name, topo), loads, None, config)
        g = topo.gpus_per_node  # every planner's relays travel too (planning.relay; zeros where none)
        gathered = G * 8 * P * (E + 2 * M * G * J + M * G * g + splits * (M * G * G * J + 1))   # + native flags
        want = 3 * hw.inter_node_latency_us * 1e-6 + gathered * (G - 1) / G / (hw.inter_node_gbps * 1e9)
        assert abs(secs - want) < 1e-12, (name, secs, want)


def test_host_cpu_is_measured_without_garbage_collection_pauses():
    """A full collection walks the simulator's whole heap (~0.1 s) and would land at random
    in one system's measured planning; it is paused while a planner runs, as timeit does."""
    import gc

    from relibra_torch.sim.simulator import one_thread_cpu

    assert gc.isenabled()
    inside, _ = one_thread_cpu(gc.isenabled)
    assert inside is False and gc.isenabled()
    gc.disable()
    try:  # a caller that paused it keeps it paused
        one_thread_cpu(lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_layers_host_code_is_imported_before_any_step_is_timed():
    """Importing the layer's host code (``moe.schedule_batch``: the layer and its kernels,
    about 2 s of CPU) is not planning. With no warm-up step (a one-step file, ``--steps 1``)
    it landed in the first measured step's host work and charged relibra seconds: run in a
    fresh interpreter, where nothing has imported it yet."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        import torch
        from relibra_torch.planning import Topology
        from relibra_torch.sim import SimConfig, get_hardware, simulate, workload_from_loads
        from relibra_torch.sim import simulator
        from relibra_torch.sim.presets import ModelSpec
        seen = []
        run = simulator.plan_as_run
        def spy(planner, *args):
            seen.append((type(planner).__name__, "relibra_torch.moe.schedule_batch" in sys.modules))
            return run(planner, *args)
        simulator.plan_as_run = spy
        model = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                          num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)
        topo = Topology(2, 2, 8, 2)
        # one step: 64 tokens per rank, two experts each, a hot expert
        loads = torch.tensor([40, 24, 16, 16, 8, 8, 8, 8]).expand(1, 2, 2, 4, 8).contiguous()
        wl = workload_from_loads(loads, model, topo, 128)
        simulate(wl, SimConfig(model, get_hardware("h200"), topo, ("static", "relibra"), warmup_steps=0))
        print(seen)
        assert ("ReLibraPlanner", True) in seen and ("ReLibraPlanner", False) not in seen, seen
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


def test_without_a_warm_up_step_each_planner_plans_the_first_step_once_untimed_on_a_copy(monkeypatch):
    """A one-step run times the host code's first call in the process, 1-2 ms more than the
    hook's steady state; the simulator plans that step once untimed on a copy of each planner
    first. The copy leaves the planner's state alone: every figure but the host times equals
    a run without it, and with a warm-up step no extra plan is made."""
    from relibra_torch.sim import simulator

    calls = []
    real = simulator._warm_up
    monkeypatch.setattr(simulator, "_warm_up", lambda planner, *a: calls.append(type(planner).__name__) or real(planner, *a))
    systems = ("static", "eplb", "eplb-oracle", "online-global", "relibra", "uniform")
    wl = workload_from_loads(_loads(X=2), MODEL, TOPO, 128)
    cfg = SimConfig(MODEL, HW, TOPO, systems, warmup_steps=0)
    warm = simulate(wl, cfg).figures()
    assert sorted(calls) == sorted(["StaticPlanner", "EPLBPlanner", "EPLBPlanner", "OnlinePlanner",
                                    "ReLibraPlanner"]), calls
    monkeypatch.setattr(simulator, "_warm_up", lambda *a: None)
    cold = simulate(wl, cfg).figures()
    host = {"planner_s", "host_cpu_s", "planning_charged_s", "step_time_s", "speedup_vs_static",
            "speedup_vs_eplb_oracle", "fraction_of_bound", "fraction_of_uniform", "overlap_window_s"}
    for name in systems:
        same = {k: v for k, v in warm[name].items() if k not in host}
        assert same == {k: v for k, v in cold[name].items() if k not in host}, name
        assert warm[name]["step_time_s"] - warm[name]["planning_charged_s"] == pytest.approx(
            cold[name]["step_time_s"] - cold[name]["planning_charged_s"])
    calls.clear()
    monkeypatch.setattr(simulator, "_warm_up", lambda planner, *a: calls.append(planner))
    simulate(wl, dataclasses.replace(cfg, warmup_steps=1))
    assert calls == []
