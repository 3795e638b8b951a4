"""Presets hold ARCHITECTURE.md's numbers; overrides convert and validate their values."""

import json

import pytest

from relibra_torch.sim.presets import (HARDWARE, MODELS, HardwareSpec, apply_overrides, get_hardware,
                                       get_model, load_config_file, parse_override)


@pytest.mark.parametrize("name,layers,moe_layers,D,F,E,k,shared", [
    ("qwen3-30b-a3b", 48, 48, 2048, 768, 128, 8, 0),
    ("qwen3-235b-a22b", 94, 94, 4096, 1536, 128, 8, 0),
    ("glm-4.5-air", 46, 45, 4096, 1408, 128, 8, 1),
    ("deepseek-v3", 61, 58, 7168, 2048, 256, 8, 1),
])
def test_model_presets_match_the_architecture_page(name, layers, moe_layers, D, F, E, k, shared):
    m = get_model(name)
    assert (m.num_layers, m.num_moe_layers, m.hidden_size, m.moe_ffn, m.num_experts, m.top_k,
            m.num_shared_experts) == (layers, moe_layers, D, F, E, k, shared)


def test_hardware_presets_are_hopper_sxm():
    for name in ("h100", "h200", "h800"):
        h = get_hardware(name)
        assert h.bf16_tflops == 989.0  # dense bf16, datasheet 1979 with sparsity
        assert 0 < h.grouped_gemm_efficiency <= 1 and 0 < h.dense_efficiency <= 1
        assert h.nvlink_gbps <= 450 and h.inter_node_gbps <= 50  # per-direction line rates
    assert set(HARDWARE) == {"h100", "h200", "h800"}
    assert set(MODELS) == {"qwen3-30b-a3b", "qwen3-235b-a22b", "glm-4.5-air", "deepseek-v3", "minimax-m2", "glm-5"}


def test_unknown_preset_names_list_the_choices():
    with pytest.raises(ValueError, match=r"--model 'llama'.*qwen3-30b-a3b"):
        get_model("llama")
    with pytest.raises(ValueError, match=r"--hardware 'a100'.*h100, h200, h800"):
        get_hardware("a100")
    assert get_model("Qwen3-30B-A3B").name == "qwen3-30b-a3b"


def test_overrides_convert_strings_and_keep_other_fields():
    h = apply_overrides(get_hardware("h200"), "hardware", {"nvlink_gbps": "300", "inter_node_gbps": 25})
    assert h.nvlink_gbps == 300.0 and isinstance(h.inter_node_gbps, float) and h.inter_node_gbps == 25.0
    assert h.bf16_tflops == 989.0
    m = apply_overrides(get_model("qwen3-30b-a3b"), "model", {"top_k": "6"})
    assert m.top_k == 6 and m.num_experts == 128


@pytest.mark.parametrize("section,key,value,match", [
    ("hardware", "nvlink_gbps", "-5", r"hardware.nvlink_gbps = -5.0; allowed: a finite number > 0"),
    ("hardware", "inter_node_gbps", "0", r"hardware.inter_node_gbps = 0.0; allowed: a finite number > 0"),
    ("hardware", "grouped_gemm_efficiency", "1.5",
     r"hardware.grouped_gemm_efficiency = 1.5; allowed: a finite number in \(0, 1\]"),
    ("hardware", "speed", "1", r"hardware.speed is not a field; allowed: bf16_tflops"),
    ("hardware", "nvlink_gbps", "fast", r"hardware.nvlink_gbps='fast' is not a number"),
    ("model", "top_k", "200", r"model.top_k = 200; allowed: an int in \[1, model.num_experts = 128\]"),
    ("model", "num_experts", "2.5", r"model.num_experts='2.5' is not an int"),
    ("model", "hidden_size", "0", r"model.hidden_size = 0; allowed: an int >= 1"),
    # as --model-config checks num_key_value_heads: the KV heads divide the query heads (GQA)
    ("model", "num_heads", "7", r"model.num_kv_heads = 4 with model.num_heads = 7; allowed: a divisor of 7"),
    ("model", "num_kv_heads", "64", r"model.num_kv_heads = 64 with model.num_heads = 32; allowed: a divisor of 32"),
])
def test_bad_overrides_name_the_field_and_what_is_allowed(section, key, value, match):
    spec = get_hardware("h200") if section == "hardware" else get_model("qwen3-30b-a3b")
    with pytest.raises(ValueError, match=match):
        apply_overrides(spec, section, {key: value})


def test_parse_override():
    assert parse_override("hardware.nvlink_gbps=300") == ("hardware", "nvlink_gbps", "300")
    for bad in ("nvlink_gbps=300", "hardware.nvlink_gbps", "gpu.nvlink_gbps=3"):
        with pytest.raises(ValueError, match="--set"):
            parse_override(bad)


def test_hardware_spec_rejects_non_numbers():
    with pytest.raises(TypeError, match="hardware.bf16_tflops is str 'fast'; allowed: a finite number > 0"):
        HardwareSpec("x", "fast", 0.5, 0.5, 1.0, 1.0, 80.0, 3000.0)


def test_config_files_json_and_toml(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"model": "glm-4.5-air", "hardware": {"preset": "h100", "nvlink_gbps": 300},
                             "simulate": {"nodes": 2}}))
    assert load_config_file(str(p))["simulate"] == {"nodes": 2}
    t = tmp_path / "c.toml"
    t.write_text('model = "qwen3-235b-a22b"\n[hardware]\ninter_node_gbps = 25\n')
    assert load_config_file(str(t))["hardware"] == {"inter_node_gbps": 25}
    bad = tmp_path / "bad.json"
    bad.write_text('{"gpu": 1}')
    with pytest.raises(ValueError, match="unknown sections"):
        load_config_file(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config_file(str(bad))
    with pytest.raises(FileNotFoundError):
        load_config_file(str(tmp_path / "missing.json"))


def test_describe_model_counts_in_the_singular_where_there_is_one():
    import dataclasses

    from relibra_torch.sim.presets import describe_model
    one = dataclasses.replace(get_model("qwen3-30b-a3b"), num_layers=1, num_moe_layers=1)
    assert describe_model(dataclasses.asdict(one)).startswith("1 layer (1 MoE), hidden 2048; 128 routed experts, ")
    assert describe_model(dataclasses.asdict(get_model("qwen3-30b-a3b"))).startswith("48 layers (48 MoE)")
