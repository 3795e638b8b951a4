"""`relibra simulate` on files that hold fewer samples than the requested batching needs.

A replay file is batched into ranks and micro-batches; when a rank has fewer samples than
--micro-batches, the extra micro-batches hold no tokens. Their imbalance (1.0 by definition)
must not dilute the figures: the micro-batch count is fitted to the file (and the run says
so), and micro-batches with no tokens are left out of the imbalance mean and percentiles.

Shapes: qwen3-30b-a3b dims (48 layers, 128 experts, top-8) on 1 node x 4 GPUs, or a
Mixtral-shaped file (32 layers, top-2 of 8) on 1 x 8; each run takes about a second.
Legend: X steps, M micro-batches, L layers, S source ranks, E experts, N samples.
"""

from __future__ import annotations

import json
import os

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from _replay_helpers import offsets_from_lengths, random_ids_TLK

from relibra_torch.cli import main
from relibra_torch.replay import batch_samples, save_loads, save_routing
from relibra_torch.sim.workload import fit_micro_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# planning.overlap_s: the toy model's forward pass cannot hide host planning, whose measured CPU
# time varies run to run; these tests compare step times of two runs exactly
SMALL = ["--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--ignore-memory", "--systems", "static,relibra",
         "--set", "planning.overlap_s=1e9"]


def routing_file(path, lengths, layers=48, top_k=8, experts=128):
    ids = random_ids_TLK(sum(lengths), layers, top_k, experts, seed=1, skew=0.5)
    save_routing(str(path), ids, offsets_from_lengths(lengths), experts)


