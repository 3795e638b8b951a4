"""Replay-aware packing (relibra_torch.planning.packing), the long-tail trace family and
``relibra simulate --trace / --packing``.

Legend: N samples, L layers, E experts, S ranks, M micro-batches, Q nodes.
"""

from __future__ import annotations

import dataclasses

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.cli import main
from relibra_torch.planning.packing import (PackingConfig, PackingCosts, PackingProblem,
                                            balanced_node_placement, plan_packing)

COSTS = PackingCosts(num_moe_layers=2, moe_layer_s_per_token=1e-3, s_per_attention_pair=1e-5,
                     num_dense_layers=1, dense_layer_s_per_token=2e-3, head_s_per_token=5e-4,
                     compute_s_per_token=2e-4, cross_node_s_per_token=3e-4, intra_node_s_per_token=5e-5)


def _check_feasible(plan, lengths, S, M, cap):
    N = lengths.numel()
    assert plan.rank_N.shape == (N,) and plan.micro_batch_N.shape == (N,)
    assert sorted(plan.permutation_N.tolist()) == list(range(N))  # every sample exactly once
    flat = plan.rank_N * M + plan.micro_batch_N
    cnt = torch.bincount(flat, minlength=S * M)
    assert int(cnt.min()) >= 1  # no empty micro-batch, M per rank
    tok = torch.zeros(S * M, dtype=torch.int64).index_add_(0, flat, lengths)
    assert bool(((tok <= cap) | (cnt == 1)).all())  # the cap, unless one longer sample alone
    for r in range(S):  # the permutation lists each rank's micro-batches in order
        for m, ids in enumerate(plan.micro_batches_of(r)):
            assert set(ids.tolist()) == set((flat == r * M + m).nonzero().flatten().tolist())


