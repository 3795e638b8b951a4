"""`relibra convert`: engine responses built from a known replay convert back to it bit for bit.

The model: a DeepSeek-style config with 5 transformer layers, the first dense
(first_k_dense_replace = 1), 16 routed experts, top-4. SGLang and slime send all 5 layers
(zeros at the dense one), vLLM sends the 4 MoE layers. Each test builds the engine's JSON
from a known RoutingReplay, runs the CLI and compares the written file with the replay.
Legend: T tokens, H engine layers, L MoE layers, K top-k, E experts, B batch rows, P padded length.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch
from _replay_helpers import offsets_from_lengths, random_ids_TLK

from relibra_torch.cli import main
from relibra_torch.replay import load_routing

E, K, H, L = 16, 4, 5, 4
LENGTHS = (7, 3, 11, 5)
CONFIG = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
          "num_hidden_layers": H, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": E,
          "num_experts_per_tok": K, "n_shared_experts": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16,
          "q_lora_rank": 0, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_group": 2,
          "topk_group": 1, "vocab_size": 100}


@pytest.fixture()
def known(tmp_path):
    """(config path, ids [T, L, K], offsets [N + 1]) of a known replay."""
    cfg = tmp_path / "tiny-moe" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(CONFIG))
    return str(cfg), random_ids_TLK(sum(LENGTHS), L, K, E, seed=3, skew=0.7), offsets_from_lengths(LENGTHS)


def with_dense(ids_TLK):
    """[T, H, K] as SGLang/slime send it: a zero placeholder at the dense layer 0."""
    return torch.cat([torch.zeros_like(ids_TLK[:, :1]), ids_TLK], dim=1)


def samples(ids, offsets):
    return [ids[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


def npy_b64(arr) -> str:
    buf = io.BytesIO()
    np.save(buf, np.asarray(arr), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def convert(capsys, tmp_path, engine, records, *flags, jsonl=False):
    src = tmp_path / ("in.jsonl" if jsonl else "in.json")
    src.write_text("\n".join(json.dumps(r) for r in records) if jsonl else json.dumps(records))
    out = tmp_path / "out.safetensors"
    rc = main(["convert", engine, str(src), str(out), *flags])
    err = capsys.readouterr().err
    return rc, err, out


def assert_same(out, ids, offsets):
    replay = load_routing(str(out))
    assert torch.equal(replay.routed_experts_TLK.long(), ids)
    assert torch.equal(replay.sample_offsets, offsets)
    assert replay.num_experts == E


def test_sglang_round_trip_with_appended_chunk(known, tmp_path, capsys):
    cfg, ids, offsets = known
    records = []
    for i, s in enumerate(samples(ids, offsets)):
        full = with_dense(s).to(torch.int32).numpy()
        T = full.shape[0]
        if i == 2:  # multi-turn: the second turn re-sends rows from position 4 (start_len)
            records.append({"text": "", "meta_info": {"prompt_tokens": 3, "completion_tokens": 4,
                                                      "routed_experts": base64.b64encode(full[:6].tobytes()).decode()}})
            records.append({"meta_info": {"prompt_tokens": 8, "completion_tokens": T - 7, "routed_experts_start_len": 4,
                                          "routed_experts": base64.b64encode(full[4:].tobytes()).decode()}})
            continue
        records.append({"meta_info": {"prompt_tokens": 2, "completion_tokens": T - 1,
                                      "routed_experts": base64.b64encode(full.tobytes()).decode()}})
    rc, err, out = convert(capsys, tmp_path, "sglang", records, "--model-config", cfg, jsonl=True)
    assert rc == 0, err
    assert_same(out, ids, offsets)
    assert load_routing(str(out)).model == "tiny-moe"


def test_vllm_round_trip_lists_npy_and_envelope(known, tmp_path, capsys):
    cfg, ids, offsets = known
    s = samples(ids, offsets)
    prompt = s[0][:3]
    # two choices sharing one prompt: samples 0 and 1 of the known replay start with it
    ids2 = torch.cat([s[0], prompt, s[1]])
    offsets2 = offsets_from_lengths([len(s[0]), 3 + len(s[1])])
    records = [{"prompt_token_ids": [1, 2, 3], "prompt_routed_experts": prompt.tolist(), "choices": [
        {"token_ids": list(range(len(s[0]) - 3 + 1)),  # the last generated token has no row
         "routed_experts": npy_b64(s[0][3:].numpy().astype(np.int16))},
        {"token_ids": list(range(len(s[1]))),
         "routed_experts": {"encoding": "base64", "dtype": "int16", "shape": list(s[1].shape),
                            "data": base64.b64encode(s[1].numpy().astype("<i2").tobytes()).decode()}}]}]
    rc, err, out = convert(capsys, tmp_path, "vllm", records, "--model-config", cfg)
    assert rc == 0, err
    assert_same(out, ids2, offsets2)


def test_slime_counts_dense_layers_and_drops_pad_rows(known, tmp_path, capsys):
    cfg, ids, offsets = known
    records = []
    for s in samples(ids, offsets):
        padded = torch.cat([with_dense(s), torch.zeros(3, H, K, dtype=s.dtype)])  # 3 pad rows of expert 0
        records.append({"tokens": list(range(len(s) + 1)), "rollout_routed_experts": padded.tolist(),
                        "length": len(s)})
    rc, err, out = convert(capsys, tmp_path, "slime", records, "--model-config", cfg)
    assert rc == 0, err
    assert_same(out, ids, offsets)


@pytest.mark.parametrize("tokens,rows", [(100, 2), (3, 5)])
def test_slime_rows_that_do_not_match_the_tokens_are_refused(tmp_path, capsys, tokens, rows):
    """slime routes every token but the last: len(tokens) - 1 rows, as SGLang's prompt + completion - 1."""
    ids = torch.arange(rows * 2 * 2).remainder(E).view(rows, 2, 2)
    ids[:, :, 1] = (ids[:, :, 0] + 1) % E
    record = {"tokens": list(range(tokens)), "rollout_routed_experts": ids.tolist()}
    rc, err, _ = convert(capsys, tmp_path, "slime", [record], "--num-experts", str(E), "--top-k", "2", jsonl=True)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert (f"record 0: rollout_routed_experts has {rows} rows but len(tokens) {tokens} - 1 = {tokens - 1}; "
            f"allowed: {tokens - 1} rows (one per token but the last), or pad rows marked by attention_mask "
            f"or length") in err, err
    rc, err, out = convert(capsys, tmp_path, "slime", [{**record, "tokens": list(range(rows + 1))}],
                           "--num-experts", str(E), "--top-k", "2")
    assert rc == 0, err
    assert load_routing(str(out)).num_tokens == rows


