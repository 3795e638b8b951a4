"""`relibra simulate` on a user's own model and file: --model-config, dims for a file, one
error for every mismatch (naming the flags that fix it), time units, warm-up for files.

Fixtures: tests/fixtures/hf_configs/*/config.json (public configs' fields). Files are small
(a few hundred tokens) and runs use 1 node x 4 GPUs and only the static system (plus
ideal), so each run is about a second.
Legend: T tokens, L MoE layers, K top-k, E experts, S source ranks.
"""

from __future__ import annotations

import json
import os
import re

import pytest
from _replay_helpers import offsets_from_lengths, random_ids_TLK

from relibra_torch.cli import build_parser, main
from relibra_torch.replay import save_routing
from relibra_torch.sim import cli as sim_cli
from relibra_torch.sim.hf_config import model_from_hf_config, moe_layer_map
from relibra_torch.sim.presets import MODELS
from relibra_torch.sim.report import format_seconds

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf_configs")
# full-size models on a few GPUs do not fit the memory model (docs/simulator.md, "Memory"):
# these tests are about other things, so they run as what-ifs
SMALL = ["--nodes", "1", "--gpus-per-node", "4", "--no-progress", "--systems", "static", "--ignore-memory"]

# name: (model_type, layers, MoE layers, E, K, expert width, shared experts, expert groups)
EXPECTED = {
    "Qwen3-30B-A3B": ("qwen3_moe", 48, 48, 128, 8, 768, 0, 1),
    "Qwen1.5-MoE-A2.7B": ("qwen2_moe", 24, 24, 60, 4, 1408, 1, 1),
    "DeepSeek-V2-Lite": ("deepseek_v2", 27, 26, 64, 6, 1408, 2, 1),
    "DeepSeek-V3": ("deepseek_v3", 61, 58, 256, 8, 2048, 1, 8),
    "GLM-4.5-Air": ("glm4_moe", 46, 45, 128, 8, 1408, 1, 1),
    "Mixtral-8x7B-v0.1": ("mixtral", 32, 32, 8, 2, 14336, 0, 1),
    "OLMoE-1B-7B-0924": ("olmoe", 16, 16, 64, 8, 1024, 0, 1),
    "gpt-oss-20b": ("gpt_oss", 24, 24, 32, 4, 2880, 0, 1),
}


def config_path(name: str) -> str:
    return os.path.join(FIXTURES, name, "config.json")


def routing_file(path, E, K, L, lengths=(40, 25, 60, 35, 30, 50), steps=None, model=None):
    ids = random_ids_TLK(sum(lengths), L, K, E, seed=2, skew=0.4)
    save_routing(str(path), ids, offsets_from_lengths(lengths), E, sample_step=steps, model=model)


