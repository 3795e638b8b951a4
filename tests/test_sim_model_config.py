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
    "Kimi-K2-Instruct": ("kimi_k2", 61, 60, 384, 8, 2048, 1, 1),
    "Kimi-K2.5": ("kimi_k2", 61, 60, 384, 8, 2048, 1, 1),  # text_config of a kimi_k25 wrapper
    "Llama-4-Scout-17B-16E": ("llama4_text", 48, 48, 16, 1, 8192, 1, 1),  # text_config of llama4
    "Llama-4-Maverick-17B-128E-Instruct": ("llama4_text", 48, 24, 128, 1, 8192, 1, 1),  # interleave 2
    "MiniMax-M2": ("minimax_m2", 62, 62, 256, 8, 1536, 0, 1),
    "Ling-lite-1.5": ("bailing_moe", 28, 28, 64, 6, 1408, 2, 1),
    "Ling-mini-2.0": ("bailing_moe", 20, 19, 256, 8, 512, 1, 8),
    "Qwen3-VL-30B-A3B-Instruct": ("qwen3_vl_moe_text", 48, 48, 128, 8, 768, 0, 1),
    "GLM-4.5": ("glm4_moe", 92, 89, 160, 8, 1536, 1, 1),
    "GLM-5": ("glm_moe_dsa", 78, 75, 256, 8, 2048, 1, 1),
    "LongCat-Flash-Chat": ("longcat_flash", 28, 28, 768, 12, 2048, 1, 1),  # 512 + 256 zero experts
}
# name: (shared FFN width, dense FFN width, MLA) where the family spells them its own way
WIDTHS = {
    "Kimi-K2.5": (2048, 18432, True),
    "Llama-4-Maverick-17B-128E-Instruct": (8192, 16384, False),  # one shared expert; intermediate_size_mlp
    "Ling-lite-1.5": (1408, 0, False),  # each of its 2 shared experts: moe_intermediate_size
    "Ling-mini-2.0": (512, 5120, False),  # moe_shared_expert_intermediate_size
    "Qwen1.5-MoE-A2.7B": (5632, 0, False),  # shared_expert_intermediate_size
    "GLM-5": (2048, 12288, True),
    "MiniMax-M2": (0, 0, False),  # shared_intermediate_size 0
    "LongCat-Flash-Chat": (2 * 12288, 0, True),  # the two dense FFNs of each layer
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
    if name in WIDTHS:
        assert (s.shared_ffn, s.dense_ffn, s.is_mla) == WIDTHS[name]


def test_model_config_folder_names_the_folder_itself_not_its_parent():
    """`--model-config DIR` names the model after DIR (it named it after DIR's parent)."""
    assert model_from_hf_config(os.path.join(FIXTURES, "MiniMax-M2")).spec.name == "MiniMax-M2"
    assert model_from_hf_config(os.path.join(FIXTURES, "MiniMax-M2") + "/").spec.name == "MiniMax-M2"
    named = json.load(open(config_path("Kimi-K2.5")))
    named["_name_or_path"] = "moonshotai/Kimi-K2.5"
    assert model_from_hf_config(named).spec.name == "Kimi-K2.5"
    assert model_from_hf_config(json.load(open(config_path("GLM-5")))).spec.name == "glm_moe_dsa"


def _moe(**fields):
    base = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 100,
            "intermediate_size": 256}
    return {**base, **fields}


