"""The Load-Imbalance Score: hand-computed cases, `relibra inspect`, evaluate and the
simulator JSON (once per run, not per system).

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, K top-k.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from _replay_helpers import offsets_from_lengths

from relibra_torch.cli import main
from relibra_torch.planning import Topology, evaluate, lis, lis_summary, static_plan
from relibra_torch.replay import save_loads, save_routing


def test_lis_hand_computed():
    # 6 tokens, top-2, 4 experts: 12 pairs, equal share 12 / 4 = 3; max 6 -> LIS 2.
    assert lis(torch.tensor([6, 3, 2, 1])).item() == 2.0
    assert lis(torch.tensor([6, 3, 2, 1]), num_tokens=6, top_k=2).item() == 2.0
    # Perfect balance is 1; everything on one expert is m / k (here 4 / 2 = 2 with n=3, k=2:
    # each token can put one pair there): counts [3, 1, 1, 1] -> 3 / (3*2/4) = 2.
    assert lis(torch.tensor([3, 3, 3, 3])).item() == 1.0
    assert lis(torch.tensor([3, 1, 1, 1]), 3, 2).item() == 2.0
    # Pads: 4 tokens x top-2 declared, only 6 pairs counted: share 8 / 4 = 2, max 3 -> 1.5;
    # without num_tokens the share is 6 / 4 -> 2.
    assert lis(torch.tensor([3, 2, 1, 0]), 4, 2).item() == 1.5
    assert lis(torch.tensor([3, 2, 1, 0])).item() == 2.0
    # Leading dims are kept; an empty row is nan and the summary skips it.
    v = lis(torch.tensor([[[4, 0], [1, 1]], [[0, 0], [2, 6]]]))
    assert v.shape == (2, 2)
    assert v[0, 0] == 2.0 and v[0, 1] == 1.0 and math.isnan(v[1, 0]) and v[1, 1] == 1.5
    assert lis_summary(v) == {"lis_mean": pytest.approx(1.5), "lis_max": 2.0}
    assert lis_summary(torch.tensor([float("nan")])) == {"lis_mean": None, "lis_max": None}
    with pytest.raises(ValueError, match="top_k"):
        lis(torch.tensor([1, 2]), num_tokens=3)


def test_evaluate_carries_lis_of_the_loads():
    loads_MLSE = torch.tensor([[[[4, 0, 0, 0], [0, 0, 2, 2]]], [[[1, 1, 1, 1], [1, 1, 1, 1]]]])
    m = evaluate(static_plan(loads_MLSE, Topology(1, 2, 4, 0)), loads_MLSE)
    # micro-batch 0: experts [4, 0, 2, 2], share 2 -> 2.0; micro-batch 1: all 2 -> 1.0
    assert m.lis_ML.tolist() == [[2.0], [1.0]]


def test_inspect_prints_lis_per_layer_with_mean_and_max(tmp_path, capsys):
    # 4 tokens, top-1, 4 experts, 2 layers: layer 0 all on expert 0 (LIS 4), layer 1 even (1).
    ids = torch.tensor([[[0], [0]], [[0], [1]], [[0], [2]], [[0], [3]]])
    path = tmp_path / "r.safetensors"
    save_routing(path, ids, offsets_from_lengths([4]), 4)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"layer\s+max load\s+mean load\s+LIS\s+uniform", out)
    assert re.search(r"\n\s+0\s+4\s+1\.0\s+4\.000\s", out) and re.search(r"\n\s+1\s+1\s+1\.0\s+1\.000\s", out)
    assert "all layers: LIS mean 2.500, max 4.000 (layer 0)" in out

    loads = torch.zeros(1, 2, 1, 1, 4, dtype=torch.int64)  # X=1, M=2, L=1, S=1
    loads[0, 0, 0, 0] = torch.tensor([3, 1, 0, 0])  # 4 tokens top-1: LIS 3
    loads[0, 1, 0, 0] = torch.tensor([1, 1, 1, 1])  # LIS 1
    lpath = tmp_path / "l.safetensors"
    save_loads(str(lpath), loads, 1)
    assert main(["inspect", str(lpath)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"layer\s+mean LIS\s+max LIS\s+uniform", out)
    assert re.search(r"\n\s+0\s+2\.000\s+3\.000\s", out)
    assert "all layers: LIS mean 2.000, max 3.000" in out


def test_simulator_json_has_lis_once_per_run(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    X, M, L, S, E, K = 2, 2, 48, 4, 128, 8  # qwen3-30b-a3b shapes (a preset gives the dims)
    scores = torch.rand(X, M, L, S, 16, E, generator=g)
    scores[..., 0] += 0.5  # a hot expert
    picks = scores.topk(K, dim=-1).indices.flatten(-2)  # 16 tokens per source, top-8 distinct
    loads = torch.zeros(X, M, L, S, E, dtype=torch.int64).scatter_add_(-1, picks, torch.ones_like(picks))
    f = tmp_path / "loads.safetensors"
    save_loads(str(f), loads, K)
    rc = main(["simulate", str(f), "--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--warmup-steps", "1", "--ignore-memory",
               "--systems", "static,relibra", "--json", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "r.json").read_text())
    want = lis(loads[1:].sum(3))  # measured step only, summed over source ranks
    assert doc["lis_mean"] == pytest.approx(float(want.mean())) and doc["lis_max"] == pytest.approx(float(want.max()))
    for system in doc["systems"].values():
        assert "lis_mean" not in system and "lis_max" not in system
