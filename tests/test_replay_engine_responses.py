"""`relibra convert` on the response layouts engines send today, and on broken ones.

Layouts (see docs/replay.md): SGLang's OpenAI-compatible chat/completions responses with a
response-level `sglext.routed_experts` (the /generate payload: base64 int32 `[tokens,
num_hidden_layers, top_k]`, dense layers as zeros); vLLM chat completions whose choice rows
cover the whole sequence, or the generated tokens only (refused unless --completion-only);
slime samples holding SGLang's base64 string. Every error is one line that names the record,
the row and the engine's layer. The model: 5 transformer layers, layer 0 dense, 16 experts,
top-4 (as in test_replay_engines.py).
Legend: T tokens, H engine layers, L MoE layers, K top-k, E experts, P prompt, C generated.
"""

from __future__ import annotations

import base64
import copy
import json
import os

import pytest
import torch
from _replay_helpers import random_ids_TLK
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_replay_engines import CONFIG, E, K, L, with_dense

from relibra_torch.cli import main
from relibra_torch.replay import load_routing

P, C = 5, 4  # prompt and generated tokens: P + C - 1 = 8 rows are forwarded


@pytest.fixture()
def cfg(tmp_path):
    folder = tmp_path / "models" / "tiny-moe"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return str(folder)


def ids_of(seed, T=P + C - 1):
    return random_ids_TLK(T, L, K, E, seed=seed, skew=0.5)


def b64_int32(ids_THK) -> str:
    return base64.b64encode(ids_THK.to(torch.int32).numpy().tobytes()).decode()


def sglang_openai(ids_TLK, chat=True):
    """A non-streamed SGLang /v1/chat/completions (or /v1/completions) response."""
    choice = {"index": 0, "finish_reason": "stop", "matched_stop": 151645}
    choice.update({"message": {"role": "assistant", "content": "4"}} if chat else {"text": "4"})
    return {"id": "3c2b", "object": "chat.completion" if chat else "text_completion", "created": 1764000000,
            "model": "tiny-moe", "choices": [choice],
            "usage": {"prompt_tokens": P, "total_tokens": P + C, "completion_tokens": C,
                      "prompt_tokens_details": None, "reasoning_tokens": 0},
            "sglext": {"routed_experts": b64_int32(with_dense(ids_TLK))}}


def vllm_chat(ids_TLK, whole=True, token_ids=True):
    """A vLLM /v1/chat/completions response (MoE layers only, nested lists as the server sends)."""
    rows = ids_TLK if whole else ids_TLK[P - 1:]  # generated-only: C - 1 rows
    choice = {"index": 0, "message": {"role": "assistant", "content": "4", "reasoning": None},
              "logprobs": None, "finish_reason": "stop", "stop_reason": None,
              "token_ids": list(range(C)) if token_ids else None, "routed_experts": rows.tolist()}
    return {"id": "chatcmpl-a4e6", "object": "chat.completion", "created": 1764000000, "model": "tiny-moe",
            "choices": [choice], "service_tier": None, "system_fingerprint": "vllm-0.21.0",
            "usage": {"prompt_tokens": P, "total_tokens": P + C, "completion_tokens": C},
            "prompt_routed_experts": None, "prompt_logprobs": None,
            "prompt_token_ids": list(range(P)) if token_ids else None, "kv_transfer_params": None}


def convert(tmp_path, capsys, engine, records, *flags, out="out.safetensors"):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in records))
    out = out if out in (".",) or "/" in out else str(tmp_path / out)
    rc = main(["convert", engine, str(src), out, *flags])
    got = capsys.readouterr()
    return rc, got.out, got.err, out


@pytest.mark.parametrize("chat", [True, False])
def test_sglang_openai_sglext_converts_completely(tmp_path, capsys, cfg, chat):
    samples = [ids_of(1), ids_of(2)]
    rc, out, err, path = convert(tmp_path, capsys, "sglang", [sglang_openai(s, chat) for s in samples],
                                 "--model-config", cfg)
    assert rc == 0, err
    replay = load_routing(path)
    assert torch.equal(replay.routed_experts_TLK.long(), torch.cat(samples))
    assert replay.sample_lengths.tolist() == [P + C - 1] * 2 and replay.coverage is None
    assert replay.model == "tiny-moe"  # --model-config DIR: DIR's own name, not "models"


