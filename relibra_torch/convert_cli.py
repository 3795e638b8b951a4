"""relibra convert: serving-engine or RL-framework routing -> a relibra.routing/1 file.

IN is a JSON file (one response, or a list of them) or a JSONL file (one per line) of the
engine's responses; OUT is the replay file ``relibra simulate`` reads. Only the MoE layers
and only real tokens reach the file: the per-layer MoE map (from --model-config, or
--moe-layers) drops the dense layers slime and SGLang count in the layer dim, and pad rows
(an attention_mask or a length) are dropped. A record's "step" (an int) becomes its
samples' optimizer step. SGLang: /generate or OpenAI-compatible (sglext) responses. vLLM
rows of the generated tokens only (no prompt routing) are refused unless --completion-only.
Errors name the record, the field's row and the engine's layer. See docs/replay.md for each
engine's fields.

examples:
  relibra convert sglang responses.jsonl rollout.safetensors --model-config Qwen3-30B-A3B/config.json
  relibra convert vllm responses.json rollout.safetensors --model-config DeepSeek-V3/config.json
  relibra convert slime samples.jsonl rollout.safetensors --num-experts 128 --top-k 8 --moe-layers 1-45
  relibra convert verl batch.json rollout.safetensors --num-experts 64 --moe-layers 1-26
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .checks import check_int, counted
from .replay.convert import from_per_sample
from .replay.engines import (ENGINES, LayerIndices, check_pieces, parse_layer_spec, sglang_samples,
                              slime_samples, verl_samples, vllm_samples)

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
    parser.add_argument("--top-k", type=int, help="experts per token: splits SGLang's flat buffer, and a record "
                                                  "holding another top-k is refused (default: from --model-config)")
    parser.add_argument("--moe-layers", metavar="SPEC",
                        help="layers to keep, as indices of the layer dim the engine sends, e.g. 3-60 or "
                             "0-11 (default: the MoE layers of --model-config)")
    parser.add_argument("--model", help="model name stored in the file, e.g. a preset of relibra simulate "
                                        "(default: the --model-config name)")
    parser.add_argument("--completion-only", action="store_true",
                        help="accept vLLM responses whose rows cover the generated tokens only (no prompt "
                             "routing): their prompt tokens are left out, a warning says how many, and the file "
                             "is marked coverage=completion-only (default: refuse them)")


def read_records(path: str) -> list[dict]:
    """The JSON objects of a JSON file (an object or a list) or a JSONL file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"IN {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:  # a folder, no permission
        raise ValueError(f"IN {path!r} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"IN {path!r} is not UTF-8 text; allowed: JSON or JSONL") from None
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


def check_output(path: str) -> None:
    """Fail before converting when OUT cannot be written (one line naming OUT)."""
    if not os.path.isdir(path) and not path.endswith(".safetensors"):  # a .txt or .json name misleads readers
        raise ValueError(f"OUT {path!r}: a relibra.routing/1 file is safetensors; allowed: a path ending in "
                         f".safetensors, e.g. {os.path.splitext(path)[0] + '.safetensors'!r}")
    if os.path.isdir(path):
        raise ValueError(f"OUT {path!r} is a folder; allowed: a file path such as {os.path.join(path, 'rollout.safetensors')!r}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"OUT {path!r}: folder {os.path.dirname(path) or folder!r} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"OUT {path!r}: folder {os.path.dirname(path) or folder!r} is not writable")


def _save(replay, path: str) -> None:
    from safetensors import SafetensorError

    try:
        replay.save(path)
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"OUT {path!r} cannot be written: {' '.join(str(exc).split())}") from None


def run(args: argparse.Namespace) -> int:
    """Convert ``args.input`` and write ``args.output``; bad input raises ValueError naming the flag."""
    check_output(args.output)
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
    if args.moe_layers is not None:  # "" too: an empty spec is refused, not read as no selection
        layers = LayerIndices(parse_layer_spec(args.moe_layers, hf.spec.num_layers if hf else None))
    elif hf is not None:
        layers = hf.moe_layers
    records = read_records(args.input)
    samples = _CONVERTERS[args.engine](records, layers, hf.spec.num_layers if hf else None, top_k,
                                       completion_only=args.completion_only)
    if not samples:
        raise ValueError(f"IN {args.input!r} holds no sample")
    sample_step = _steps(records, [s.record for s in samples])
    for s in samples:
        where = f"record {s.record}: {s.pieces[-1].field}"
        if s.ids.shape[0] == 0:
            raise ValueError(f"{where}: a sample with no real token (all rows are pads)")
        if 0 in s.ids.shape[1:]:
            raise ValueError(f"{where} has [layers, top_k] = {list(s.ids.shape[1:])}; allowed: >= 1 each")
        if args.top_k is not None and s.ids.shape[2] != args.top_k:
            raise ValueError(f"{where} holds top-k {s.ids.shape[2]} but --top-k is {args.top_k}; pass the top-k of "
                             f"the model that served IN, or leave --top-k out (nested lists carry their top-k)")
        if hf is not None and args.moe_layers is None and s.ids.shape[2] != hf.spec.top_k:
            raise ValueError(f"{where} holds top-k {s.ids.shape[2]} but --model-config has top_k "
                             f"{hf.spec.top_k}; pass the config of the model that served IN")
        if s.ids.shape[1:] != samples[0].ids.shape[1:]:
            p = s.pieces[-1]
            raise ValueError(f"record {s.record}: {p.field} has [layers, top_k] = {list(s.ids.shape[1:])} but "
                             f"record {samples[0].record} has {list(samples[0].ids.shape[1:])}; allowed: the same "
                             f"model for every record")
    check_pieces([p for s in samples for p in s.pieces], num_experts)
    partial = [s for s in samples if s.completion_only]
    model = args.model if args.model is not None else (hf.spec.name if hf else None)
    replay = from_per_sample([s.ids for s in samples], num_experts, model=model, sample_step=sample_step,
                             coverage="completion-only" if partial else None)
    _save(replay, args.output)
    steps = f" in {counted(len(set(sample_step)), 'step')}" if sample_step is not None else ""
    print(f"wrote {args.output}: {counted(replay.num_samples, 'sample')}{steps}, {counted(replay.num_tokens, 'token')}, "
          f"{counted(replay.num_layers, 'MoE layer')}, top-{replay.top_k} of {counted(num_experts, 'expert')}"
          + (f", model {model}" if model else ""))
    if partial:
        missing = sum(s.missing_prompt for s in partial)
        print(f"WARNING: {len(partial)} of {replay.num_samples} samples hold their generated tokens only: "
              f"{missing} prompt tokens have no routing and are not in the file (metadata "
              f"coverage=completion-only); training replay needs them", file=sys.stderr)
    return 0
