"""The simulator's memory model (relibra_torch/sim/memory.py) and `relibra simulate`'s refusal.

Hand-computed bytes for a tiny model; the refusal against an independent count of the
default recipe (bf16 weights, fp32 gradients, fp32 master + Adam over the data-parallel
group) on random model sizes and topologies; monotonicity; the override flag, the JSON
fields and the one-line error.
Legend: M micro-batches, L MoE layers, G GPUs, J slots per GPU, S source ranks, E experts.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from relibra_torch.cli import build_parser, main
from relibra_torch.planning.plan import StepPlan
from relibra_torch.planning.topology import Topology
from relibra_torch.sim import cli as sim_cli
from relibra_torch.sim.memory import (MemoryOptions, activation_bytes_MG, capacity_bytes, param_counts,
                                      plan_memory, state_breakdown)
from relibra_torch.sim.memory_fit import precheck
from relibra_torch.sim.presets import ModelSpec, get_hardware, get_model

# D 8, F 4, E 4, top-2, GQA 2 heads / 1 KV head x 4, V 16; one dense layer (FFN 6), one MoE
# layer with one shared expert of width 2
TINY = ModelSpec("tiny", num_layers=2, num_moe_layers=1, hidden_size=8, moe_ffn=4, num_experts=4, top_k=2,
                 num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=16, dense_ffn=6, num_shared_experts=1,
                 shared_ffn=2)


def test_tiny_model_bytes_by_hand():
    # attention projections 8*8 + 2*8*4 + 8*8 = 192, two norms 16: 208 per layer;
    # MoE layer: + router 8*4 + shared 3*8*2 = 288; dense layer: + FFN 3*8*6 = 352;
    # embedding and LM head 16*8 each, final norm 8: 288 + 352 + 256 + 8 = 904
    assert param_counts(TINY) == {"experts": 4 * 96, "dense": 904, "largest_dense_unit": 352}
    b = state_breakdown(TINY, 2, MemoryOptions(), live_slots=3)  # 2 experts per GPU
    assert b.expert_weights == 2 * 192
    assert b.dense_weights == 2 * 904
    assert b.gradients == 4 * 192 + 4 * 904  # fp32, not sharded (Megatron's distributed optimizer)
    assert b.optimizer == 12 * 192 + 12 * 904 / 2  # experts' data-parallel group: 1 GPU; dense: 2
    assert b.replica_slots == 3 * 96 * (2 + 4)  # bf16 weights + fp32 gradient buffer per slot
    assert b.migration_staging == 3 * 2 * 8 * 4 * 4  # send, receive, output of a [2, 4, 8] fp32 tensor
    # ZeRO-3: dense weights and gradients sharded, two units gathered and one unit's full gradient
    p = state_breakdown(TINY, 2, MemoryOptions(shard="params"))
    assert p.dense_weights == 2 * 904 / 2 + 2 * 2 * 352 and p.gradients == 4 * 192 + 4 * 904 / 2 + 4 * 352
    assert state_breakdown(TINY, 2, MemoryOptions(shard="none")).optimizer == 12 * (192 + 904)
    # EP 2 inside 4 GPUs (--compare-ep): the experts' data-parallel group has 2 GPUs, the dense part's 4
    w = state_breakdown(TINY, 2, MemoryOptions(), world=4)
    assert w.optimizer == 12 * 192 / 2 + 12 * 904 / 4 and w.gradients == 4 * 192 + 4 * 904
    w = state_breakdown(TINY, 2, MemoryOptions(shard="params"), world=4)  # a unit: dense 352 + 2 local experts
    assert w.expert_weights == 2 * 192 / 2 and w.dense_weights == 2 * 904 / 4 + 2 * 2 * (352 + 192)
    assert w.gradients == 4 * 192 / 2 + 4 * 904 / 4 + 4 * (352 + 192)

    # activations: 10 tokens, 30 routed rows. Per token: attention 2*(16+8+4+4+8) + 4*2 = 88,
    # MoE token part 2*(16+6) + 4*4 = 60, dense FFN 2*(16+18) = 68; per row 2*(16+12) = 56
    t, rows = torch.tensor([[10]]), torch.tensor([[[30]]])
    moe_layer = 10 * (88 + 60) + 30 * 56  # 3160 > the dense layer's 10 * (88 + 68)
    full = 10 * 2 * 8 * 2 + max(10 * 16 * 6, 2 * moe_layer)  # layer inputs + max(logits, layer x 2)
    assert float(activation_bytes_MG(TINY, MemoryOptions(), t, rows)) == full == 6640
    none = moe_layer + 10 * (88 + 68) + max(10 * 16 * 6, moe_layer)
    assert float(activation_bytes_MG(TINY, MemoryOptions(recompute="none"), t, rows)) == none


def test_plan_memory_takes_the_busiest_gpu_and_its_live_slots():
    topo = Topology(1, 2, 4, replica_slots=1)
    se = torch.tensor([[[[0, 1, 2], [2, 3, -1]]], [[[0, 1, -1], [2, 3, 0]]]])  # [M=2, L=1, G=2, J=3]
    plan = StepPlan(topo, torch.arange(4).view(1, 4), se, torch.ones_like(se))
    rows_MLG = torch.tensor([[[30, 5]], [[5, 12]]])
    tokens_MS = torch.tensor([[10, 10], [10, 4]])
    b = plan_memory(TINY, MemoryOptions(), plan, rows_MLG, tokens_MS)
    # (m0, g0): one live slot (576) + 6640 of activations beats (m1, g1): 576 + 2656
    assert b.replica_slots == 576 and b.activations == 6640 and b.migration_staging == 0  # nothing moved
    assert b.peak == 384 + 1808 + 4384 + 7728 + 576 + 6640
    moved = dataclasses.replace(plan, previous_placement_LE=torch.tensor([[2, 3, 0, 1]]))
    assert plan_memory(TINY, MemoryOptions(), moved, rows_MLG, tokens_MS).migration_staging == 768


def _need(model: ModelSpec, G: int, R: int, act: float = 0.0) -> float:
    """The default recipe counted independently: all-MoE GQA model, untied head, no shared
    experts; 18 bytes per expert parameter, 6 + 12/G per dense one, bf16 + fp32 per slot."""
    D, F, E, L = model.hidden_size, model.moe_ffn, model.num_experts, model.num_layers
    h, kv, dh = model.num_heads, model.num_kv_heads, model.head_dim
    dense = L * (2 * D * h * dh + 2 * D * kv * dh + 2 * D + D * E) + 2 * model.vocab_size * D + D
    experts = L * E * 3 * D * F
    staging = 3 * (E // G) * D * F * 4
    return experts * 18 / G + dense * (6 + 12 / G) + max(L * R * 3 * D * F * 6 + act, staging)


@settings(max_examples=40, deadline=None)
@given(D=st.sampled_from([1024, 2048, 4096, 7168]), F=st.sampled_from([512, 1408, 2048, 4096]),
       L=st.integers(4, 96), log_E=st.integers(5, 8), nodes=st.sampled_from([1, 2, 4, 8, 16]),
       gpn=st.sampled_from([4, 8]), R=st.integers(0, 4), hardware=st.sampled_from(["h100", "h200"]))
@example(D=4096, F=1536, L=94, log_E=7, nodes=4, gpn=8, R=2, hardware="h200")  # refused: qwen3-235b-a22b's experts on 4 x 8
@example(D=2048, F=768, L=48, log_E=7, nodes=4, gpn=8, R=2, hardware="h100")  # fits: qwen3-30b-a3b
def test_refusal_iff_the_need_exceeds_the_capacity(D, F, L, log_E, nodes, gpn, R, hardware):
    E = 2 ** log_E
    if E % (nodes * gpn):
        return
    sets = {"hidden_size": D, "moe_ffn": F, "num_layers": L, "num_moe_layers": L, "num_experts": E}
    argv = ["simulate", "--model", "qwen3-30b-a3b", "--hardware", hardware, "--nodes", str(nodes),
            "--gpus-per-node", str(gpn), "--replica-slots", str(R)]
    for k, v in sets.items():
        argv += ["--set", f"model.{k}={v}"]
    model = dataclasses.replace(get_model("qwen3-30b-a3b"), **sets)
    from relibra_torch.sim.memory_fit import synthetic_activations  # the default trace's 8192 tokens per GPU
    need = _need(model, nodes * gpn, R, synthetic_activations(model, MemoryOptions(), 8192))
    cap = get_hardware(hardware).hbm_gb * 1e9 * 0.9
    try:
        sim_cli.resolve(build_parser().parse_args(argv))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    assert (refused is not None) == (need > cap), (need / 1e9, refused)
    if refused:
        assert "\n" not in refused and "--ignore-memory" in refused
        got = float(re.search(r"needs ([\d,.]+) GB per GPU", refused).group(1).replace(",", ""))
        assert got == pytest.approx(need / 1e9, abs=0.051)
        assert f"{cap / 1e9:,.1f} GB is available" in refused


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["qwen3-30b-a3b", "qwen3-235b-a22b", "glm-4.5-air", "deepseek-v3"]),
       shard=st.sampled_from(["none", "optimizer", "grads", "params"]), R=st.integers(0, 3),
       recompute=st.sampled_from(["full", "none"]))
def test_more_gpus_never_need_more_and_more_slots_never_need_less(name, shard, R, recompute):
    model, o = get_model(name), MemoryOptions(shard=shard, recompute=recompute)
    sizes = [G for G in range(1, model.num_experts + 1) if model.num_experts % G == 0]
    L = model.num_moe_layers
    state = [state_breakdown(model, G, o, L * R) for G in sizes]
    for a, b in zip(state, state[1:]):  # weights + gradients + optimizer, and the whole peak
        assert b.persistent <= a.persistent and b.peak <= a.peak
    for G in sizes:
        assert state_breakdown(model, G, o, L * (R + 1)).peak >= state_breakdown(model, G, o, L * R).peak
    topo = [Topology(1, 8, model.num_experts, r) for r in (R, R + 1)]
    hw = dataclasses.replace(get_hardware("h200"), hbm_gb=1.0)  # nothing fits: both refuse
    msgs = [precheck(model, t, hw, o, True) for t in topo]
    needs = [float(re.search(r"needs ([\d,.]+) GB", m).group(1).replace(",", "")) for m in msgs]
    assert needs[1] >= needs[0]


def _run(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_refusal_is_one_line_before_any_trace(capsys, monkeypatch):
    def no_trace(*a, **k):
        raise AssertionError("the trace was generated before the memory check")
    monkeypatch.setattr(sim_cli, "synthetic_workload", no_trace)
    monkeypatch.setattr(sim_cli, "sample_workload", no_trace)
    rc, out, err = _run(capsys, "--model", "qwen3-235b-a22b", "--nodes", "2", "--no-progress")
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("relibra simulate: error: memory: qwen3-235b-a22b on 2 x 8 h200 (EP 16, R=2) needs ")
    assert "GB per GPU" in lines[0] and "126.9 GB is available" in lines[0]
    assert "--nodes 16 (EP 128)" in lines[0] and "--set memory.shard=grads (now optimizer) with --nodes 8" in lines[0]


def test_ignore_memory_runs_with_a_warning_and_the_json_has_the_peaks(tmp_path, capsys):
    from test_sim_cli import loads_file
    f = tmp_path / "loads.safetensors"
    loads_file(f)
    args = [str(f), "--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--systems", "eplb-oracle,relibra"]
    rc, _, err = _run(capsys, *args)
    assert rc == 2 and "memory: qwen3-30b-a3b on 1 x 4 h200" in err  # 30B on 4 GPUs does not fit
    rc, out, err = _run(capsys, *args, "--ignore-memory", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    warnings = err.strip().splitlines()
    assert warnings[0].startswith("relibra simulate: warning (--ignore-memory): memory: qwen3-30b-a3b")
    assert any(w.startswith("relibra simulate: warning (--ignore-memory): relibra needs ") for w in warnings)
    assert "memory per GPU, GB" in out and "peak" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["memory_options"] == dataclasses.asdict(MemoryOptions())
    cap = doc["config"]["memory_capacity_bytes"]
    assert cap == capacity_bytes(get_hardware("h200"), MemoryOptions())
    slot = get_model("qwen3-30b-a3b").expert_params() * 6
    for name, fig in doc["systems"].items():
        b = fig["memory"]
        assert fig["memory_peak_bytes"] == b["peak"] > cap
        assert b["peak"] == pytest.approx(b["expert_weights"] + b["dense_weights"] + b["gradients"] + b["optimizer"]
                                          + max(b["replica_slots"] + b["activations"], b["migration_staging"]))
        assert b["replica_slots"] <= 48 * 2 * slot and b["replica_slots"] % slot == 0
    assert doc["systems"]["static"]["memory"]["replica_slots"] == 0
    assert doc["systems"]["eplb-oracle"]["memory"]["replica_slots"] > 0  # EPLB fills its slots


def test_a_plan_that_does_not_fit_is_refused_by_name(tmp_path):
    from test_sim_cli import loads_file

    from relibra_torch.sim import SimConfig, simulate, workload_from_loads
    loads = loads_file(tmp_path / "l.safetensors", X=1)
    topo = Topology(1, 4, TINY.num_experts * 32, 2)
    model = dataclasses.replace(TINY, num_experts=128, top_k=8, num_layers=48, num_moe_layers=48, dense_ffn=0,
                                num_shared_experts=0, shared_ffn=0)
    wl = workload_from_loads(loads, model, topo)
    free = simulate(wl, SimConfig(model, get_hardware("h200"), topo, ("static", "eplb-oracle", "uniform")))
    peaks = {n: r.memory_figures()["memory_peak_bytes"] for n, r in free.systems.items()}
    assert min(peaks["static"], peaks["eplb-oracle"]) >= peaks["uniform"]  # the pre-check's lower bound
    big, small = sorted(("static", "eplb-oracle"), key=peaks.get, reverse=True)
    assert peaks[big] > peaks[small]
    hw = dataclasses.replace(get_hardware("h200"), hbm_gb=(peaks[big] + peaks[small]) / 2 / 0.9 / 1e9)
    with pytest.raises(ValueError, match=rf"^memory: {big}'s plan of step 0 .* needs .* per GPU"):
        simulate(wl, SimConfig(model, hw, topo, ("static", "eplb-oracle", "uniform"), memory_check=True))
    # the same capacity without the check: both run, and the JSON-level figures show who does not fit
    ran = simulate(wl, SimConfig(model, hw, topo, ("static", "eplb-oracle", "uniform")))
    assert ran.systems[big].memory_figures()["memory_peak_bytes"] == peaks[big]


def test_activations_are_checked_before_planning(tmp_path, capsys, monkeypatch):
    from test_sim_cli import loads_file

    from relibra_torch.sim.memory import ideal_memory
    loads = loads_file(tmp_path / "l.safetensors")[0]  # [M, L, S, E], 64 tokens per rank
    model, o = get_model("qwen3-30b-a3b"), MemoryOptions()
    state = state_breakdown(model, 4, o, 48 * 2).peak
    act = ideal_memory(model, o, loads, loads[:, 0].sum(-1) // 8).activations
    assert act > 0
    monkeypatch.setattr(sim_cli, "simulate", lambda *a, **k: pytest.fail("planned before the check"))
    hbm = (state + act / 2) / 0.9 / 1e9  # the state fits, the ideal system's activations do not
    rc, _, err = _run(capsys, str(tmp_path / "l.safetensors"), "--nodes", "1", "--gpus-per-node", "4",
                      "--no-progress", "--set", f"hardware.hbm_gb={hbm!r}")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"activations {act / 1e9:,.1f} GB" in err and "memory: qwen3-30b-a3b on 1 x 4 h200" in err


def test_memory_section_of_config_and_set(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[memory]\nshard = "grads"\nreserve_fraction = 0\n[simulate]\nignore_memory = true\n')

    def memory(*argv):
        return sim_cli.resolve(build_parser().parse_args(["simulate", "--config", str(cfg), *argv]))["memory"]
    assert memory() == MemoryOptions(shard="grads", reserve_fraction=0.0)
    assert memory("--set", "memory.shard=params").shard == "params"  # --set beats the file
    with pytest.raises(ValueError, match=r"memory.recompute = 'some'; allowed: one of 'full', 'none'"):
        memory("--set", "memory.recompute=some")
    with pytest.raises(ValueError, match=r"memory.grad_bytes = 'x'; allowed: an int"):
        memory("--set", "memory.grad_bytes=x")


def test_advice_counts_activations_and_names_only_changes_that_fit(capsys):
    """Mixtral on one node of 8: the early check counts the activations, says the exact
    replica slots, and no --nodes (no EP size above 8 divides 8 experts); the fix it names
    passes the same check."""
    from relibra_torch.sim.memory_fit import TraceShape, precheck, synthetic_activations
    model = dataclasses.replace(get_model("qwen3-30b-a3b"), name="mix", num_experts=8, top_k=2, hidden_size=4096,
                                moe_ffn=14336, num_layers=32, num_moe_layers=32)
    hw, o = get_hardware("h200"), MemoryOptions()
    act = synthetic_activations(model, o, 8192)
    trace = TraceShape("synthetic", 8192)
    msg = precheck(model, Topology(1, 8, 8, 2), hw, o, True, act, trace)
    assert f"activations {act / 1e9:,.1f} GB" in msg and act > 0
    assert "or fewer" not in msg and "--nodes 2" not in msg and "more --nodes cannot help" in msg
    # no single change fits: the first pair does (the same terms, activations included)
    sh, r = re.search(r"fix: --set memory.shard=(\w+) \(now optimizer\) with --replica-slots (\d+) \(now 2\);",
                      msg).groups()
    assert precheck(model, Topology(1, 8, 8, int(r)), hw, dataclasses.replace(o, shard=sh), True, act, trace) is None
    assert precheck(model, Topology(1, 8, 8, int(r)), hw, o, True, act, trace) is not None
    # loads file: the tokens are the file's, --micro-batch-tokens does not apply, no --nodes
    b = precheck(model, Topology(1, 8, 8, 0), hw, o, True, 1e12, TraceShape("loads", 10 ** 6))
    assert "--micro-batch-tokens does not apply" in b and "a smaller --micro-batch-tokens" not in b
    assert "--nodes" not in b.split("; or --ignore-memory")[0].replace("more --nodes cannot help", "")
    # synthetic: the smaller --micro-batch-tokens it names fits
    s = precheck(model, Topology(1, 8, 8, 0), hw, o, True, 20e9, TraceShape("synthetic", 8192))
    T = int(re.search(r"--micro-batch-tokens (\d+) \(now 8192\)", s).group(1))
    assert T < 8192 and precheck(model, Topology(1, 8, 8, 0), hw, o, True, 20e9 * T / 8192) is None


def test_loads_file_refusal_does_not_advise_micro_batch_tokens(tmp_path, capsys):
    from test_sim_cli import loads_file
    loads_file(tmp_path / "l.safetensors")
    rc, _, err = _run(capsys, str(tmp_path / "l.safetensors"), "--nodes", "1", "--gpus-per-node", "4",
                      "--no-progress", "--set", "hardware.hbm_gb=1")
    assert rc == 2 and "memory: qwen3-30b-a3b on 1 x 4" in err
    assert "--micro-batch-tokens" not in err.replace("--micro-batch-tokens does not apply", "")


def test_one_gpu_counts_no_replica_slot_and_no_staging():
    """At EP 1 every expert is native on the one GPU: nothing is replicated or moved, so the
    check before the run counts neither, whatever R is; at EP 2 both count."""
    model, hw, o = get_model("qwen3-30b-a3b"), get_hardware("h200"), MemoryOptions()
    one = precheck(model, Topology(1, 1, model.num_experts, 2), hw, o, True)
    assert "replica slots 0.0 GB" in one and "migration staging 0.0 GB" in one
    two = precheck(model, Topology(1, 2, model.num_experts, 2), hw, o, True)
    assert "replica slots 0.0 GB" not in two and "migration staging 0.0 GB" not in two