def test_the_summary_line_counts_in_the_singular_where_there_is_one(tmp_path, capsys):
    src, out = tmp_path / "in.json", tmp_path / "out.safetensors"
    src.write_text(json.dumps([{"tokens": [5, 6], "step": 0, "rollout_routed_experts": [[[1, 2]]]}]))
    assert main(["convert", "slime", str(src), str(out), "--num-experts", str(E)]) == 0
    assert capsys.readouterr().out.strip() == (f"wrote {out}: 1 sample in 1 step, 1 token, 1 MoE layer, top-2 of "
                                               f"{E} experts")


@pytest.mark.parametrize("by", ["attention_mask", "lengths"])
def test_padded_verl_batch_counts_no_pad_row(known, tmp_path, capsys, by):
    cfg, ids, offsets = known
    P = max(LENGTHS) + 2
    batch = torch.zeros(len(LENGTHS), P, L, K, dtype=torch.int64)  # pads hold expert 0 x K
    mask = torch.zeros(len(LENGTHS), P, dtype=torch.int64)
    for b, s in enumerate(samples(ids, offsets)):
        start = 0 if by == "lengths" else P - len(s) - (b % 2)  # left- and right-padded rows
        batch[b, start:start + len(s)] = s
        mask[b, start:start + len(s)] = 1
    record = {"routed_experts": batch.tolist()}
    record.update({"attention_mask": mask.tolist()} if by == "attention_mask" else {"lengths": list(LENGTHS)})
    rc, err, out = convert(capsys, tmp_path, "verl", [record], "--num-experts", str(E))
    assert rc == 0, err
    replay = load_routing(str(out))
    assert torch.equal(replay.expert_counts(), load_counts(ids))  # expert 0 gets no pad row
    assert_same(out, ids, offsets)


def load_counts(ids):
    return torch.stack([torch.bincount(ids[:, layer].flatten(), minlength=E) for layer in range(ids.shape[1])])