def run(capsys, *argv):
    rc = main(["simulate", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def resolve(*argv):
    return sim_cli.resolve(build_parser().parse_args(["simulate", *argv]))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_config_reads_the_public_fields(name):
    kind, layers, moe, E, K, F, shared, groups = EXPECTED[name]
    hf = model_from_hf_config(config_path(name))
    s = hf.spec
    assert (hf.model_type, s.num_layers, s.num_moe_layers, s.num_experts, s.top_k, s.moe_ffn,
            s.num_shared_experts, s.num_expert_groups) == (kind, layers, moe, E, K, F, shared, groups)
    assert s.name == name and len(hf.moe_layers) == layers and sum(hf.moe_layers) == moe


def test_fixture_configs_equal_the_presets_built_from_the_same_cards():
    for name, preset in (("Qwen3-30B-A3B", "qwen3-30b-a3b"), ("GLM-4.5-Air", "glm-4.5-air"),
                         ("DeepSeek-V3", "deepseek-v3")):
        spec = model_from_hf_config(config_path(name)).spec
        diff = {f for f in spec.__dataclass_fields__ if getattr(spec, f) != getattr(MODELS[preset], f)}
        assert diff == {"name"}, diff


def test_moe_layer_maps_and_approximation_notes():
    qwen = {"model_type": "qwen3_moe", "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [5]}
    assert moe_layer_map(qwen) == (False, True, False, True, False, False)
    ds = {"model_type": "deepseek_v2", "num_hidden_layers": 5, "first_k_dense_replace": 1, "moe_layer_freq": 2}
    assert moe_layer_map(ds) == (False, False, True, False, True)
    assert moe_layer_map(json.load(open(config_path("DeepSeek-V3"))))[:4] == (False, False, False, True)
    assert "multi-token-prediction" in " ".join(model_from_hf_config(config_path("DeepSeek-V3")).notes)
    assert "sliding-window" in " ".join(model_from_hf_config(config_path("gpt-oss-20b")).notes)
    with pytest.raises(ValueError, match="model_type 'llama' is not supported.*--model PRESET"):
        model_from_hf_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="--model-config config: field 'num_experts' is missing"):
        model_from_hf_config({"model_type": "olmoe", "num_hidden_layers": 2, "hidden_size": 8,
                              "num_attention_heads": 2, "vocab_size": 10, "num_experts_per_tok": 1,
                              "intermediate_size": 4})


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_fixture_simulates_a_replay_of_its_shape(tmp_path, capsys, name):
    _, _, moe, E, K, _, _, _ = EXPECTED[name]
    f = tmp_path / "r.safetensors"
    routing_file(f, E, K, moe)
    rc, out, err = run(capsys, str(f), "--model-config", config_path(name), *SMALL,
                       "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert out.splitlines()[0].startswith(name + " on 1 x 4")  # the header names the model simulated
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["config"]["model"]["name"] == name and doc["config"]["model"]["num_experts"] == E
    assert doc["config"]["model_from"] == f"--model-config {config_path(name)}"
    assert isinstance(doc["systems"]["static"]["step_time_s"], float)  # JSON stays in seconds
    notes = model_from_hf_config(config_path(name)).notes
    assert ("approximated: " in out) == bool(notes)  # what the cost model lacks is said
    assert doc["config"]["notes"].get("approximated", "") == "; ".join(notes)


def test_precedence_set_over_model_config_over_config_over_model(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"moe_ffn": 512, "hidden_size": 1024}}))
    # --config's fields beat --model's preset
    s = resolve("--model", "qwen3-235b-a22b", "--config", str(cfg))["model_spec"]
    assert (s.moe_ffn, s.hidden_size, s.num_layers) == (512, 1024, 94)
    assert s.name.startswith("qwen3-235b-a22b (") and "moe_ffn=512" in s.name
    # --model-config beats both
    s = resolve("--model", "qwen3-235b-a22b", "--config", str(cfg), "--model-config", config_path("OLMoE-1B-7B-0924"))["model_spec"]
    assert (s.moe_ffn, s.hidden_size, s.num_experts) == (1024, 2048, 64)
    # --set beats --model-config
    s = resolve("--config", str(cfg), "--model-config", config_path("OLMoE-1B-7B-0924"), "--set", "model.moe_ffn=77")["model_spec"]
    assert s.moe_ffn == 77 and s.name == "OLMoE-1B-7B-0924 (moe_ffn=77)"


def test_file_without_model_takes_the_dims_from_what_names_it(tmp_path, capsys):
    f = tmp_path / "r.safetensors"
    routing_file(f, 128, 8, 94, model="Qwen/Qwen3-235B-A22B")
    r = resolve(str(f), "--nodes", "1", "--gpus-per-node", "4", "--ignore-memory")
    assert r["model_spec"].name == "qwen3-235b-a22b" and "model metadata" in r["model_from"]
    routing_file(f, 128, 8, 48)  # no metadata: the only preset of this shape
    rc, out, err = run(capsys, str(f), *SMALL)
    assert rc == 0, err
    assert out.startswith("qwen3-30b-a3b on") and "model dims from the only preset" in out


def test_every_mismatch_in_one_error_and_the_suggested_flags_work(tmp_path, capsys):
    f = tmp_path / "switch.safetensors"
    routing_file(f, 8, 1, 12)  # a Switch-Transformer-like file: nothing names its model
    rc, _, err = run(capsys, str(f), *SMALL)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "nothing gives the model's dims; pass --model-config PATH" in err
    rc, _, err = run(capsys, str(f), "--model", "qwen3-30b-a3b", *SMALL)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "num_experts 8 (model: 128); top_k 1 (model: 8); MoE layers 12 (model: 48)" in err
    sets = re.search(r"(--set model\.\S+(?: --set model\.\S+)*)", err).group(1).split()
    rc, out, err = run(capsys, str(f), "--model", "qwen3-30b-a3b", *sets, *SMALL)
    assert rc == 0, err  # the flags the error names lead through, no dead end
    assert out.startswith("qwen3-30b-a3b (num_layers=12, num_moe_layers=12, num_experts=8, top_k=1) on")