def simulate_json(tmp_path, capsys, *argv) -> dict:
    out = tmp_path / "r.json"
    rc = main(["simulate", *argv, "--json", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    return json.loads(out.read_text())


def test_a_32_sample_file_is_not_averaged_over_empty_micro_batches(tmp_path, capsys):
    # 32 samples on 4 ranks: about 8 per rank (greedy by tokens), so at most 8 micro-batches hold tokens
    f = tmp_path / "r.safetensors"
    routing_file(f, [int(x) for x in torch.randint(20, 60, (32,), generator=torch.Generator().manual_seed(0))])
    default = simulate_json(tmp_path, capsys, str(f), *SMALL)  # --micro-batches 32 by default
    M = default["config"]["micro_batches"]
    assert 6 <= M <= 8 and default["config"]["empty_micro_batches"] == 0
    fitting = simulate_json(tmp_path, capsys, str(f), *SMALL, "--micro-batches", str(M))
    assert "not 32" in default["config"]["notes"]["micro-batches"]
    assert "micro-batches" not in fitting["config"]["notes"]  # 8 fits: nothing to say
    for name in ("static", "relibra"):
        for key in ("imbalance_mean", "imbalance_p50", "imbalance_p99", "step_time_s"):
            assert default["systems"][name][key] == fitting["systems"][name][key], (name, key)
    assert default["systems"]["static"]["imbalance_mean"] > 1.2  # the skewed routing shows


def test_one_sample_per_rank_is_one_micro_batch(tmp_path, capsys):
    f = tmp_path / "r.safetensors"
    routing_file(f, [40, 50, 30, 60])
    default = simulate_json(tmp_path, capsys, str(f), *SMALL)
    one = simulate_json(tmp_path, capsys, str(f), *SMALL, "--micro-batches", "1")
    assert default["config"]["micro_batches"] == 1 and default["config"]["empty_micro_batches"] == 0
    assert default["systems"]["static"]["imbalance_mean"] == one["systems"]["static"]["imbalance_mean"]
    assert default["systems"]["static"]["imbalance_mean"] > 1.2


def test_mixtral_shaped_file_with_fewer_samples_than_ranks_says_so(tmp_path, capsys):
    f = tmp_path / "r.safetensors"
    routing_file(f, [31, 38], layers=32, top_k=2, experts=8)
    cfg = os.path.join(ROOT, "tests", "fixtures", "hf_configs", "Mixtral-8x7B-v0.1", "config.json")
    doc = simulate_json(tmp_path, capsys, str(f), "--model-config", cfg, "--nodes", "1", "--gpus-per-node", "8",
                        "--no-progress", "--replica-slots", "0", "--systems", "static")  # R = 2 does not fit
    notes = doc["config"]["notes"]
    assert doc["config"]["micro_batches"] == 1 and "not 32" in notes["micro-batches"]
    assert notes["idle ranks"].startswith("6 of 8 ranks hold no sample")
    assert doc["config"]["empty_micro_batches"] == 0


def test_empty_micro_batches_of_a_loads_file_are_reported_and_left_out(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    picks = (torch.rand(1, 2, 48, 4, 64, 128, generator=g) + 0.4 * torch.linspace(1, 0, 128)).topk(8, -1).indices
    loads = torch.zeros(1, 2, 48, 4, 128, dtype=torch.int64)
    loads.scatter_add_(-1, picks.flatten(-2), torch.ones_like(picks.flatten(-2)))
    save_loads(str(tmp_path / "full.safetensors"), loads, 8)
    padded = torch.cat([loads, torch.zeros_like(loads)], 1)  # a trailing empty micro-batch on every rank
    save_loads(str(tmp_path / "padded.safetensors"), padded, 8)
    full = simulate_json(tmp_path, capsys, str(tmp_path / "full.safetensors"), *SMALL)
    pad = simulate_json(tmp_path, capsys, str(tmp_path / "padded.safetensors"), *SMALL)
    assert pad["config"]["empty_micro_batches"] == 2 and full["config"]["empty_micro_batches"] == 0
    assert "2 of 4 measured micro-batches hold no tokens" in pad["config"]["notes"]["empty micro-batches"]
    for key in ("imbalance_mean", "imbalance_p50", "imbalance_p99", "imbalance_max"):
        assert pad["systems"]["static"][key] == full["systems"]["static"][key], key


def test_a_loads_file_without_tokens_in_its_measured_steps_is_refused(tmp_path, capsys):
    # (serve-sim refuses such a file too; simulated, every step costs nothing and the speedups say nothing)
    g = torch.Generator().manual_seed(0)
    picks = (torch.rand(2, 2, 48, 4, 64, 128, generator=g) + 0.4 * torch.linspace(1, 0, 128)).topk(8, -1).indices
    loads = torch.zeros(2, 2, 48, 4, 128, dtype=torch.int64)
    loads.scatter_add_(-1, picks.flatten(-2), torch.ones_like(picks.flatten(-2)))
    cases = {"zeros": (torch.zeros_like(loads), "holds no tokens\n"),
             "warm-up only": (torch.cat([loads[:1], torch.zeros_like(loads[1:])]),
                              "holds no tokens in its measured step 1 (after --warmup-steps=1); "
                              "pass fewer --warmup-steps\n")}
    for name, (tensor, said) in cases.items():
        f = tmp_path / f"{name.replace(' ', '-')}.safetensors"
        save_loads(str(f), tensor, 8)
        rc = main(["simulate", str(f), *SMALL])
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if "error:" in line]  # (--ignore-memory warns too)
        assert rc == 2 and len(errors) == 1, (name, err)
        assert err.endswith(f"relibra simulate: error: loads file {f.name} {said}"), (name, err)
    # the same warm-up-only file measured from step 0 runs; its empty step is noted, as before
    doc = simulate_json(tmp_path, capsys, str(tmp_path / "warm-up-only.safetensors"), *SMALL, "--warmup-steps", "0")
    assert doc["config"]["empty_micro_batches"] == 2


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40), ranks=st.integers(1, 8),
       requested=st.integers(1, 40))
def test_fitted_micro_batches_never_exceed_a_ranks_samples(lengths, ranks, requested):
    lengths_N = torch.tensor(lengths)
    M, notes = fit_micro_batches([lengths_N], ranks, requested)
    per_rank = torch.bincount(batch_samples(lengths_N, ranks, num_micro_batches=M).rank_N, minlength=ranks)
    assert 1 <= M <= requested
    assert M <= max(1, int(per_rank.min()))
    assert M == requested or M == max(1, int(per_rank.min()))
    assert ("micro-batches" in notes) == (M < requested)
    assert ("idle ranks" in notes) == bool((per_rank == 0).any())