def test_layers_with_different_token_counts(known, tmp_path, capsys):
    cfg, ids, offsets = known
    enc, dec = ids[:6, :2], ids[:5, 2:]  # the decoder layers drop one padding token
    by_layer = [enc[:, 0].tolist(), enc[:, 1].tolist(), dec[:, 0].tolist(), dec[:, 1].tolist()]
    rc, err, _ = convert(capsys, tmp_path, "slime", [{"routed_experts_by_layer": by_layer}], "--num-experts", str(E))
    assert rc == 2
    assert "layers 0-1 hold 6 tokens; layers 2-3 hold 5 tokens" in err and "--moe-layers" in err
    rc, err, out = convert(capsys, tmp_path, "slime", [{"routed_experts_by_layer": by_layer}],
                           "--num-experts", str(E), "--moe-layers", "2-3")
    assert rc == 0, err
    assert torch.equal(load_routing(str(out)).routed_experts_TLK.long(), dec)


@pytest.mark.parametrize("engine,record,flags,needle", [
    ("slime", {"routed_experts": [[[1, 2]]]}, [], "--model-config CONFIG.json or --num-experts"),
    ("sglang", {"meta_info": {"routed_experts": base64.b64encode(np.arange(8, dtype="<i4").tobytes()).decode()}},
     ["--num-experts", "16"], "pass --model-config, or --top-k"),
    ("slime", {"routed_experts": [[[1, 20]]]}, ["--num-experts", "16"], "--num-experts or --model-config"),
    ("slime", {"routed_experts": [[[0, 0], [1, 2]], [[0, 0], [3, 4]]]}, ["--num-experts", "16"],
     "--model-config or --moe-layers"),
    ("slime", {"routed_experts": [[[1, 2]] * 3]}, ["CFG"], "fix --moe-layers or --model-config"),
    ("sglang", {"text": "no routing"}, ["--num-experts", "16"], "--enable-return-routed-experts"),
    ("verl", {"routed_experts": [[[[1, 2]]]]}, ["--num-experts", "16"], "attention_mask [B, P] or lengths [B]"),
    ("slime", {"routed_experts": [[[1, 2]]]}, ["--num-experts", "16", "--moe-layers", "x"], "--moe-layers 'x'"),
    ("slime", {"routed_experts": [[[1, 2]]]}, ["--num-experts", "16", "--moe-layers", ""],
     "--moe-layers '' is empty; allowed: layer indices, e.g. 3-60 or 1,3,5"),
    ("slime", {"routed_experts": [[[1, 2]]]}, ["--num-experts", "16", "--moe-layers", "0,0"],
     "--moe-layers '0,0' names layer 0 twice; allowed: each layer once"),
    ("slime", {"routed_experts": [[[1, 2]]]}, ["--num-experts", "16", "--moe-layers", "0-3,2"],
     "--moe-layers '0-3,2' names layer 2 twice; allowed: each layer once"),
    ("slime", {"routed_experts": [[[1, 2], [-1, 3]], [[4, 5], [6, 7]]]}, ["--num-experts", "16"],
     "record 0: routed_experts[0, 1, 0] (token position 0, engine layer 1) = -1 is a placeholder (no expert) in a "
     "kept layer; keep only the MoE layers with --moe-layers"),
    ("slime", {"routed_experts": [[[1, 2]]]}, ["--num-experts", "0"], "--num-experts = 0; allowed: an int >= 1"),
    ("slime", {"routed_experts": [[[1, 2]]], "length": 5}, ["--num-experts", "16"], "length = 5; allowed"),
])
def test_errors_name_the_flag(known, tmp_path, capsys, engine, record, flags, needle):
    flags = [known[0] if f == "CFG" else f for f in flags]
    if flags and flags[0] == known[0]:
        flags = ["--model-config", *flags]
    rc, err, _ = convert(capsys, tmp_path, engine, [record], *flags)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def test_missing_and_bad_input(tmp_path, capsys):
    assert main(["convert", "vllm", str(tmp_path / "none.json"), str(tmp_path / "o.safetensors"),
                 "--num-experts", "8"]) == 2
    assert "IN" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["convert", "vllm", str(bad), str(tmp_path / "o.safetensors"), "--num-experts", "8"]) == 2
    assert "neither JSON" in capsys.readouterr().err