@st.composite
def instances(draw):
    g = draw(st.sampled_from([1, 2]))
    S = g * draw(st.integers(1, 3))
    M = draw(st.integers(1, 3))
    N = S * M + draw(st.integers(0, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (N,), generator=gen)
    L, E = draw(st.integers(1, 3)), 2 * draw(st.integers(1, 3))
    hot = torch.rand(N, L, E, generator=gen) ** 3
    counts = (hot / hot.sum(-1, keepdim=True) * lengths.view(N, 1, 1) * 2).round().to(torch.int32)
    # a feasible fixed start: round-robin bins, the cap its fullest multi-sample bin (or more)
    fixed_bin = torch.arange(N) % (S * M)
    fixed_bin = fixed_bin[torch.randperm(N, generator=gen)]
    tok = torch.zeros(S * M, dtype=torch.int64).index_add_(0, fixed_bin, lengths)
    cap = int(tok.max()) + draw(st.integers(0, 30))
    return lengths, counts, S, M, g, cap, (fixed_bin // M, fixed_bin % M), seed


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_routepack_is_feasible_deterministic_and_never_worse_than_its_starts(inst):
    lengths, counts, S, M, g, cap, fixed, seed = inst
    cfg = PackingConfig(S, M, cap, gpus_per_node=g, seed=seed % 1000, max_proposals=300)
    plan = plan_packing(lengths, counts, cfg, COSTS, initial=fixed)
    _check_feasible(plan, lengths, S, M, cap)
    problem = PackingProblem(lengths, counts, cfg, COSTS)
    obj = problem.objective(plan.rank_N, plan.micro_batch_N)
    assert obj == pytest.approx(plan.objective_s, rel=1e-12)
    assert obj <= problem.objective(*fixed) + 1e-12  # fixed is one of the starts
    again = plan_packing(lengths, counts, cfg, COSTS, initial=fixed)
    assert torch.equal(again.rank_N, plan.rank_N) and torch.equal(again.micro_batch_N, plan.micro_batch_N)
    length_cfg = PackingConfig(S, M, cap, gpus_per_node=g, method="length")
    if plan.start_objectives_s["length"] is None:  # both greedies stuck on a tight cap (docs/packing.md)
        with pytest.raises(ValueError, match=r"longest-first greedy found no packing under max_tokens"):
            plan_packing(lengths, counts, length_cfg, COSTS)
        return
    assert obj <= plan.start_objectives_s["length"] + 1e-12
    length = plan_packing(lengths, counts, length_cfg, COSTS)
    _check_feasible(length, lengths, S, M, cap)


def test_a_tight_cap_the_balanced_greedy_cannot_pack_is_packed_best_fit():
    """Hypothesis found it: 149 tokens in 2 x 75. Least work first puts 37 + 29 and 33 + 32
    together, and 14 then fits nowhere; best fit packs {37, 33, 4} and {32, 29, 14}."""
    lengths = torch.tensor([29, 33, 32, 4, 14, 37])
    plan = plan_packing(lengths, None, PackingConfig(2, 1, 75, method="length"), COSTS)
    _check_feasible(plan, lengths, 2, 1, 75)
    fixed = (torch.tensor([0, 1, 0, 1, 0, 1]), torch.zeros(6, dtype=torch.int64))
    plan = plan_packing(lengths, None, PackingConfig(2, 1, 75, max_proposals=50), COSTS, initial=fixed)
    _check_feasible(plan, lengths, 2, 1, 75)
    assert plan.start_objectives_s["length"] is not None


def test_routepack_starts_from_the_fixed_packing_where_no_greedy_packs_a_tight_cap():
    """Found by search: a feasible packing that neither greedy finds. routepack keeps the
    fixed start; ``method="length"`` says why it cannot pack."""
    rng = np.random.default_rng(0)
    for _ in range(20000):
        lengths = torch.from_numpy(rng.integers(1, 40, size=int(rng.integers(3, 10))))
        N, S = lengths.numel(), 2 if rng.random() < 0.5 else 3
        if N < S:
            continue
        bins = torch.from_numpy(rng.permutation(N) % S)
        cap = int(torch.zeros(S, dtype=torch.int64).index_add_(0, bins, lengths).max())
        problem = PackingProblem(lengths, None, PackingConfig(S, 1, cap), COSTS)
        if problem._longest_first(False) is None and problem._longest_first(True) is None:
            break
    else:
        pytest.fail("no instance found")
    fixed = (bins, torch.zeros(N, dtype=torch.int64))
    plan = plan_packing(lengths, None, PackingConfig(S, 1, cap, max_proposals=50), COSTS, initial=fixed)
    _check_feasible(plan, lengths, S, 1, cap)
    assert plan.start_objectives_s["length"] is None and plan.start_objectives_s["fixed"] is not None
    with pytest.raises(ValueError, match=r"method='routepack' with a feasible initial packing"):
        plan_packing(lengths, None, PackingConfig(S, 1, cap, method="length"), COSTS)


def test_long_samples_get_their_own_micro_batch_and_share_micro_batches():
    lengths = torch.tensor([100, 90, 5, 5, 5, 5, 5, 5, 5, 5])  # two samples over the cap of 20
    plan = plan_packing(lengths, None, PackingConfig(2, 4, 20, method="length"), COSTS)
    _check_feasible(plan, lengths, 2, 4, 20)
    assert int(plan.micro_batch_N[0]) == int(plan.micro_batch_N[1])  # one slowest-rank cost, not two
    assert int(plan.rank_N[0]) != int(plan.rank_N[1])


def test_infeasible_inputs_are_clear_errors():
    with pytest.raises(ValueError, match=r"3 samples cannot fill num_ranks x num_micro_batches = 2 x 2"):
        plan_packing(torch.tensor([1, 2, 3]), None, PackingConfig(2, 2, 10), COSTS)
    with pytest.raises(ValueError, match=r"5 samples are longer than max_tokens = 10.*only 4"):
        plan_packing(torch.tensor([11] * 5), None, PackingConfig(2, 2, 10), COSTS)
    with pytest.raises(ValueError, match=r"do not fit in the 4 micro-batches"):
        plan_packing(torch.tensor([9] * 8), None, PackingConfig(2, 2, 10), COSTS)
    with pytest.raises(ValueError, match=r"lengths_N\[1\] = 0; allowed: >= 1"):
        plan_packing(torch.tensor([1, 0, 3, 4]), None, PackingConfig(2, 2, 10), COSTS)
    with pytest.raises(ValueError, match=r"method = 'best'; allowed: one of 'fixed', 'length', 'routepack'"):
        PackingConfig(2, 2, 10, method="best")
    with pytest.raises(ValueError, match=r"num_ranks = 6 is not a multiple of gpus_per_node = 4"):
        PackingConfig(6, 2, 10, gpus_per_node=4)
    with pytest.raises(ValueError, match=r"method = 'fixed' needs initial"):
        plan_packing(torch.tensor([1, 2, 3, 4]), None, PackingConfig(2, 2, 10, method="fixed"), COSTS)


def test_an_infeasible_fixed_start_is_repaired():
    lengths = torch.tensor([4, 4, 4, 4, 4, 4])
    fixed = (torch.zeros(6, dtype=torch.int64), torch.tensor([0, 0, 0, 0, 0, 1]))  # rank 1 empty, over cap
    cfg = PackingConfig(2, 2, 8, method="fixed")
    plan = plan_packing(lengths, None, cfg, COSTS, initial=fixed)
    _check_feasible(plan, lengths, 2, 2, 8)


def test_balanced_node_placement_fills_nodes_evenly():
    load = torch.tensor([[10, 9, 1, 1, 1, 1, 8, 0]])
    node = balanced_node_placement(load, 2)
    assert torch.bincount(node[0], minlength=2).tolist() == [4, 4]
    assert int(node[0, 0]) != int(node[0, 1])  # the two heaviest experts on different nodes
    per_node = torch.zeros(2, dtype=torch.int64).index_add_(0, node[0], load[0])
    # greedy: 10 | 9, 8 joins the lighter node, the 1s fill the first node until it is full
    assert sorted(per_node.tolist()) == [13, 18]
    assert balanced_node_placement(torch.ones(3, 6), 3).tolist() == [[0, 1, 2, 0, 1, 2]] * 3


def test_surrogate_is_the_cost_models_uniform_step_on_one_node():
    """On one node the surrogate's balanced plan is the uniform reference: its objective equals
    the cost model's uniform reference step time of the same packing (attention, compute and
    traffic)."""
    from relibra_torch.planning.topology import Topology
    from relibra_torch.sim import CostModel, get_hardware, get_model
    from relibra_torch.sim.packed import packing_costs
    from relibra_torch.sim.trace_families import family_config, generate_sample_trace, packed_loads

    # the packing surrogate leaves out the collectives' fixed latency (the same for every packing)
    model = get_model("qwen3-30b-a3b")
    hw = dataclasses.replace(get_hardware("h200"), inter_node_latency_us=0.0, nvlink_latency_us=0.0)
    cost = CostModel(model, hw)
    topo = Topology(1, 4, model.num_experts, 0)
    cfg = family_config("long-tail", seed=3)
    step = generate_sample_trace(cfg, 2, 4, 6000, steps=1)[0]
    pc = PackingConfig(4, 2, 6000, gpus_per_node=4, max_proposals=200)
    plan = plan_packing(step.lengths_N, step.counts_NLE, pc, packing_costs(cost),
                        initial=(step.rank_N, step.micro_batch_N))
    loads, tokens, pairs = packed_loads(step, plan.rank_N, plan.micro_batch_N, 2, 4)
    uniform = cost.uniform_step_cost(loads, topo.num_nodes, topo.gpus_per_node, tokens, pairs)
    assert plan.objective_s == pytest.approx(uniform.step_s, rel=1e-9)
    fixed = PackingProblem(step.lengths_N, step.counts_NLE, pc, packing_costs(cost)).objective(
        step.rank_N, step.micro_batch_N)
    assert plan.objective_s < fixed  # long samples: packing pays on this trace


def test_long_tail_family_lengths_counts_and_fixed_packing():
    from relibra_torch.sim.trace_families import TRACE_FAMILIES, family_config, generate_sample_trace
    assert set(TRACE_FAMILIES) >= {"default", "long-tail"}
    cfg = family_config("long-tail", num_layers=4, num_experts=16, top_k=2, seed=1)
    steps = generate_sample_trace(cfg, 4, 4, 8192, steps=2)
    again = generate_sample_trace(cfg, 4, 4, 8192, steps=2)
    for s, t in zip(steps, again):
        assert torch.equal(s.counts_NLE, t.counts_NLE) and torch.equal(s.rank_N, t.rank_N)
    resp_lo = cfg.min_prompt_len + cfg.min_response_len
    for s in steps:
        n = s.lengths_N
        assert int(n.min()) >= resp_lo and int(n.max()) <= cfg.max_prompt_len + 16384
        assert bool((s.counts_NLE.sum(-1, dtype=torch.int64) == 2 * n.view(-1, 1)).all())
        assert bool((s.counts_NLE.to(torch.int64) <= n.view(-1, 1, 1)).all())
        flat = s.rank_N * 4 + s.micro_batch_N
        cnt = torch.bincount(flat, minlength=16)
        tok = torch.zeros(16, dtype=torch.int64).index_add_(0, flat, n)
        assert int(cnt.min()) >= 1 and bool(((tok <= 8192) | (cnt == 1)).all())
    lengths = torch.cat([generate_sample_trace(family_config("long-tail", num_layers=1, num_experts=8, top_k=2,
                                                              seed=k), 8, 8, 16384)[0].lengths_N for k in range(2)])
    assert float(lengths.float().median()) > 1000 and int(lengths.max()) > 12000  # long tail


def _simulate(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# full-size models on a few GPUs do not fit the memory model (docs/simulator.md, "Memory"):
# these tests are about other things, so they run as what-ifs
SMALL = ["--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--ignore-memory"]


def test_loads_file_refuses_other_packings_and_a_file_refuses_trace(tmp_path, capsys):
    from relibra_torch.replay import save_loads
    f = tmp_path / "l.safetensors"
    save_loads(str(f), torch.full((1, 2, 48, 4, 128), 4, dtype=torch.int64), 8)
    rc, _, err = _simulate(capsys, str(f), *SMALL, "--packing", "routepack")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "--packing routepack needs sample lengths" in err and "--packing fixed" in err
    rc, _, err = _simulate(capsys, str(f), *SMALL, "--trace", "long-tail")
    assert rc == 2 and "--trace long-tail shapes the synthetic trace; it does not apply to the file" in err


def test_routing_file_routepack_runs_and_shares_one_packing(tmp_path, capsys):
    from _replay_helpers import offsets_from_lengths, random_ids_TLK

    from relibra_torch.replay import save_routing
    lengths = [30, 50, 20, 40, 60, 10, 25, 35, 300, 15, 45, 5]
    ids = random_ids_TLK(sum(lengths), 48, 8, 128, seed=1, skew=0.5)
    f = tmp_path / "r.safetensors"
    save_routing(str(f), ids, offsets_from_lengths(lengths), 128)
    docs = {}
    for p in ("fixed", "routepack"):
        rc, out, err = _simulate(capsys, str(f), *SMALL, "--micro-batches", "2", "--systems", "static,relibra",
                                 "--packing", p, "--json", str(tmp_path / f"{p}.json"))
        assert rc == 0, err
        docs[p] = json.loads((tmp_path / f"{p}.json").read_text())
    note = docs["routepack"]["config"]["notes"]["packing"]
    assert note.startswith("routepack") and "fixed" in note
    assert docs["routepack"]["config"]["packing"] == "routepack"
    assert "packing" not in docs["fixed"]["config"]  # the default JSON is unchanged
    # one packing per step for every system: the attention part is the same for all
    att = {s["attention_dense_s"] for s in docs["routepack"]["systems"].values()}
    assert len(att) == 1


def test_synthetic_long_tail_packings(tmp_path, capsys):
    docs = {}
    for p in ("fixed", "length", "routepack"):
        rc, out, err = _simulate(capsys, *SMALL, "--trace", "long-tail", "--packing", p, "--micro-batches", "2",
                                 "--micro-batch-tokens", "8192", "--steps", "1", "--systems", "static",
                                 "--set", "model.num_moe_layers=4", "--set", "model.num_layers=4",
                                 "--json", str(tmp_path / f"{p}.json"))
        assert rc == 0, err
        docs[p] = json.loads((tmp_path / f"{p}.json").read_text())
    # the same samples: total tokens equal; attention cheaper once long samples share micro-batches
    att = {p: d["systems"]["uniform"]["attention_dense_s"] for p, d in docs.items()}
    assert att["length"] < att["fixed"] and att["routepack"] < att["fixed"]
    assert docs["fixed"]["config"]["trace"] == "long-tail"
    assert "long-tail" in docs["routepack"]["config"]["source"]


@pytest.mark.slow
def test_relibra_trainer_repacks_file_steps_without_changing_the_loss(tmp_path):
    """torchtitan's loop on 2 gloo ranks (EP 2 as 2 nodes): routepack moves whole samples
    between ranks and micro-batches (tokens all-gathered, routing from the file); the step's
    loss is that of the loader's order, and the packing objective is no worse than fixed."""
    import _titan_fns as fns

    from integrations.torchtitan.data import skewed_routing
    from integrations.torchtitan.trainer import step_file
    from relibra_torch.replay import save_routing
    from relibra_torch.testing import RankPool

    gen = torch.Generator().manual_seed(0)
    replay_dir = tmp_path / "replay"
    replay_dir.mkdir()
    for step in (1, 2):  # 2 micro-batches x 2 ranks x 1 row of 16 tokens; qwen3 debug: 64 experts, top-8
        ids = skewed_routing(4 * 16, 2, 64, 8, skew=3.0, generator=gen)
        save_routing(step_file(str(replay_dir), step), ids, torch.arange(5, dtype=torch.int64) * 16, 64)
    with RankPool(2, timeout_s=600) as pool:
        fixed = pool.run(fns.trainer_files_run, str(tmp_path / "fixed"), str(replay_dir), 2, "fixed")
        packed = pool.run(fns.trainer_files_run, str(tmp_path / "packed"), str(replay_dir), 2, "routepack")
    for a, b in zip(packed[0]["losses"], fixed[0]["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (packed[0]["losses"], fixed[0]["losses"])
    for m in packed[0]["metrics"]:
        assert m["relibra/packing_objective_s"] <= m["relibra/packing_fixed_s"]
    assert sum(m["relibra/packing_moved_samples"] for m in packed[0]["metrics"]) > 0  # samples really moved
    assert "relibra/packing_objective_s" not in fixed[0]["metrics"][0]


def test_config_file_packing_and_trace_are_checked(tmp_path, capsys):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"simulate": {"packing": "best"}}))
    rc, _, err = _simulate(capsys, *SMALL, "--config", str(cfg))
    assert rc == 2 and "--packing 'best'; allowed: fixed, length, routepack" in err
    cfg.write_text(json.dumps({"simulate": {"trace": "spiky"}}))
    rc, _, err = _simulate(capsys, *SMALL, "--config", str(cfg))
    assert rc == 2 and "--trace 'spiky'; allowed: default, rank-mix, collapsed, long-tail" in err
    # count-level families cannot be repacked
    rc, _, err = _simulate(capsys, *SMALL, "--trace", "collapsed", "--packing", "routepack")
    assert rc == 2 and "--trace collapsed is generated as counts" in err and "use --packing fixed" in err


def test_packing_module_imports_only_planning():
    """planning/packing.py takes prices as plain numbers: it must not pull in the simulator,
    the layer, the ops or the distributed code."""
    import os
    import subprocess
    import sys

    import relibra_torch
    root = os.path.dirname(os.path.dirname(os.path.abspath(relibra_torch.__file__)))  # this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    code = ("import sys, relibra_torch.planning.packing; "
            "print(sorted({m.split('.')[1] for m in sys.modules if m.startswith('relibra_torch.')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env).stdout
    assert out.strip() == "['checks', 'planning']", out