def test_sglang_openai_errors_give_the_right_advice(tmp_path, capsys, cfg):
    rec = sglang_openai(ids_of(1))
    del rec["sglext"]
    rc, _, err, _ = convert(tmp_path, capsys, "sglang", [rec], "--model-config", cfg)
    assert rc == 2 and "OpenAI-style response without sglext.routed_experts; send return_routed_experts=true" in err
    rec = sglang_openai(ids_of(1))
    rec["choices"].append(dict(rec["choices"][0], index=1))
    rc, _, err, _ = convert(tmp_path, capsys, "sglang", [rec], "--model-config", cfg)
    assert rc == 2 and "holds the routing of choice 0 only" in err and "n = 1" in err
    rec = sglang_openai(ids_of(1))
    rec["usage"]["completion_tokens"] = C + 1
    rc, _, err, _ = convert(tmp_path, capsys, "sglang", [rec], "--model-config", cfg)
    assert rc == 2 and "record 0: sglext.routed_experts has 8 rows but prompt_tokens 5 + completion_tokens 5" in err


def test_vllm_whole_sequence_rows_convert_completely(tmp_path, capsys, cfg):
    ids = ids_of(3)
    rc, _, err, path = convert(tmp_path, capsys, "vllm", [vllm_chat(ids)], "--model-config", cfg)
    assert rc == 0, err
    assert torch.equal(load_routing(path).routed_experts_TLK.long(), ids)


def test_vllm_generated_only_rows_are_refused_unless_asked_and_then_marked(tmp_path, capsys, cfg):
    ids = ids_of(4)
    rc, _, err, _ = convert(tmp_path, capsys, "vllm", [vllm_chat(ids, whole=False)], "--model-config", cfg)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "covers the 4 generated tokens only; the 5 prompt tokens have no rows" in err and "--completion-only" in err
    rc, out, err, path = convert(tmp_path, capsys, "vllm", [vllm_chat(ids, whole=False)], "--model-config", cfg,
                                 "--completion-only")
    assert rc == 0, err
    assert "WARNING: 1 of 1 samples hold their generated tokens only: 5 prompt tokens" in err
    replay = load_routing(path)
    assert replay.coverage == "completion-only" and torch.equal(replay.routed_experts_TLK.long(), ids[P - 1:])
    assert main(["inspect", path]) == 0
    assert "coverage     completion-only" in capsys.readouterr().out
    assert main(["simulate", path, "--model-config", cfg, "--nodes", "1", "--gpus-per-node", "4",
                 "--systems", "static", "--no-progress"]) == 0
    assert "coverage: completion-only: some samples lack their prompt tokens' rows" in capsys.readouterr().out
    # without token counts the rows cannot be told apart: refused, naming what to send
    rc, _, err, _ = convert(tmp_path, capsys, "vllm", [vllm_chat(ids, token_ids=False) | {"usage": None}],
                            "--model-config", cfg)
    assert rc == 2 and "return_token_ids=true" in err


def test_documented_slime_command_on_base64_records(tmp_path, capsys):
    """docs/replay.md: `relibra convert slime samples.jsonl ... --num-experts 128 --top-k 8 --moe-layers 1-45`
    on slime samples holding SGLang's base64 (a GLM-4.5-Air-shaped model: 46 layers, layer 0 dense)."""
    lengths = (6, 9)
    full = [torch.cat([torch.zeros(n - 1, 1, 8, dtype=torch.int64),
                       random_ids_TLK(n - 1, 45, 8, 128, seed=n)], dim=1) for n in lengths]
    records = [{"tokens": list(range(n)), "response_length": 3, "rollout_routed_experts": b64_int32(f)}
               for n, f in zip(lengths, full)]
    rc, _, err, path = convert(tmp_path, capsys, "slime", records, "--num-experts", "128", "--top-k", "8",
                               "--moe-layers", "1-45")
    assert rc == 0, err
    assert torch.equal(load_routing(path).routed_experts_TLK.long(), torch.cat([f[:, 1:] for f in full]))
    rc, _, err, _ = convert(tmp_path, capsys, "slime", records, "--num-experts", "128", "--moe-layers", "1-45")
    assert rc == 2 and "pass --top-k (or --model-config)" in err and len(err.strip().splitlines()) == 1


