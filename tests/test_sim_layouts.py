"""EP layout comparison (``relibra simulate --compare-ep``): splitting, gradient sync, rows.

Tiny shapes (2 nodes x 2 GPUs, 8 experts, 2 layers) keep this to a few seconds.
Legend: X steps, M micro-batches, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relibra_torch.cli import main
from relibra_torch.planning import Topology
from relibra_torch.sim import SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.layouts import (GRAD_SYNC_BYTES_PER_PARAM, Cluster, compare_layouts, expert_grad_sync_s,
                                       headline, parse_ep_sizes, split_workload)
from relibra_torch.sim.baselines import BaselineOptions
from relibra_torch.sim.presets import ModelSpec

MODEL = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                  num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)
HW = get_hardware("h200")


MIXTRAL = str(Path(__file__).parent / "fixtures" / "hf_configs" / "Mixtral-8x7B-v0.1" / "config.json")


def _workload(S=4, X=2, M=3, seed=0, gpus_per_node=2):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(X, M, 2, 1, 8, generator=g) ** 3 + 0.01).expand(X, M, 2, S, 8).reshape(-1, 8)
    picks = torch.multinomial(w, 256, replacement=True, generator=g)
    loads = torch.zeros_like(w, dtype=torch.int64).scatter_add_(1, picks, torch.ones_like(picks)).view(X, M, 2, S, 8)
    # the generators read only the rank and node counts: a Cluster stands for a topology the experts do not divide
    return workload_from_loads(loads, MODEL, Cluster(S // gpus_per_node, gpus_per_node), 128)


def _config(systems=("static", "relibra", "eplb-oracle", "uniform")):
    # host planning (measured CPU time) hidden so that two runs of one plan price alike
    return SimConfig(MODEL, HW, Topology(2, 2, 8, 1), systems, warmup_steps=1,
                     baseline_options=BaselineOptions(planning_overlap_s=1e9))


def test_split_keeps_every_rank_once():
    wl = _workload()
    parts = split_workload(wl, 2)
    assert len(parts) == 2
    assert torch.equal(torch.cat([p.loads_XMLSE for p in parts], 3), wl.loads_XMLSE)
    assert torch.equal(torch.cat([p.tokens_XMS for p in parts], 2), wl.tokens_XMS)


def test_grad_sync_by_hand():
    cfg = _config()
    assert expert_grad_sync_s(cfg, 4, 4) == 0.0
    params = 2 * (8 // 2) * MODEL.expert_params()  # 2 layers x 4 experts per GPU at EP 2
    # EP 2 on 2 x 2: the two groups are the two nodes, so the peers cross nodes
    expect = 0.5 * params * GRAD_SYNC_BYTES_PER_PARAM / (HW.inter_node_gbps * 1e9)
    assert expert_grad_sync_s(cfg, 2, 4) == pytest.approx(expect)
    # EP 1 on 1 x 2 (one node): NVLink
    one = SimConfig(MODEL, HW, Topology(1, 2, 8, 1), ("static", "uniform"))
    params1 = 2 * 8 * MODEL.expert_params()
    assert expert_grad_sync_s(one, 1, 2) == pytest.approx(0.5 * params1 * 6 / (HW.nvlink_gbps * 1e9))


def test_full_ep_row_equals_the_plain_simulation_and_groups_bound_the_step():
    wl, cfg = _workload(), _config()
    rows = compare_layouts(wl, cfg, (2, 4))
    plain = simulate(wl, cfg).figures()
    tokens = float(wl.tokens_XMS[1:].sum())
    for r in rows:
        if r.ep_size == 4:
            assert r.groups == 1 and r.grad_sync_s == 0.0
            assert r.step_s == pytest.approx(plain[r.system]["step_time_s"], rel=1e-12)
        else:
            assert r.groups == 2 and r.grad_sync_s > 0
            assert r.step_s == pytest.approx(r.slowest_group_s + r.grad_sync_s)
            for part in split_workload(wl, 2):  # the slowest group bounds every group
                one = simulate(part, SimConfig(MODEL, HW, Topology(1, 2, 8, 1), cfg.systems, warmup_steps=1,
                                               baseline_options=cfg.baseline_options))
                assert one.figures()[r.system]["step_time_s"] <= r.slowest_group_s * (1 + 1e-12)
        assert r.tokens_per_gpu_s == pytest.approx(tokens / (4 * r.step_s))


def test_headline_picks_the_fastest_baseline_layout():
    wl, cfg = _workload(), _config()
    rows = compare_layouts(wl, cfg, (2, 4))
    h = headline(rows)
    base = [r for r in rows if r.system == "eplb-oracle"]
    best = max(base, key=lambda r: r.tokens_per_gpu_s)
    assert h["baseline"] == "eplb-oracle" and h["baseline_ep"] == best.ep_size
    mine = {r.ep_size: r for r in rows if r.system == "relibra"}
    assert h["relibra_at_baseline_ep"] == pytest.approx(mine[best.ep_size].tokens_per_gpu_s / best.tokens_per_gpu_s)


@pytest.mark.parametrize("text, message", [("3", "allowed: 1,2,4,8"), ("x", "comma-separated"), ("", "empty")])
def test_bad_sizes(text, message):
    with pytest.raises(ValueError, match=message):
        parse_ep_sizes(text, 8, 8, 2)


def test_cli_compare_ep_json_and_errors(tmp_path, capsys):
    args = ["simulate", "--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--systems", "static,eplb-oracle",
            "--micro-batches", "2", "--micro-batch-tokens", "256", "--steps", "2", "--ignore-memory"]  # full-size model on a few GPUs: a memory what-if
    path = tmp_path / "layouts.json"
    assert main([*args, "--compare-ep", "2,4", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert {r["ep_size"] for r in doc["layouts"]} == {2, 4}
    assert doc["headline"]["baseline"] == "eplb-oracle"
    assert "fastest baseline" in capsys.readouterr().out
    assert main([*args, "--compare-ep", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--compare-ep 3" in err and "\n" not in err


def test_layouts_that_do_not_fit_are_left_out_with_the_reason():
    import dataclasses
    wl, cfg = _workload(), _config(("static", "relibra", "uniform"))
    tiny = dataclasses.replace(cfg, hardware=dataclasses.replace(HW, hbm_gb=1e-3), memory_check=True)
    refused: dict[int, str] = {}
    assert compare_layouts(wl, tiny, (2, 4), refused=refused) == []
    assert set(refused) == {2, 4} and all("GB per GPU" in why for why in refused.values())
    with pytest.raises(ValueError, match="GB per GPU"):  # without a place to report it: refused
        compare_layouts(wl, tiny, (2,))
    refused.clear()
    assert compare_layouts(wl, dataclasses.replace(cfg, memory_check=True), (2, 4), refused=refused)
    assert refused == {}


def test_compare_ep_where_no_size_fits_is_an_error_not_an_empty_table(tmp_path, capsys):
    # the cluster's own layout (EP 16) fits; one GPU cannot hold the experts
    argv = ["simulate", "--nodes", "2", "--no-progress", "--systems", "static", "--micro-batches", "1",
            "--micro-batch-tokens", "64", "--steps", "2", "--compare-ep", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("relibra simulate: error: --compare-ep: no EP size fits in memory: EP 1: ") and "\n" not in err
    assert "GB per GPU" in err and "--ignore-memory" in err


def test_an_ep_size_with_an_empty_group_names_the_size_and_the_fix():
    """A trace too small to give every EP group tokens (a plain run accepts empty ranks): the
    size at fault, the group, and what to do; the sizes whose groups all hold tokens run."""
    wl, cfg = _workload(), _config(("static", "uniform"))
    wl.tokens_XMS[:, :, 2:] = 0                         # ranks 2-3: a second EP-2 group with no sample
    wl.loads_XMLSE[:, :, :, 2:] = 0
    assert compare_layouts(wl, cfg, (4,))
    with pytest.raises(ValueError) as exc:
        compare_layouts(wl, cfg, (2, 4))
    assert str(exc.value) == (f"--compare-ep 2: EP group 2 of 2 (ranks 2-3) holds no tokens in the measured steps "
                              f"({wl.source} is too small to fill every group of 2); drop 2 from --compare-ep, or "
                              f"use more samples")


def test_a_cluster_larger_than_the_expert_count_runs_as_data_parallel_groups():
    """16 GPUs, 8 experts: no whole-cluster topology; each row is the slowest of its groups,
    each simulated on its own group topology (dense state sharded over all 16 GPUs), plus the
    expert gradient sync over the groups."""
    wl, cluster = _workload(S=16, gpus_per_node=4), Cluster(4, 4)
    cfg = SimConfig(MODEL, HW, Topology(2, 4, 8, 1), ("static", "relibra", "uniform"), warmup_steps=1,
                    baseline_options=BaselineOptions(planning_overlap_s=1e9))  # the largest group's topology
    rows = compare_layouts(wl, cfg, (4, 8), cluster=cluster)
    assert [(r.ep_size, r.groups, r.system) for r in rows] == [
        (g, 16 // g, name) for g in (4, 8) for name in ("static", "relibra", "uniform", "bound")]
    tokens = float(wl.tokens_XMS[1:].sum())
    for g in (4, 8):
        group_cfg = SimConfig(MODEL, HW, Topology(max(1, g // 4), min(g, 4), 8, 1), cfg.systems, warmup_steps=1,
                              baseline_options=cfg.baseline_options, memory_world=16)
        steps = {}  # system -> [groups, X] step seconds
        for part in split_workload(wl, g):
            for name, res in simulate(part, group_cfg).systems.items():
                steps.setdefault(name, []).append([float(c.step_s) for c in res.costs])
        sync = expert_grad_sync_s(cfg, g, 16, 4)
        assert sync > 0
        for r in (r for r in rows if r.ep_size == g):
            slowest = float(torch.tensor(steps[r.system], dtype=torch.float64).max(0).values.mean())
            assert r.slowest_group_s == pytest.approx(slowest, rel=1e-12)
            assert r.grad_sync_s == pytest.approx(sync, rel=1e-12)
            assert r.tokens_per_gpu_s == pytest.approx(tokens / (16 * (slowest + sync)), rel=1e-12)
    with pytest.raises(ValueError, match="the trace has 4 ranks but the cluster 4 x 4 has 16 GPUs"):
        compare_layouts(_workload(), cfg, (4,), cluster=cluster)


def test_an_explicit_cluster_changes_nothing_where_the_gpus_divide_the_experts():
    """2 x 2 GPUs, 8 experts: the cluster given explicitly (with the largest group's topology
    in the config, as the CLI does when the experts do not divide the cluster) gives the rows
    of the whole-cluster topology, field for field."""
    import dataclasses
    wl, cfg = _workload(), _config(("static", "relibra", "eplb-oracle", "uniform"))
    old = compare_layouts(wl, cfg, (1, 2, 4))
    for topo in (Topology(1, 2, 8, 1), Topology(2, 2, 8, 1)):
        new = compare_layouts(wl, dataclasses.replace(cfg, topology=topo), (1, 2, 4), cluster=Cluster(2, 2))
        assert [(r.ep_size, r.groups, r.system) for r in new] == [(r.ep_size, r.groups, r.system) for r in old]
        for a, b in zip(old, new):
            for f in ("step_s", "slowest_group_s", "grad_sync_s", "tokens_per_gpu_s", "static_imbalance"):
                assert getattr(b, f) == pytest.approx(getattr(a, f), rel=1e-12, abs=0), (a, f)


MIXTRAL_2X8 = ["simulate", "--model-config", MIXTRAL, "--nodes", "2", "--gpus-per-node", "8", "--no-progress",
               "--systems", "static,eplb-oracle", "--micro-batches", "2", "--micro-batch-tokens", "128",
               "--steps", "2", "--ignore-memory"]


def test_cli_runs_mixtral_on_two_nodes_of_eight_as_ep_groups(tmp_path, capsys):
    path = tmp_path / "layouts.json"
    assert main([*MIXTRAL_2X8, "--compare-ep", "4,8", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("Mixtral-8x7B-v0.1 on 2 x 8 h200 (R=2), hierarchical dispatch")
    assert "at EP 8 on 1 x 8 h200 (one of 2 data-parallel EP groups" in captured.err  # the memory what-if
    doc = json.loads(path.read_text())
    assert doc["config"]["nodes"] == 2 and doc["config"]["gpus_per_node"] == 8
    systems = ("static", "eplb-oracle", "uniform", "bound")
    assert [(r["ep_size"], r["groups"], r["system"]) for r in doc["layouts"]] == [
        (g, 16 // g, name) for g in (4, 8) for name in systems]
    assert all(r["grad_sync_s"] > 0 for r in doc["layouts"])


@pytest.mark.parametrize("sizes, message", [
    ("16", "--compare-ep 16: an EP size must divide the 16 GPUs and the 8 experts and fill whole nodes of 8 or "
           "divide one; allowed: 1,2,4,8"),
    ("3", "--compare-ep 3: an EP size must divide the 16 GPUs and the 8 experts"),
])
def test_cli_bad_ep_size_on_a_cluster_larger_than_the_experts(capsys, sizes, message):
    assert main([*MIXTRAL_2X8, "--compare-ep", sizes]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"relibra simulate: error: {message}") and "\n" not in err


def test_cli_plain_run_on_a_cluster_larger_than_the_experts_names_compare_ep(capsys):
    assert main(MIXTRAL_2X8) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("relibra simulate: error: --nodes 2 x --gpus-per-node 8 = 16 GPUs does not divide the 8 experts "
                   "of Mixtral-8x7B-v0.1; allowed EP sizes: 1, 2, 4, 8; e.g. --nodes 1 --gpus-per-node 8; or keep "
                   "the 16 GPUs as 2 data-parallel EP groups: --compare-ep 8 (sizes: 1,2,4,8)")


def test_memory_check_of_an_ep_group_shards_dense_state_over_the_cluster_and_never_suggests_nodes():
    """The check before planning at EP 8 on 2 x 8 GPUs (``world=16``): the dense optimizer
    state is sharded over all 16 GPUs, so less is needed than at EP 8 alone; the fixes leave
    out ``--nodes`` (it adds groups, not EP size) and, with none in reach, name --compare-ep."""
    import dataclasses
    import re

    from relibra_torch.sim.hf_config import model_from_hf_config
    from relibra_torch.sim.memory import MemoryOptions
    from relibra_torch.sim.memory_fit import precheck
    model, topo, o = model_from_hf_config(MIXTRAL).spec, Topology(1, 8, 8, 2), MemoryOptions()
    alone, grouped = precheck(model, topo, HW, o, True), precheck(model, topo, HW, o, True, world=16)
    assert alone and grouped and "\n" not in grouped

    def need(text):
        return float(re.search(r"needs ([\d.]+) GB per GPU", text).group(1))
    assert need(grouped) < need(alone)
    assert "Mixtral-8x7B-v0.1 at EP 8 on 1 x 8 h200 (one of 2 data-parallel EP groups, R=2) needs" in grouped
    assert "--nodes" not in grouped and "--replica-slots" in grouped
    small = precheck(model, topo, dataclasses.replace(HW, hbm_gb=20.0), o, True, world=16)
    assert ("nothing in reach by one or two of --set memory.shard, --replica-slots, the tokens; a larger "
            "--compare-ep size spreads the experts over more GPUs") in small


def test_cli_routing_file_on_a_cluster_larger_than_the_experts(tmp_path, capsys):
    """A replay file batched over all 16 ranks, checked for memory at EP 8 (no --ignore-memory)."""
    from _replay_helpers import offsets_from_lengths, random_ids_TLK

    from relibra_torch.replay import save_routing
    lengths = [24 + 8 * (i % 5) for i in range(32)]
    f = tmp_path / "mixtral.safetensors"
    save_routing(str(f), random_ids_TLK(sum(lengths), 32, 2, 8, seed=3, skew=0.4), offsets_from_lengths(lengths), 8)
    argv = ["simulate", str(f), "--model-config", MIXTRAL, "--nodes", "2", "--gpus-per-node", "8", "--no-progress",
            "--systems", "static,eplb-oracle", "--micro-batches", "1", "--replica-slots", "0", "--compare-ep", "8"]
    path = tmp_path / "layouts.json"
    assert main([*argv, "--json", str(path)]) == 0, capsys.readouterr().err
    doc = json.loads(path.read_text())
    assert [(r["ep_size"], r["groups"]) for r in doc["layouts"]] == [(8, 2)] * 4
    assert doc["config"]["source"].startswith("routing replay mixtral.safetensors (32 samples)")
