"""EP layout comparison (``relibra simulate --compare-ep``): splitting, gradient sync, rows.

Tiny shapes (2 nodes x 2 GPUs, 8 experts, 2 layers) keep this to a few seconds.
Legend: X steps, M micro-batches, L layers, S source ranks, E experts.
"""

from __future__ import annotations

import json

import pytest
import torch

from relibra_torch.cli import main
from relibra_torch.planning import Topology
from relibra_torch.sim import SimConfig, get_hardware, simulate, workload_from_loads
from relibra_torch.sim.layouts import (GRAD_SYNC_BYTES_PER_PARAM, compare_layouts, expert_grad_sync_s, headline,
                                       parse_ep_sizes, split_workload)
from relibra_torch.sim.baselines import BaselineOptions
from relibra_torch.sim.presets import ModelSpec

MODEL = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                  num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)
HW = get_hardware("h200")


def _workload(S=4, X=2, M=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.rand(X, M, 2, 1, 8, generator=g) ** 3 + 0.01).expand(X, M, 2, S, 8).reshape(-1, 8)
    picks = torch.multinomial(w, 256, replacement=True, generator=g)
    loads = torch.zeros_like(w, dtype=torch.int64).scatter_add_(1, picks, torch.ones_like(picks)).view(X, M, 2, S, 8)
    return workload_from_loads(loads, MODEL, Topology(S // 2, 2, 8, 1), 128)


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
