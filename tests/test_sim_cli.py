"""`relibra simulate`: files, JSON/PNG outputs, config precedence and one-line bad-input errors.

Shapes: qwen3-30b-a3b (48 layers, 128 experts, top-8) on 1 node x 4 GPUs, a few hundred
tokens per micro-batch, so each run takes about a second (the synthetic one longer: the
trace generator calibrates once per process).
Legend: X steps, M micro-batches, L layers, S source ranks, E experts, T tokens, K top-k.
"""

from __future__ import annotations

import json

import pytest
import torch
from _replay_helpers import offsets_from_lengths, random_ids_TLK

from relibra_torch.cli import main
from relibra_torch.replay import save_loads, save_routing

L, E, K = 48, 128, 8


def loads_file(path, S=4, M=2, X=1, tokens=64, top_k=K, experts=E, layers=L, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(X, M, layers, S, tokens, experts, generator=g) ** 0.3
    scores[..., : experts // 8] += 0.3  # a few hot experts
    picks = scores.topk(top_k, dim=-1).indices
    loads = torch.zeros(X, M, layers, S, experts, dtype=torch.int64)
    loads.scatter_add_(-1, picks.flatten(-2), torch.ones_like(picks.flatten(-2)))
    save_loads(str(path), loads, top_k)
    return loads


def _raw_loads(path, loads):
    """A loads file written without ``save_loads``' checks (a malformed one)."""
    from safetensors.torch import save_file
    save_file({"loads": loads.contiguous()}, str(path), {"format": "relibra.loads/1", "top_k": str(K)})


def routing_file(path, top_k=K, experts=E, layers=L, lengths=(30, 50, 20, 40, 60, 10, 25, 35), steps=None):
    ids = random_ids_TLK(sum(lengths), layers, top_k, experts, seed=1, skew=0.5)
    save_routing(str(path), ids, offsets_from_lengths(lengths), experts, sample_step=steps)


# qwen3-30b-a3b needs about 147 GB per GPU on 4 GPUs (docs/simulator.md, "Memory"): these
# tests are about files and options, so they run it as a what-if
SMALL = ["--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--ignore-memory"]


def run(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_loads_file_json_and_plot(tmp_path, capsys):
    f = tmp_path / "loads.safetensors"
    loads_file(f)
    rc, out, err = run(capsys, str(f), *SMALL, "--systems", "relibra",
                       "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"))
    assert rc == 0, err
    assert "relibra" in out and "static" in out and "uniform" in out and "bound" in out and "eplb " not in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["ep_size"] == 4 and doc["config"]["micro_batches"] == 2
    assert doc["config"]["file"] == str(f) and doc["config"]["warmup_steps"] == 0
    assert doc["config"]["notes"]["sample_tokens_assumed"] == 4096
    assert "plan it from uniform history" in doc["config"]["notes"]["warm-up"]  # a one-step file
    assert set(doc["systems"]) == {"static", "relibra", "uniform", "bound"}
    for key in ("imbalance_mean", "imbalance_p99", "step_time_s", "speedup_vs_static", "fraction_of_bound", "fraction_of_uniform",
                "cross_node_bytes", "replica_bytes", "migrated_experts", "planner_s"):
        assert isinstance(doc["systems"]["relibra"][key], (int, float))
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_routing_file_is_batched_with_known_sample_lengths(tmp_path, capsys):
    f = tmp_path / "routing.safetensors"
    routing_file(f, steps=[0, 0, 0, 0, 1, 1, 1, 1])
    rc, out, err = run(capsys, str(f), *SMALL, "--micro-batches", "1", "--systems", "static",
                       "--warmup-steps", "1", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["steps"] == 2 and doc["config"]["measured_steps"] == 1
    assert doc["config"]["notes"] == {}  # attention pairs from the real sample lengths
    assert "routing replay" in doc["config"]["source"]


def test_synthetic_default_trace(tmp_path, capsys):
    rc, out, err = run(capsys, *SMALL, "--micro-batches", "2", "--micro-batch-tokens", "256",
                       "--steps", "2", "--systems", "static,eplb,relibra", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["warmup_steps"] == 1 and doc["config"]["seed"] == 0
    assert "synthetic RL trace" in doc["config"]["source"]
    assert doc["systems"]["static"]["imbalance_mean"] > 1.0


def test_config_file_and_set_precedence(tmp_path, capsys):
    f = tmp_path / "loads.safetensors"
    loads_file(f)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"hardware": {"preset": "h100", "nvlink_gbps": 200},
                               "simulate": {"nodes": 2, "gpus_per_node": 2, "systems": "static",
                                            "ignore_memory": True}}))
    rc, out, err = run(capsys, str(f), "--config", str(cfg), "--nodes", "1", "--gpus-per-node", "4",
                       "--set", "hardware.inter_node_gbps=20", "--no-progress", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    c = json.loads((tmp_path / "r.json").read_text())["config"]
    assert c["nodes"] == 1 and c["gpus_per_node"] == 4  # command line beats the file
    assert c["hardware"]["name"] == "h100" and c["hardware"]["nvlink_gbps"] == 200.0
    assert c["hardware"]["inter_node_gbps"] == 20.0
    assert c["systems"] == ["static", "uniform", "bound"]


@pytest.mark.parametrize("make,argv,match", [
    (lambda p: loads_file(p, experts=64), ["--model", "qwen3-30b-a3b"], r"disagrees with --model qwen3-30b-a3b: "
                                                                        r"num_experts 64 \(model: 128\)"),
    (lambda p: loads_file(p, top_k=4), ["--model", "qwen3-30b-a3b"], r"top_k 4 \(model: 8\); fix with"),
    (lambda p: loads_file(p, layers=47), ["--model", "qwen3-30b-a3b"], r"MoE layers 47 \(model: 48\)"),
    (lambda p: loads_file(p, S=2), [], r"batched for 2 ranks but --nodes x --gpus-per-node = 4"),
    # a file broken in itself says so before it is compared with the model (whose fix would not help)
    (lambda p: _raw_loads(p, -torch.ones(1, 2, 3, 4, 64, dtype=torch.int64)), ["--model", "qwen3-30b-a3b"],
     r"loads\[0, 0, 0, 0, 0\] = -1; allowed: counts"),
    (lambda p: _raw_loads(p, torch.ones(1, 2, 3, 4, 64)), ["--model", "qwen3-30b-a3b"],
     r"loads has dtype float32; allowed: int32 or int64"),
    (lambda p: routing_file(p, top_k=6), [], r"top_k=6.*nothing gives the model's dims; pass --model-config"),
    (lambda p: routing_file(p, experts=64), ["--model", "qwen3-30b-a3b"], r"num_experts 64 \(model: 128\).*"
                                                                           r"--set model.num_experts=64"),
    (lambda p: routing_file(p), ["--model", "glm-4.5-air"], r"MoE layers 48 \(model: 45\); fix with .*--model "
     r"qwen3-30b-a3b or --set model.num_moe_layers=48 --set model.num_layers=49"),
    (None, ["--nodes", "0"], r"--nodes = 0; allowed: an int >= 1"),
    (routing_file, ["--nodes", "3"], r"--nodes 3 x --gpus-per-node 4 = 12 GPUs does not divide the 128 experts.*"
                                     r"allowed EP sizes: 1, 2, 4, 8, 16, 32, 64, 128; e.g. --nodes 2 --gpus-per-node 4"),
    (None, ["--replica-slots", "-1"], r"--replica-slots = -1; allowed: an int >= 0"),
    (None, ["--set", "hardware.nvlink_gbps=-3"], r"hardware.nvlink_gbps = -3.0; allowed: a finite number > 0"),
    (None, ["--set", "hardware.inter_node_gbps=0"], r"hardware.inter_node_gbps = 0.0; allowed: a finite number > 0"),
    (None, ["--set", "hardware.inter_node_gbps=1e-300"], r"hardware.inter_node_gbps = 1e-300; allowed: a finite "
                                                          r"number >= 1e-12"),
    (None, ["--config", "."], r"^relibra simulate: error: \.: is a directory$"),
    (None, ["--model", "mixtral"], r"--model 'mixtral' is unknown; choose one of qwen3-30b-a3b"),
    (None, ["--systems", "static,megatron"], r"--systems has unknown megatron; allowed"),
    (None, ["--micro-batches", "0"], r"--micro-batches = 0; allowed: an int >= 1"),
    (None, ["--warmup-steps", "2", "--ignore-memory"], r"--warmup-steps 2 leaves no measured step"),
    (None, ["--steps", "3"], r"--steps shapes the synthetic trace; it does not apply to the file .*\(drop it or "),
    (None, ["--seed", "1", "--micro-batch-tokens", "64"], r"--micro-batch-tokens, --seed shape the synthetic trace; "
                                                          r"they do not apply to the file"),
    (None, ["--micro-batches", "5"], r"--micro-batches 5 does not apply to the loads file .*which holds 2 "
                                     r"micro-batches per step \(drop --micro-batches"),
    (lambda p: _raw_loads(p, torch.ones(1, 2, 48, 4, 128, dtype=torch.int64)[0]),
     ["--model", "qwen3-30b-a3b"], r"loads has shape \[2, 48, 4, 128\]; allowed: \[steps, micro_batches, num_layers, "
                                   r"source_ranks, num_experts\]"),
    (lambda p: _raw_loads(p, torch.full((1, 1, 48, 4, 128), 2**50, dtype=torch.int64)),
     ["--model", "qwen3-30b-a3b"], r"loads\[0, 0, 0, 0, 0\] = 1125899906842624; allowed: counts in \[0, 2\*\*40\]"),
    (None, ["--trace", "collapsed", "--steps", "2", "--set", "trace.skew=0.5"],
     r"--trace collapsed, --steps, --set trace.skew=0.5 shape the synthetic trace; they do not apply to the file "
     r".*which holds its own routing, steps and tokens \(drop them or the file\)"),
])
def test_bad_input_is_one_line_with_exit_code_2(tmp_path, capsys, make, argv, match):
    f = tmp_path / "in.safetensors"
    if make is not None:
        make(f)
    else:
        loads_file(f)
    rc, out, err = run(capsys, str(f), "--nodes", "1", "--gpus-per-node", "4", "--no-progress", *argv)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("relibra simulate: error: ")
    import re
    assert re.search(match, lines[0]), lines[0]


def test_missing_file_and_wrong_format(tmp_path, capsys):
    rc, _, err = run(capsys, str(tmp_path / "nope.safetensors"), *SMALL)
    assert rc == 2 and "does not exist" in err
    bad = tmp_path / "x.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    rc, _, err = run(capsys, str(bad), *SMALL)
    assert rc == 2 and len(err.strip().splitlines()) == 1


def test_a_step_that_is_mostly_migration_says_so(tmp_path, capsys):
    """A one-step, one-micro-batch file: eplb plans it from uniform history and moves most
    experts, whose migration the single short step pays; the report names it (not a balance
    figure), and names no system where the step is mostly balance and all-to-all."""
    f = tmp_path / "loads.safetensors"
    loads_file(f, M=1)
    rc, out, err = run(capsys, str(f), *SMALL, "--systems", "static,eplb", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    doc = json.loads((tmp_path / "r.json").read_text())
    eplb = doc["systems"]["eplb"]
    assert eplb["migration_s"] > 0.25 * eplb["step_time_s"]
    note = doc["config"]["notes"]["migration"]
    assert note.startswith("moving experts to a new placement is most of the step for eplb ") and "static" not in note
    assert "migration: moving experts" in out
    from relibra_torch.sim.report import migration_note
    assert migration_note({"static": {"migration_s": 0.0, "step_time_s": 1.0},
                           "x": {"migration_s": 0.25, "step_time_s": 1.0}}, 8) == ""


def test_a_synthetic_run_without_warm_up_says_so(tmp_path, capsys):
    """``--steps 1`` (or ``--warmup-steps 0``): the measured step is the first, planned from
    uniform history, as a one-step file's note says."""
    rc, out, err = run(capsys, *SMALL, "--steps", "1", "--micro-batches", "1", "--micro-batch-tokens", "64",
                       "--systems", "static", "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    note = json.loads((tmp_path / "r.json").read_text())["config"]["notes"]["warm-up"]
    assert note.startswith("none: the first step is measured") and "warm-up: none" in out
    rc, out, err = run(capsys, *SMALL, "--steps", "2", "--micro-batches", "1", "--micro-batch-tokens", "64",
                       "--systems", "static", "--json", str(tmp_path / "r2.json"))
    assert rc == 0 and "warm-up" not in json.loads((tmp_path / "r2.json").read_text())["config"]["notes"]


def test_replica_slots_count_against_memory_only_for_systems_that_fill_them(capsys):
    """Static fills no replica slot, nor do the references the simulator always adds (uniform,
    bound): a static-only run is not refused for slots it never uses; with relibra it is."""
    from relibra_torch.sim.memory import replicating
    from relibra_torch.sim.simulator import parse_systems

    assert not replicating(parse_systems("static"))
    assert replicating(parse_systems("static,eplb")) and replicating(parse_systems("relibra"))
    common = ("--nodes", "2", "--micro-batches", "1", "--steps", "2", "--micro-batch-tokens", "256",
              "--replica-slots", "70", "--no-progress")
    rc, _, err = run(capsys, *common, "--systems", "static,relibra")
    assert rc == 2 and "replica slots" in err and "fix: --replica-slots" in err
    rc, out, err = run(capsys, *common, "--systems", "static")
    assert rc == 0, err
    assert "static" in out


@pytest.mark.parametrize("how,message", [
    ("set", "--set model.num_experts = 100000; allowed: an int in [2, 32767] with the synthetic trace (it stores "
            "expert ids as int16); for more experts pass a routing replay or loads file"),
    ("hf", "--model-config '{path}': num_experts = 100000; allowed: an int in [2, 32767] with the synthetic trace"),
    ("toml", "--config '{path}': [model] num_experts = 100000; allowed: an int in [2, 32767] with the synthetic "
             "trace"),
])
def test_an_expert_count_past_the_synthetic_trace_names_the_users_field(tmp_path, capsys, how, message):
    """Refused as the model is read, under the field the user wrote (never TraceConfig's), and
    before the memory check, whose --nodes advice would only lead to this refusal."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    path = tmp_path / ("c.toml" if how == "toml" else "olmoe.json")
    if how == "hf":
        cfg = json.loads((root / "tests/fixtures/hf_configs/OLMoE-1B-7B-0924/config.json").read_text())
        path.write_text(json.dumps({**cfg, "num_experts": 100000}))
    elif how == "toml":
        path.write_text('[model]\nnum_experts = 100000\n')
    argv = {"set": ["--set", "model.num_experts=100000"], "hf": ["--model-config", str(path)],
            "toml": ["--config", str(path)]}[how]
    rc, _, err = run(capsys, *argv, "--no-progress")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert message.format(path=path) in err and "TraceConfig" not in err and "GB per GPU" not in err, err


@pytest.mark.parametrize("name,text,message", [
    ("c.toml", '[model]\nnum_experts = "64"\n', "[model] num_experts = '64' is a string; allowed: a number, written "
                                                "without quotes (num_experts = 64)"),
    ("c.json", '{"hardware": {"nvlink_gbps": "300"}}', "[hardware] nvlink_gbps = '300' is a string; allowed: a "
                                                       "number, written without quotes"),
])
def test_config_file_numbers_written_as_strings_are_refused(tmp_path, capsys, name, text, message):
    """Only --set parses text; a config file (TOML or JSON) holds numbers as numbers."""
    cfg = tmp_path / name
    cfg.write_text(text)
    rc, _, err = run(capsys, "--config", str(cfg), "--no-progress")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--config '{cfg}': {message}" in err, err


def test_trace_skew_range_reads_as_an_interval(capsys):
    rc, _, err = run(capsys, "--set", "trace.skew=-1", "--no-progress")
    assert rc == 2 and err.strip().endswith("--set trace.skew = -1.0; allowed: a finite number in [0, 4]"), err


def test_config_values_are_named_where_they_came_from(tmp_path, capsys):
    """A bad value from ``--config`` names the file's key, not a flag the user never passed; a
    TOML list of systems reads as the comma-separated option; a config file not named .toml is
    read as JSON, and the error says so."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[simulate]\nnodes = "2"\n')
    rc, _, err = run(capsys, "--config", str(cfg), "--no-progress")
    assert rc == 2 and "--config [simulate] nodes is str '2'" in err
    rc, _, err = run(capsys, "--config", str(cfg), "--nodes", "0", "--no-progress")
    assert rc == 2 and "--nodes = 0" in err                               # the flag wins and is named
    cfg.write_text('[simulate]\nsystems = ["static", "relibra"]\nsteps = 2\nmicro_batches = 1\n'
                   'micro_batch_tokens = 64\nnodes = 1\ngpus_per_node = 4\n')
    rc, out, err = run(capsys, "--config", str(cfg), "--no-progress", "--ignore-memory", "--json",
                       str(tmp_path / "r.json"))
    assert rc == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["config"]["systems"] == ["static", "relibra", "uniform",
                                                                                   "bound"]
    toml_text = tmp_path / "c.tml"
    toml_text.write_text('[simulate]\nnodes = 2\n')
    rc, _, err = run(capsys, "--config", str(toml_text), "--no-progress")
    assert rc == 2 and "is not valid JSON" in err and "a file not named .toml is read as JSON" in err


def test_a_json_write_that_fails_after_the_run_names_the_option(tmp_path, monkeypatch):
    """Past the checks before the run (a full disk, ``/proc``): one line naming ``--json``,
    the file that was there untouched and no temporary file left (the write is atomic)."""
    import builtins

    from relibra_torch.sim import report

    target = tmp_path / "r.json"
    target.write_text('{"before": 1}\n')
    real_open = builtins.open

    def full_disk(path, mode="r", *a, **kw):   # the temporary file beside r.json cannot be filled
        if "r.json" in str(path) and "w" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)
    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(ValueError, match=r"^--json '.*r\.json' cannot be written: No space left on device"):
        report.write_json({"a": 1}, str(target))
    monkeypatch.setattr(builtins, "open", real_open)
    assert target.read_text() == '{"before": 1}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    report.write_json({"a": 1}, str(target))                 # and a write that works replaces it
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(ValueError, match="Out of range float"):   # a non-finite number: nothing written
        report.write_json({"a": float("inf")}, str(target))
    assert json.loads(target.read_text()) == {"a": 1}


def test_the_docs_example_config_runs(tmp_path, capsys):
    """docs/simulator.md's example config file is accepted as written (its model fits its
    cluster's memory); only the run's size is cut on the command line, which wins."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "simulator.md").read_text()
    example = text.split("```toml\n", 1)[1].split("```", 1)[0]
    cfg = tmp_path / "example.toml"
    cfg.write_text(example)
    rc, out, err = run(capsys, "--config", str(cfg), "--no-progress", "--steps", "2", "--micro-batches", "1",
                       "--micro-batch-tokens", "64", "--systems", "static,relibra")
    assert rc == 0, err
    assert "relibra" in out