def test_ep_size_that_does_not_divide_the_experts_suggests_nodes(tmp_path, capsys):
    f = tmp_path / "mixtral.safetensors"
    routing_file(f, 8, 2, 32)
    rc, _, err = run(capsys, str(f), "--model-config", config_path("Mixtral-8x7B-v0.1"), "--no-progress")
    assert rc == 2 and "32 GPUs does not divide the 8 experts" in err
    assert "e.g. --nodes 1 --gpus-per-node 8" in err
    rc, _, err = run(capsys, str(f), "--model-config", config_path("Mixtral-8x7B-v0.1"), "--nodes", "1",
                     "--gpus-per-node", "8", "--systems", "static", "--no-progress")
    assert rc == 0, err


def test_loads_file_rank_mismatch_suggests_nodes(tmp_path, capsys):
    from test_sim_cli import loads_file
    f = tmp_path / "l.safetensors"
    loads_file(f, S=2)
    rc, _, err = run(capsys, str(f), *SMALL)
    assert rc == 2 and "batched for 2 ranks" in err and "--nodes 1 --gpus-per-node 2" in err


def test_times_in_fitting_units_and_json_in_seconds(tmp_path, capsys):
    assert [format_seconds(x) for x in (76.7, 0.0123, 4.56e-5, 2.5e-9)] == ["76.7 s", "12.3 ms", "45.6 us", "0.00 us"]
    f = tmp_path / "r.safetensors"
    routing_file(f, 64, 8, 16)
    rc, out, err = run(capsys, str(f), "--model-config", config_path("OLMoE-1B-7B-0924"), *SMALL,
                       "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    step = json.loads((tmp_path / "r.json").read_text())["systems"]["static"]["step_time_s"]
    assert step < 1e-2 and re.search(r"static .* \d+(\.\d+)? (ms|us) ", out)  # not "0.00"


@pytest.mark.parametrize("steps,argv,warmup,note", [
    ([0, 0, 0, 1, 1, 1], [], 1, False),
    (None, [], 0, True),
    ([0, 0, 0, 1, 1, 1], ["--warmup-steps", "0"], 0, False),
])
def test_file_warmup(tmp_path, capsys, steps, argv, warmup, note):
    f = tmp_path / "r.safetensors"
    routing_file(f, 128, 8, 48, steps=steps)
    rc, out, err = run(capsys, str(f), *SMALL, *argv, "--json", str(tmp_path / "r.json"))
    assert rc == 0, err
    assert json.loads((tmp_path / "r.json").read_text())["config"]["warmup_steps"] == warmup
    assert ("plan it from uniform history" in out) == note


def test_missing_model_config_and_eplb_gets_the_expert_groups(tmp_path, capsys):
    rc, _, err = run(capsys, "--model-config", str(tmp_path / "nope.json"), *SMALL)
    assert rc == 2 and "--model-config" in err and "does not exist" in err
    from relibra_torch.planning import Topology
    from relibra_torch.sim import CostModel, get_hardware
    from relibra_torch.sim.simulator import default_planner_factory
    spec = model_from_hf_config(config_path("DeepSeek-V3")).spec
    planner = default_planner_factory("eplb", Topology(4, 8, 256, 2), CostModel(spec, get_hardware("h200")))
    assert planner.num_groups == 8  # n_group reaches EPLB's hierarchical policy


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(st.floats(1e-6, 1e5) | st.sampled_from([0.9996, 0.09996, 9.996e-4, 99.96e-3, 9.996]))
def test_format_seconds_keeps_three_digits(x):
    value, unit = format_seconds(x).split()
    back = float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]
    assert abs(back - x) <= 0.006 * x and 1 <= float(value) < 1000 or unit == "s"