def test_errors_point_at_the_record_row_and_engine_layer(tmp_path, capsys, cfg):
    ids = ids_of(5)
    bad = vllm_chat(ids, whole=False)
    bad["choices"][0]["routed_experts"][2][3][1] = 99  # completion row 2, layer 3, slot 1
    rc, _, err, _ = convert(tmp_path, capsys, "vllm", [bad], "--model-config", cfg, "--completion-only")
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert ("record 0: choices[0].routed_experts[2, 3, 1] (completion row 2, engine layer 3) = 99 is out of "
            "range; allowed: expert ids in [0, 16)") in err
    # SGLang counts the dense layer 0: its layer 5 is reported as 5, not as MoE layer 4
    full = with_dense(ids_of(6))
    full[3, 4, 0] = full[3, 4, 1]  # token position 3, engine layer 4: a repeated expert
    rec = sglang_openai(ids_of(6))
    rec["sglext"]["routed_experts"] = b64_int32(full)
    rec2 = sglang_openai(ids_of(7))
    rc, _, err, _ = convert(tmp_path, capsys, "sglang", [rec2, rec], "--model-config", cfg)
    assert rc == 2 and "record 1: sglext.routed_experts[3, 4] (token position 3, engine layer 4) = " in err
    assert "repeats an expert" in err


@pytest.mark.parametrize("out", ["nodir/o.safetensors", ".", "o.txt"])
def test_unwritable_output_is_one_line(tmp_path, capsys, cfg, out, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, _, err, _ = convert(tmp_path, capsys, "sglang", [sglang_openai(ids_of(1))], "--model-config", cfg, out=out)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("relibra convert: error: OUT")


@pytest.mark.parametrize("content", [None, b"\xff\xfe{}"])
def test_unreadable_input_is_one_line(tmp_path, capsys, content):
    src = tmp_path / "in.json"
    if content is None:
        src.mkdir()
    else:
        src.write_bytes(content)
    assert main(["convert", "vllm", str(src), str(tmp_path / "o.safetensors"), "--num-experts", "8"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "IN " in err


# --- malformed responses: one line naming the record, never a traceback -----------------

_JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.text(max_size=6),
                  st.sampled_from(["!!!", "AAAA", "k5NVTVBZ", base64.b64encode(b"\x93NUMPYxx").decode()]),
                  st.lists(st.integers(-2, 40), max_size=3), st.just([[[1, 2]]]), st.just({"encoding": "base64"}),
                  st.just({"encoding": "base64", "dtype": "int16", "shape": [2, 2, 2], "data": "AAAA"}))


def _paths(obj, prefix=()):
    """Every (path) to a value inside a JSON object."""
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list) and len(obj) <= 8:
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _set(obj, path, value, delete):
    for p in path[:-1]:
        obj = obj[p]
    if delete and isinstance(obj, dict):
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


def _valid_records():
    ids = ids_of(8)
    slime_rows = with_dense(ids)
    return {"sglang": [sglang_openai(ids), {"meta_info": {"prompt_tokens": P, "completion_tokens": C,
                                                          "routed_experts": b64_int32(with_dense(ids))}}],
            "vllm": [vllm_chat(ids), vllm_chat(ids, whole=False)],
            "slime": [{"tokens": list(range(P + C)), "rollout_routed_experts": slime_rows.tolist()}],
            "verl": [{"routed_experts": [ids.tolist()], "attention_mask": [[1] * ids.shape[0]]}]}


@settings(max_examples=int(os.environ.get("RELIBRA_FUZZ_EXAMPLES", 120)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(engine=st.sampled_from(["sglang", "vllm", "slime", "verl"]), data=st.data())
def test_malformed_responses_give_one_line_errors(tmp_path, capsys, engine, data):
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir(exist_ok=True)
    cfg.write_text(json.dumps(CONFIG))
    records = copy.deepcopy(_valid_records()[engine])
    for _ in range(data.draw(st.integers(1, 3))):
        r = data.draw(st.integers(0, len(records) - 1))
        paths = [p for p in _paths(records[r]) if p]
        if not paths:
            break
        path = data.draw(st.sampled_from(paths))
        _set(records[r], path, copy.deepcopy(data.draw(_JUNK)), data.draw(st.booleans()))
    flags = data.draw(st.sampled_from([["--model-config", str(cfg)], ["--num-experts", str(E), "--moe-layers", "1-4"],
                                       ["--num-experts", str(E), "--top-k", str(K), "--completion-only"]]))
    rc, _, err, _ = convert(tmp_path, capsys, engine, records, *flags)  # any other exception fails the test
    assert rc in (0, 2), err
    if rc == 2:
        assert len(err.strip().splitlines()) == 1 and err.startswith("relibra convert: error: "), err