def test_unknown_model_type_with_moe_fields_loads_by_meaning():
    hf = model_from_hf_config(_moe(model_type="my_new_moe", moe_num_experts=16, moe_k=2, moe_ffn_hidden_size=32,
                                   moe_num_shared_experts=2, moe_layer_start_index=1, num_expert_group=4))
    s = hf.spec
    assert (s.num_experts, s.top_k, s.moe_ffn, s.num_shared_experts, s.shared_ffn, s.num_expert_groups,
            s.dense_ffn) == (16, 2, 32, 2, 32, 4, 256)
    assert hf.moe_layers == (False, True, True, True) and hf.model_type == "my_new_moe"
    # Jamba-style period/offset, nested in an llm_config wrapper
    jamba = model_from_hf_config({"model_type": "wrapper", "llm_config": _moe(
        model_type="x", num_experts=8, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1)})
    assert jamba.moe_layers == (False, True, False, True) and jamba.spec.moe_ffn == 256
    assert moe_layer_map(_moe(model_type="nemotron_h", hybrid_override_pattern="ME*E")) == (False, True, False, True)
    step3 = model_from_hf_config({"model_type": "step3_vl", "text_config": _moe(
        model_type="step3_text", moe_num_experts=8, moe_top_k=3, moe_intermediate_size=32, moe_layers_enum="2,3")})
    assert step3.moe_layers == (False, False, True, True) and step3.spec.top_k == 3
    omni = model_from_hf_config({"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": _moe(
        model_type="qwen3_omni_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)}})
    assert omni.model_type == "qwen3_omni_moe_text" and omni.spec.num_experts == 8


def test_features_the_cost_model_lacks_are_approximated_with_a_note_not_refused():
    hunyuan = model_from_hf_config(_moe(model_type="hunyuan_v1_moe", num_experts=8, moe_topk=[2, 2, 2, 2],
                                        moe_intermediate_size=[32, 32, 64, 64], num_shared_expert=[1, 1, 1, 1]))
    assert hunyuan.spec.moe_ffn == 48 and "expert widths differ across layers (32..64)" in " ".join(hunyuan.notes)
    assert (hunyuan.spec.num_shared_experts, hunyuan.spec.shared_ffn) == (1, 48)
    dbrx = model_from_hf_config({"model_type": "dbrx", "d_model": 64, "n_heads": 4, "n_layers": 2, "vocab_size": 100,
                                 "attn_config": {"kv_n_heads": 2}, "ffn_config": {
                                     "moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 96}})
    assert (dbrx.spec.num_experts, dbrx.spec.top_k, dbrx.spec.moe_ffn, dbrx.spec.num_kv_heads) == (16, 4, 96, 2)
    zero = model_from_hf_config(config_path("LongCat-Flash-Chat"))
    assert "256 zero-computation (identity) experts" in " ".join(zero.notes)
    hybrid = model_from_hf_config(_moe(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=16, layer_types=["linear_attention"] * 3 + ["full_attention"]))
    assert "3 linear-attention / Mamba layers" in " ".join(hybrid.notes)
    assert "DeepSeek sparse attention" in " ".join(model_from_hf_config(config_path("GLM-5")).notes)
    assert "chunked attention" in " ".join(model_from_hf_config(config_path("Llama-4-Scout-17B-16E")).notes)


def test_arctic_moe_layer_frequency_is_read():
    # Snowflake Arctic: layer i is MoE when (i + 1) % moe_layer_frequency == 0, else a dense MLP of intermediate_size
    arctic = model_from_hf_config(_moe(model_type="arctic", num_local_experts=8, num_experts_per_tok=2,
                                       moe_layer_frequency=2))
    assert arctic.moe_layers == (False, True, False, True) and arctic.spec.dense_ffn == 256
    residual = model_from_hf_config(_moe(model_type="arctic", num_local_experts=8, num_experts_per_tok=2,
                                         use_residual=True)).spec
    assert (residual.num_shared_experts, residual.shared_ffn) == (1, 64)


def test_per_modality_lists_are_read_for_the_text_modality():
    # ERNIE-4.5-VL: [text, vision] pairs, not per-layer lists: the text (first) element is read
    vl = model_from_hf_config(_moe(model_type="ernie4_5_moe_vl", moe_num_experts=[16, 8], moe_k=2,
                                   moe_intermediate_size=[48, 16], moe_layer_start_index=[1, 2],
                                   moe_layer_end_index=[5, 3]))
    assert (vl.spec.num_experts, vl.spec.moe_ffn, vl.moe_layers) == (16, 48, (False, True, True, True))
    assert "text modality" in " ".join(vl.notes)
    assert moe_layer_map({"num_hidden_layers": 3, "moe_layer_start_index": [2, 1]}) == (False, False, True)


@pytest.mark.parametrize("fields,match", [
    (dict(hybrid_override_pattern="ME*E"), "hybrid Mamba configs are not supported .*1 Mamba 'M' and 1 attention"),
    (dict(hybrid_override_pattern="MEE"), "hybrid_override_pattern has 3 characters; allowed: one of M/E/\\*/- per "
                                          "layer \\(4, num_hidden_layers\\)"),
    (dict(hybrid_override_pattern="MEXE"), "hybrid_override_pattern has 4 characters \\('X' unknown\\); allowed: one of M/E"),
    (dict(mlp_only_layers=[1, 100]), "mlp_only_layers = \\[1, 100\\]; allowed: a list of layer indices 0..3"),
    (dict(moe_layers=[4]), "moe_layers = \\[4\\]; allowed: a list of layer indices 0..3"),
    (dict(moe_layers_enum="1,9"), "moe_layers_enum = '1,9'; allowed: layer indices 0..3"),
    (dict(num_key_value_heads=8), "num_key_value_heads = 8 with num_attention_heads = 4; allowed: a divisor of 4"),
    (dict(num_key_value_heads=3), "num_key_value_heads = 3 with num_attention_heads = 4; allowed: a divisor of 4"),
    (dict(num_attention_heads=6, num_key_value_heads=2), "num_attention_heads = 6 does not divide hidden_size = 64 "
                                                         "and the config has no head_dim"),
    (dict(n_group=2, topk_group=3), "topk_group = 3 with n_group = 2; allowed: 0..2"),
    (dict(moe_intermediate_size=[32, 64]), "moe_intermediate_size has 2 entries; allowed: one int, or one per layer"),
])
def test_impossible_values_are_refused_naming_the_field(fields, match):
    cfg = _moe(model_type="x", n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(ValueError, match="^--model-config config: " + match) as exc:
        model_from_hf_config({**cfg, **fields})
    assert "\n" not in str(exc.value)


def test_name_without_name_or_path_is_the_file_stem_or_model_type_not_a_generic_folder(tmp_path):
    cfg = _moe(model_type="arctic", architectures=["ArcticForCausalLM"], num_local_experts=8, num_experts_per_tok=2)
    (tmp_path / "cfg").mkdir()
    for file, name in (("arctic-480b.json", "arctic-480b"), ("config.json", "cfg")):
        (tmp_path / "cfg" / file).write_text(json.dumps(cfg))
        assert model_from_hf_config(str(tmp_path / "cfg" / file)).spec.name == name
    snapshot = tmp_path / ("0123456789abcdef" * 3)[:40]  # a hub-cache snapshots/<commit>/config.json
    snapshot.mkdir()
    (snapshot / "config.json").write_text(json.dumps(cfg))
    assert model_from_hf_config(str(snapshot / "config.json")).spec.name == "arctic"
    del cfg["model_type"]
    assert model_from_hf_config(cfg).spec.name == "ArcticForCausalLM"


@pytest.mark.parametrize("cfg", [
    _moe(model_type="llama"),  # a dense model
    {"model_type": "qwen2_vl", "text_config": _moe(model_type="qwen2_vl_text")},  # a dense wrapper
    _moe(model_type="qwen3", num_experts=1, num_experts_per_tok=1),  # one expert is no routing
])
def test_a_config_that_is_not_an_moe_is_refused_saying_so(cfg):
    with pytest.raises(ValueError, match="not an MoE .*no routed-expert count .*n_routed_experts, num_experts"):
        model_from_hf_config(cfg)
    with pytest.raises(ValueError, match="not an MoE: no layer holds routed experts"):
        model_from_hf_config(_moe(model_type="x", num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0, 1, 2, 3]))


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
    # every subcommand that reads --model-config is told its own way (convert has no --model preset)
    with pytest.raises(ValueError, match="not an MoE.*--model PRESET.*convert takes --num-experts, --top-k"):
        model_from_hf_config({"model_type": "llama", "num_hidden_layers": 2})
    with pytest.raises(ValueError, match="--model-config config: field 'n_routed_experts' is missing \\(also read as num_experts"):
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
    assert "no preset" not in out
    routing_file(f, 128, 8, 48, model="acme/MyMoE-30B")  # a model no preset is: the stand-in says so
    r = resolve(str(f), "--nodes", "1", "--gpus-per-node", "4", "--ignore-memory")
    assert r["model_spec"].name == "qwen3-30b-a3b"
    assert r["model_from"].endswith("standing in for the file's model 'acme/MyMoE-30B', which is no preset "
                                    "(its own dims: --model-config its config.json)")


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
    assert "; or keep the 32 GPUs as 4 data-parallel EP groups: --compare-ep 8 (sizes: 1,2,4,8)" in err
    rc, _, err = run(capsys, str(f), "--model-config", config_path("Mixtral-8x7B-v0.1"), "--nodes", "1",
                     "--gpus-per-node", "8", "--systems", "static", "--no-progress", "--replica-slots", "0")
    assert rc == 0, err  # (R = 2 does not fit Mixtral on one node: the memory model refuses it)


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
                       "--json", str(tmp_path / "r.json"), "--set", "planning.overlap_s=1e9")  # no host charge
    assert rc == 0, err
    step = json.loads((tmp_path / "r.json").read_text())["systems"]["static"]["step_time_s"]
    assert step < 1e-2 and re.search(r"static .* \d+(\.\d+)? (ms|us) ", out)  # not "0.00"


@pytest.mark.parametrize("steps,argv,warmup,note", [
    ([0, 0, 0, 1, 1, 1], [], 1, False),
    (None, [], 0, True),
    ([0, 0, 0, 1, 1, 1], ["--warmup-steps", "0"], 0, True),   # the first step is measured: said so
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


from hypothesis import HealthCheck, settings  # noqa: E402

_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2, 300), st.floats(allow_nan=True), st.text(max_size=4),
                  st.lists(st.integers(-1, 60), max_size=4), st.lists(st.sampled_from(["dense", "sparse", "x"])),
                  st.dictionaries(st.sampled_from(["model_type", "num_experts"]), st.integers(0, 4), max_size=2))


@settings(max_examples=int(os.environ.get("RELIBRA_FUZZ_EXAMPLES", 150)), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(EXPECTED)), data=st.data())
def test_damaged_configs_load_or_fail_with_one_value_error(name, data):
    """Any field of any fixture replaced or deleted: a model, or a ValueError naming --model-config."""
    cfg = json.load(open(config_path(name)))
    inner = cfg.get("text_config", cfg)
    for _ in range(data.draw(st.integers(1, 3))):
        target = data.draw(st.sampled_from([cfg, inner]))
        key = data.draw(st.sampled_from(sorted(target) + ["moe_layers", "mlp_layer_types", "moe_layer_freq",
                                                          "layer_types", "attn_type_list", "zero_expert_num"]))
        if data.draw(st.booleans()) and key in target:
            del target[key]
        else:
            target[key] = data.draw(_JUNK)
    try:
        model_from_hf_config(cfg)
    except ValueError as exc:
        assert "\n" not in str(exc) and "--model-config" in str(exc) or str(exc).startswith("model.")


@pytest.mark.parametrize("E,K,gpus", [(4, 2, 2), (2, 1, 2), (7, 2, 7), (8, 8, 2)])
def test_models_with_few_experts_or_top_k_of_all_run_the_synthetic_trace(tmp_path, capsys, E, K, gpus):
    # the trace's hot experts per task default to min(8, E); top_k == E picks every expert
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 1024, "intermediate_size": 2048,
                             "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
                             "num_local_experts": E, "num_experts_per_tok": K, "vocab_size": 32000}))
    rc, out, err = run(capsys, "--model-config", str(f), "--nodes", "1", "--gpus-per-node", str(gpus),
                       "--micro-batches", "2", "--steps", "1", "--systems", "static,eplb,relibra",
                       "--no-progress", "--ignore-memory")
    assert rc == 0, err
    assert "source: synthetic RL trace" in out and "relibra" in out


def test_shared_experts_are_priced_once_per_expert():
    # DeepSeek-V2-Lite style: 2 shared experts of the routed width; the spec prices count x width,
    # so shared_ffn is each one's width (it was the total, and the count multiplied it again)
    two = model_from_hf_config(_moe(model_type="deepseek_v2", n_routed_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=32, n_shared_experts=2)).spec
    assert two.num_shared_experts * two.shared_ffn == 2 * 32
    # a dense MLP beside every MoE layer joins the shared experts: Grok-2's residual_moe, Arctic's use_residual
    grok2 = model_from_hf_config(_moe(model_type="grok-2", num_local_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, residual_moe=True))
    assert grok2.spec.num_shared_experts * grok2.spec.shared_ffn == 256
    assert any("residual_moe" in note for note in grok2.notes)
    both = model_from_hf_config(_moe(model_type="arctic", num_local_experts=8, num_experts_per_tok=2,
                                     n_shared_experts=2, moe_intermediate_size=32, use_residual=True)).spec
    assert both.num_shared_experts * both.shared_ffn == 2 * 32 + 64


def test_hybrid_layers_given_by_period_are_named_and_a_layer_count_typo_is_refused():
    jamba = model_from_hf_config(_moe(model_type="jamba", num_experts=8, num_experts_per_tok=2, num_hidden_layers=8,
                                      attn_layer_period=4, attn_layer_offset=2))
    assert "6 linear-attention / Mamba layers priced as full-attention layers" in jamba.notes
    nxt = model_from_hf_config(_moe(model_type="qwen3_next", num_experts=8, num_experts_per_tok=2,
                                    num_hidden_layers=8, full_attention_interval=4))
    assert "6 linear-attention / Mamba layers priced as full-attention layers" in nxt.notes
    with pytest.raises(ValueError, match=r"num_hidden_layers = 1000000000; allowed: an int in \[1, 4096\]"):
        model_from_hf_config(_moe(num_experts=8, num_experts_per_tok=2, num_hidden_layers=10**9))


def test_a_byte_order_mark_is_read_and_a_preset_name_is_pointed_to_model(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(_moe(num_experts=8, num_experts_per_tok=2)).encode())
    assert model_from_hf_config(str(path)).spec.num_experts == 8
    with pytest.raises(FileNotFoundError, match="use --model qwen3-30b-a3b"):
        model_from_hf_config("qwen3-30b-a3b")


def test_a_null_expert_width_is_refused_and_other_spellings_are_read():
    with pytest.raises(ValueError, match="moe_intermediate_size = null"):
        model_from_hf_config(_moe(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=None))
    dbrx_like = model_from_hf_config(_moe(num_experts=8, num_experts_per_tok=2, max_seq_len=32768))
    assert dbrx_like.spec.max_context == 32768
    mtp = model_from_hf_config(_moe(num_experts=8, num_experts_per_tok=2, mtp_num_hidden_layers=1))
    assert any("multi-token-prediction" in note for note in mtp.notes)


def test_two_expert_count_spellings_that_disagree_are_refused_naming_both():
    """Mixtral's num_local_experts beside a num_experts of another value: no silent pick."""
    mixtral = _moe(model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"^--model-config config: num_experts = 16 but num_local_experts = 8; "
                                         r"allowed: one expert count \(make them agree, or remove") as exc:
        model_from_hf_config({**mixtral, "num_experts": 16})
    assert "\n" not in str(exc.value)
    assert model_from_hf_config({**mixtral, "num_experts": 8}).spec.num_experts == 8   # agreeing: read


@pytest.mark.parametrize("field,fields", [
    ("n_routed_experts", dict(n_routed_experts=None)),
    ("v_head_dim", dict(n_routed_experts=8, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=None)),
])
def test_a_null_field_is_called_null_not_missing(field, fields):
    cfg = _moe(model_type="deepseek_v2", num_experts_per_tok=2, moe_intermediate_size=32, **fields)
    with pytest.raises(ValueError, match=rf"^--model-config config: {field} = null; allowed: an int >= "):
        model_from_hf_config(cfg)


def test_top_k_above_the_expert_count_names_the_config_fields():
    with pytest.raises(ValueError, match=r"--model-config .*num_experts_per_tok = 9 with num_experts = 8"):
        model_from_hf_config(_moe(num_experts=8, num_experts_per_tok=9))


def test_encoder_decoder_is_refused_as_such_and_kv_channels_is_the_head_size():
    # Switch Transformers: refused for what it is, not for a missing attention field
    switch = {"model_type": "switch_transformers", "is_encoder_decoder": True, "d_model": 768, "d_ff": 3072,
              "num_experts": 8, "num_heads": 12, "num_layers": 12, "vocab_size": 32128}
    with pytest.raises(ValueError, match=r"an encoder-decoder model \(is_encoder_decoder: true, model_type "
                                         r"switch_transformers\); allowed: a decoder-only MoE"):
        model_from_hf_config(switch)
    # JetMoE / Megatron spell the head size kv_channels: 128 here, not hidden / heads = 64
    jet = model_from_hf_config(_moe(model_type="jetmoe", num_local_experts=8, num_experts_per_tok=2,
                                    hidden_size=2048, num_attention_heads=32, num_key_value_heads=16,
                                    kv_channels=128)).spec
    assert jet.head_dim == 128
    # an MoE architecture that lost its expert count is told the least it accepts (1 expert is refused)
    with pytest.raises(ValueError, match=r"field 'n_routed_experts' is missing .*allowed: an int >= 2"):
        model_from_hf_config({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 4, "vocab_size": 100, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32})


def test_simulate_prints_the_shape_it_read(tmp_path, capsys):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(_moe(model_type="deepseek_v2", n_routed_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1)))
    rc, out, err = run(capsys, "--model-config", str(f), "--micro-batches", "2", "--steps", "1", *SMALL)
    assert rc == 0, err
    spec = model_from_hf_config(str(f)).spec
    assert (f"model: {spec.num_layers} layers ({spec.num_moe_layers} MoE, 1 dense of width {spec.dense_ffn}), "
            f"hidden {spec.hidden_size}; 8 routed experts, top-2, width 32; 2 shared of width 32") in out
