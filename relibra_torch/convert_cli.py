"""relibra convert: serving-engine or RL-framework routing -> a relibra.routing/1 file.

IN is a JSON file (one response, or a list of them) or a JSONL file (one per line) of the
engine's responses; OUT is the replay file ``relibra simulate`` reads. Only the MoE layers
and only real tokens reach the file: the per-layer MoE map (from --model-config, or
--moe-layers) drops the dense layers slime and SGLang count in the layer dim, and pad rows
(an attention_mask or a length) are dropped. A record's "step" (an int) becomes its
samples' optimizer step. See docs/replay.md for each engine's fields.

examples:
  relibra convert sglang responses.jsonl rollout.safetensors --model-config Qwen3-30B-A3B/config.json
  relibra convert vllm responses.json rollout.safetensors --model-config DeepSeek-V3/config.json
  relibra convert verl batch.json rollout.safetensors --num-experts 64 --moe-layers 1-26
"""

from __future__ import annotations

import argparse
import json
import os

from .checks import check_int
from .replay.convert import from_per_sample
from .replay.engines import (ENGINES, LayerIndices, parse_layer_spec, sglang_samples, slime_samples,
                      verl_samples, vllm_samples)

HELP = "convert SGLang / vLLM / verl / slime routing responses (JSON or JSONL) to a relibra.routing/1 file"

_CONVERTERS = {"sglang": sglang_samples, "slime": slime_samples, "vllm": vllm_samples,
               "verl": verl_samples}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("engine", choices=ENGINES, help="the layout of IN")
    parser.add_argument("input", metavar="IN", help="JSON or JSONL file of responses")
    parser.add_argument("output", metavar="OUT", help="relibra.routing/1 file to write (.safetensors)")
    parser.add_argument("--model-config", metavar="CONFIG.json",
                        help="the model's Hugging Face config.json: expert count, top-k, which layers are MoE, name")
    parser.add_argument("--num-experts", type=int, help="routed experts E (default: from --model-config)")
    parser.add_argument("--top-k", type=int, help="experts per token (SGLang's flat buffer; default: from --model-config)")
    parser.add_argument("--moe-layers", metavar="SPEC",
                        help="layers to keep, as indices of the layer dim the engine sends, e.g. 3-60 or "
                             "0-11 (default: the MoE layers of --model-config)")
    parser.add_argument("--model", help="model name stored in the file, e.g. a preset of relibra simulate "
                                        "(default: the --model-config name)")


def read_records(path: str) -> list[dict]:
    """The JSON objects of a JSON file (an object or a list) or a JSONL file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"IN {path!r} does not exist")
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        data = json.loads(text)
        records = data if isinstance(data, list) else [data]
    except json.JSONDecodeError as first:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"IN {path!r} is neither JSON ({first.msg} at char {first.pos}) nor "
                                 f"JSONL (line {n} is not JSON)") from None
    if not records or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"IN {path!r} must hold JSON objects (responses); got "
                         f"{'nothing' if not records else type(next(r for r in records if not isinstance(r, dict))).__name__}")
    return records


def _steps(records: list[dict], record_of_sample: list[int]) -> list[int] | None:
    """Per-sample optimizer steps from the records' ``step`` fields (all or none)."""
    steps = [records[i].get("step") for i in record_of_sample]
    if all(s is None for s in steps):
        return None
    for i, s in zip(record_of_sample, steps):
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(f"record {i} has step = {s!r}; allowed: an int >= 0 in every record "
                             f"(the optimizer step; relibra simulate batches each step), or in none")
    return steps


def run(args: argparse.Namespace) -> int:
    """Convert ``args.input`` and write ``args.output``; bad input raises ValueError naming the flag."""
    hf = None
    if args.model_config:
        from .sim.hf_config import model_from_hf_config
        hf = model_from_hf_config(args.model_config)
    num_experts = args.num_experts if args.num_experts is not None else (hf.spec.num_experts if hf else None)
    if num_experts is None:
        raise ValueError("the expert count is unknown; pass --model-config CONFIG.json or --num-experts E")
    check_int("--num-experts", num_experts)
    if args.top_k is not None:
        check_int("--top-k", args.top_k)
    top_k = args.top_k if args.top_k is not None else (hf.spec.top_k if hf else None)
    layers = None
    if args.moe_layers:
        layers = LayerIndices(parse_layer_spec(args.moe_layers, hf.spec.num_layers if hf else None))
    elif hf is not None:
        layers = hf.moe_layers
    records = read_records(args.input)
    pairs = _CONVERTERS[args.engine](records, layers, hf.spec.num_layers if hf else None, top_k)
    samples = [ids for _, ids in pairs]
    sample_step = _steps(records, [i for i, _ in pairs])
    if hf is not None and args.moe_layers is None and samples and samples[0].shape[2] != hf.spec.top_k:
        raise ValueError(f"IN holds top-k {samples[0].shape[2]} but --model-config has top_k "
                         f"{hf.spec.top_k}; pass the config of the model that served IN")
    for n, ids in enumerate(samples):
        if ids.numel() and int(ids.min()) < 0:  # sglang-jax and others mark "no expert" with -1
            layers_bad = sorted(set((ids < 0).nonzero()[:, 1].tolist()))
            raise ValueError(f"sample {n} holds negative (placeholder) ids in kept layers {layers_bad}; "
                             f"keep only the MoE layers with --moe-layers or --model-config")
    model = args.model if args.model is not None else (hf.spec.name if hf else None)
    try:
        replay = from_per_sample(samples, num_experts, model=model, sample_step=sample_step)
    except ValueError as exc:
        hint = "; the expert count comes from --num-experts or --model-config" if "out of range" in str(exc) else ""
        raise ValueError(f"{exc}{hint}") from None
    replay.save(args.output)
    steps = f" in {len(set(sample_step))} steps" if sample_step is not None else ""
    print(f"wrote {args.output}: {replay.num_samples} samples{steps}, {replay.num_tokens} tokens, "
          f"{replay.num_layers} MoE layers, top-{replay.top_k} of {num_experts} experts"
          + (f", model {model}" if model else ""))
    return 0