def test_record_steps_become_sample_steps_and_give_simulate_a_warmup_step(known, tmp_path, capsys):
    cfg, ids, offsets = known
    records = [{"step": i // 2, "routed_experts": with_dense(s).tolist()} for i, s in enumerate(samples(ids, offsets))]
    rc, err, out = convert(capsys, tmp_path, "slime", records, "--model-config", cfg)
    assert rc == 0, err
    assert load_routing(str(out)).sample_step.tolist() == [0, 0, 1, 1]
    rc = main(["simulate", str(out), "--model-config", cfg, "--nodes", "1", "--gpus-per-node", "4",
               "--systems", "static,eplb", "--no-progress", "--json", str(tmp_path / "r.json")])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "r.json").read_text())["config"]
    assert (doc["steps"], doc["warmup_steps"], doc["model"]["name"]) == (2, 1, "tiny-moe")
    records[1]["step"] = -1
    rc, err, _ = convert(capsys, tmp_path, "slime", records, "--model-config", cfg)
    assert rc == 2 and "record 1 has step = -1" in err


def verl_batch(ids, offsets):
    """A right-padded verl batch [B, P, L, K] (pads hold expert 0) and its 0/1 mask [B, P] as lists."""
    P = max(LENGTHS) + 2
    batch = torch.zeros(len(LENGTHS), P, L, K, dtype=torch.int64)
    mask = torch.zeros(len(LENGTHS), P, dtype=torch.int64)
    for b, s in enumerate(samples(ids, offsets)):
        batch[b, :len(s)] = s
        mask[b, :len(s)] = 1
    return batch.tolist(), mask.tolist()


@pytest.mark.parametrize("value,needle", [
    (1.5, "] = 1.5 is not a whole number; allowed: a rectangular array of integer expert ids"),
    (True, "] = true is a boolean; allowed: a rectangular array of integer expert ids"),
])
@pytest.mark.parametrize("layout", ["batch", "row"])
def test_verl_fractional_or_boolean_id_is_refused_not_truncated(known, tmp_path, capsys, value, needle, layout):
    cfg, ids, offsets = known
    batch, mask = verl_batch(ids, offsets)
    batch[0][0][0][0] = value  # was read as int(value): 1.5 -> 1, true -> 1
    record = ({"routed_experts": batch, "attention_mask": mask} if layout == "batch"
              else {"routed_experts": batch[0], "attention_mask": mask[0]})
    rc, err, _ = convert(capsys, tmp_path, "verl", [record], "--num-experts", str(E))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    index = "0, 0, 0, 0" if layout == "batch" else "0, 0, 0"
    assert f"record 0: routed_experts[{index}{needle}" in err, err


def test_verl_whole_number_floats_are_read_as_ints(known, tmp_path, capsys):
    cfg, ids, offsets = known
    batch, mask = verl_batch(ids, offsets)
    batch = [[[[float(x) for x in k] for k in pos] for pos in row] for row in batch]  # a float array's tolist()
    rc, err, out = convert(capsys, tmp_path, "verl", [{"routed_experts": batch, "attention_mask": mask}],
                           "--num-experts", str(E))
    assert rc == 0, err
    assert_same(out, ids, offsets)


@pytest.mark.parametrize("lengths,needle", [
    ([LENGTHS[0], 100, *LENGTHS[2:]], f"record 0: lengths[1] = 100 > {max(LENGTHS) + 2} positions of its row; "
                                      f"allowed: {len(LENGTHS)} ints in [1, {max(LENGTHS) + 2}]"),
    ([LENGTHS[0], 0, *LENGTHS[2:]], f"record 0: lengths[1] = 0; allowed: {len(LENGTHS)} ints in [1, "),
    ([LENGTHS[0], 2.5, *LENGTHS[2:]], "record 0: lengths[1] = 2.5 is not a whole number; allowed: "),
])
def test_verl_lengths_past_the_row_are_refused_not_cut(known, tmp_path, capsys, lengths, needle):
    cfg, ids, offsets = known
    batch, _ = verl_batch(ids, offsets)
    rc, err, _ = convert(capsys, tmp_path, "verl", [{"routed_experts": batch, "lengths": lengths}],
                         "--num-experts", str(E))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert needle in err, err


def test_verl_mask_errors_name_the_value_or_the_ragged_row(known, tmp_path, capsys):
    cfg, ids, offsets = known
    batch, mask = verl_batch(ids, offsets)
    mask[0][3] = 2
    rc, err, _ = convert(capsys, tmp_path, "verl", [{"routed_experts": batch, "attention_mask": mask}],
                         "--num-experts", str(E))
    assert rc == 2 and "record 0: attention_mask[0, 3] = 2; allowed: 0 or 1" in err, err
    assert "shape" not in err, err
    mask[0][3] = 1
    full_row, mask[1] = mask[1], mask[1][:-1]
    rc, err, _ = convert(capsys, tmp_path, "verl", [{"routed_experts": batch, "attention_mask": mask}],
                         "--num-experts", str(E))
    P = max(LENGTHS) + 2
    assert rc == 2 and (f"record 0: attention_mask has rows of different lengths: attention_mask[1] has {P - 1} "
                        f"entries but attention_mask[0] has {P}; allowed: 0 or 1 in [B, P] = [{len(LENGTHS)}, {P}]"
                        in err), err
    mask[1] = full_row
    rc, err, _ = convert(capsys, tmp_path, "verl", [{"routed_experts": batch, "attention_mask": mask[:-1]}],
                         "--num-experts", str(E))
    assert rc == 2 and f"record 0: attention_mask has shape [{len(LENGTHS) - 1}, {P}]; allowed: [B, P] = " in err
    # a per-row record's mask (any engine): the value, not the shape
    rc, err, _ = convert(capsys, tmp_path, "slime", [{"routed_experts": ids[:3].tolist(), "attention_mask": [1, 2, 1]}],
                         "--num-experts", str(E))
    assert rc == 2 and "record 0: attention_mask[1] = 2; allowed: 0 or 1" in err, err


def test_top_k_flag_that_disagrees_with_the_file_is_refused(known, tmp_path, capsys):
    cfg, ids, offsets = known
    batch, mask = verl_batch(ids, offsets)
    record = {"routed_experts": batch, "attention_mask": mask}
    rc, err, _ = convert(capsys, tmp_path, "verl", [record], "--num-experts", str(E), "--top-k", str(K - 1))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"record 0: routed_experts[0] holds top-k {K} but --top-k is {K - 1}" in err, err
    rc, err, out = convert(capsys, tmp_path, "verl", [record], "--num-experts", str(E), "--top-k", str(K))
    assert rc == 0, err
    assert_same(out, ids, offsets)


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from relibra_torch.replay.engines import sglang_samples, vllm_samples  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(2, 9), min_size=1, max_size=4), dense=st.lists(st.booleans(), min_size=2, max_size=5),
       k=st.integers(1, 3), seed=st.integers(0, 2**16), split=st.integers(0, 8))
def test_engine_encodings_invert_for_any_shape(lengths, dense, k, seed, split):
    """SGLang (all layers, flat int32, any prompt/completion split) and vLLM (MoE layers,
    prompt + completion rows) responses of random replays decode to the same ids."""
    moe_map = tuple(not d for d in dense) if not all(dense) else (True,) + tuple(not d for d in dense[1:])
    L = sum(moe_map)
    ids = random_ids_TLK(sum(lengths), L, k, 8, seed=seed)
    full = torch.zeros(ids.shape[0], len(moe_map), k, dtype=torch.int64)
    full[:, [i for i, m in enumerate(moe_map) if m]] = ids
    offs = offsets_from_lengths(lengths)
    sg, vl = [], []
    for i in range(len(lengths)):
        T = lengths[i]
        P = 1 + split % T  # any split with P + C - 1 = T
        rows = full[offs[i]:offs[i + 1]].to(torch.int32).numpy()
        sg.append({"meta_info": {"prompt_tokens": P, "completion_tokens": T - P + 1,
                                 "routed_experts": base64.b64encode(rows.tobytes()).decode()}})
        moe = ids[offs[i]:offs[i + 1]]
        vl.append({"prompt_token_ids": list(range(P)), "prompt_routed_experts": moe[:P].tolist(),
                   "choices": [{"token_ids": list(range(T - P + 1)), "routed_experts": npy_b64(moe[P:].numpy())}]})
    for got in (sglang_samples(sg, moe_map, len(moe_map), k), vllm_samples(vl, moe_map, None, None)):
        assert [r for r, _ in got] == list(range(len(lengths)))
        assert torch.equal(torch.cat([t for _, t in got]), ids)
