"""relibra serve-sim: P90 goodput of MoE serving systems on a request trace (ExpertPlex model).

Simulates instance-level prefill-decode disaggregation (pd-disagg), Green-Context
prefill-decode colocation (pd-colocate), plain colocation (colocated), chunked prefill and
ExpertPlex (per-phase attention servers, shared tile-multiplexed expert servers; with
expertplex-repl, hot experts replicated on them from recent routing) on one cluster; each
system's knobs are searched for the highest P90 goodput (the highest arrival rate at which
90% of requests meet both the TTFT and the TPOT SLO; a real trace's rate is changed by
dividing its inter-arrival times). With no arguments: a MiniMax-M2-shaped model on 2 x 8
H200, the first 5 minutes of the Azure LLM inference 2023 conversation trace, the paper's
SLO (TTFT 1 s, TPOT 50 ms), synthetic routing, the five systems compared; about a minute on
2 CPU cores (--systems all adds expertplex-repl: about two minutes). See docs/serving.md for
the model, its constants and their sources.

examples:
  relibra serve-sim
  relibra serve-sim --systems all --json out.json   (with replication on the expert servers)
  relibra serve-sim --hardware h800 --nodes 3 --json out.json --plot out.png
  relibra serve-sim --trace mooncake.jsonl --systems expertplex,pd-disagg
  relibra serve-sim --rate 20 --num-requests 2000 --model-config GLM-4.5-Air/config.json
  relibra serve-sim --lengths sharegpt --hardware h800 --nodes 3   (Poisson, ShareGPT-like lengths)
  relibra serve-sim --gpu-check out/gpu-check/gpu_check.json   (the measured kernel's rate)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from ..checks import check_int, check_number
from ..planning.pricing import HARDWARE, get_hardware
from ..sim.presets import MODELS, apply_overrides, get_model
from ..sim.run_checks import check_output_path
from .constants import DEFAULT_CONSTANTS, override_constants

HELP = "P90 goodput of MoE serving systems (ExpertPlex, PD disaggregation/colocation) on a request trace"

# the systems compared by default, and the one opt-in: ExpertPlex with EPLB's layout and replicas on
# its expert servers (relibra's balancing there), about as long to search as the five together
DEFAULT_SYSTEMS = ("expertplex", "pd-colocate", "pd-disagg", "colocated", "chunked-prefill")
ALL_SYSTEMS = (*DEFAULT_SYSTEMS, "expertplex-repl")
DEFAULT_TRACE = "azure-llm-inference-2023-conv.csv"
DEFAULT_WINDOW_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", help=f"request trace: Azure .csv or Mooncake .jsonl (default: ../shared/data/"
                                   f"{DEFAULT_TRACE})")
    p.add_argument("--window-start", type=float, help="trace window start, s (default 0)")
    p.add_argument("--window", type=float,
                   help=f"trace window length, s (default {DEFAULT_WINDOW_S:g}; 0 = to the trace's end)")
    p.add_argument("--rate", type=float, help="Poisson arrivals at this rate (req/s), lengths drawn from the trace")
    p.add_argument("--num-requests", type=int, help="Poisson requests, with --rate or --lengths (default 1000)")
    p.add_argument("--lengths", default="trace", choices=("trace", "sharegpt", "loogle"),
                   help="request lengths with --rate: drawn from the trace (default), or ShareGPT- / "
                        "LooGLE-like fitted distributions (sources in docs/serving.md)")
    p.add_argument("--output-len", type=int, help="every request generates this many tokens (as "
                                                  "bench_serving --sharegpt-output-len)")
    p.add_argument("--routing", metavar="FILE", help="routing replay or loads file for expert loads "
                                                     "(default: the synthetic trace model's calibrated heat)")
    p.add_argument("--model", default="minimax-m2", help=f"model preset: {', '.join(MODELS)} (default minimax-m2)")
    p.add_argument("--model-config", metavar="CONFIG.json", help="a Hugging Face config.json instead of --model")
    p.add_argument("--hardware", default="h200", help=f"GPU preset: {', '.join(HARDWARE)} (default h200)")
    p.add_argument("--nodes", type=int, default=2, help="nodes (default 2)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated systems, from {','.join(ALL_SYSTEMS)}, or all (default: all but "
                        f"expertplex-repl)")
    p.add_argument("--ttft-slo", type=float, help="TTFT SLO, s (default 1)")
    p.add_argument("--tpot-slo", type=float, help="TPOT SLO, s (default 0.05)")
    p.add_argument("--tile-time-us", type=float, help="expert row-tile time, us (default: roofline)")
    p.add_argument("--gpu-check", metavar="gpu_check.json",
                   help="price expert tiles at the rate make gpu-check's kernel reached (its file or folder)")
    p.add_argument("--allow-idle", action="store_true", help="let the search leave GPUs idle (slower)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a field: serving.*, hardware.*, model.* (repeatable)")
    p.add_argument("--seed", type=int, default=0, help="seed for routing draws and Poisson arrivals")
    p.add_argument("--jobs", type=int, default=2, help="systems searched at once, one process each "
                                                       "(default 2; the results do not depend on it)")
    p.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    p.add_argument("--plot", metavar="OUT.png", help="write SLO attainment against rate per system")


def _overrides(items: list[str]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {"serving": {}, "hardware": {}, "model": {}}
    for text in items:
        key, eq, value = text.partition("=")
        section, dot, name = key.partition(".")
        if not eq or not dot or section not in out:
            raise ValueError(f"--set {text!r} must look like SECTION.FIELD=VALUE with SECTION one of "
                             f"serving, hardware, model")
        out[section][name.strip()] = value.strip()
    return out


def _systems(text: str) -> tuple[str, ...]:
    """``--systems`` as a tuple of known systems (at least one)."""
    if text.strip() == "all":
        return ALL_SYSTEMS
    systems = tuple(s.strip() for s in text.split(",") if s.strip())
    if not systems:
        raise ValueError(f"--systems is empty; allowed: {','.join(ALL_SYSTEMS)}, or all")
    for s in systems:
        if s not in ALL_SYSTEMS:
            raise ValueError(f"--systems: unknown system {s!r}; allowed: {', '.join(ALL_SYSTEMS)}, or all")
    return systems


def _window(args) -> tuple[float, float]:
    """``--window-start`` and ``--window`` (0: to the trace's end); neither applies to
    ``--lengths sharegpt|loogle``, whose requests are drawn, not read; ``--num-requests`` only
    to drawn (Poisson) requests."""
    if args.lengths != "trace" and (args.window is not None or args.window_start is not None):
        raise ValueError(f"--window / --window-start select part of a trace; --lengths {args.lengths} draws its "
                         f"requests (drop them, or use --lengths trace)")
    if args.num_requests is not None and args.rate is None and args.lengths == "trace":
        raise ValueError("--num-requests sets how many Poisson requests --rate draws; a trace's own requests are "
                         "all used (add --rate, or select them with --window)")
    start = check_number("--window-start", 0.0 if args.window_start is None else args.window_start, 0)
    window = DEFAULT_WINDOW_S if args.window is None else args.window
    if not math.isfinite(window) or window < 0:
        raise ValueError(f"--window = {window}; allowed: a finite number > 0 (seconds), or 0 for the rest of the "
                         "trace")
    return start, float(window)


def _weight_format_notes(path: str, serving_sets: dict) -> list[str]:
    """The model prices an FP8 deployment (``serving.weight_bytes`` 1, FP8 GEMMs): say so when
    the config's checkpoint is stored otherwise (``quantization_config``, else ``torch_dtype``)."""
    from ..sim.hf_config import load_hf_config  # a file or the folder holding it, as --model-config

    cfg = load_hf_config(path)
    quant = cfg.get("quantization_config") if isinstance(cfg.get("quantization_config"), dict) else {}
    stored = str(quant.get("quant_method") or cfg.get("torch_dtype") or cfg.get("dtype") or "").lower()
    groups = quant.get("config_groups") if isinstance(quant.get("config_groups"), dict) else {}
    weights = [g.get("weights") for g in groups.values() if isinstance(g, dict)]
    if weights and all(isinstance(w, dict) and w.get("num_bits") == 8 and w.get("type") == "float"
                       for w in weights):
        return []  # compressed-tensors with 8-bit float weights: an FP8 checkpoint
    if not stored or "fp8" in stored or "weight_bytes" in serving_sets:
        return []
    return [f"the checkpoint stores its weights as {stored}; the model prices an FP8 deployment (weights at "
            f"serving.weight_bytes = 1 byte, FP8 expert GEMMs), as SGLang serves it with --quantization fp8; "
            f"--set serving.weight_bytes sets the weight bytes"]


def check_options(args) -> tuple[tuple[str, ...], tuple[float, float]]:
    """Check what needs no file read, before any work: the output paths, the systems, the
    seed, the window and the worker count (one line naming the option). Returns the systems
    and ``(window start, window)``."""
    check_output_path("json", args.json)
    check_output_path("plot", args.plot)
    systems = _systems(args.systems)
    check_int("--seed", args.seed, 0, (1 << 63) - 1)
    window = _window(args)
    check_int("--jobs", args.jobs)
    return systems, window


def setup_from_args(args):
    """A :class:`~relibra_torch.serving.compare.CompareSetup` from parsed options."""
    from ..sim.data_refs import shared_data_dir
    from .compare import CompareSetup
    from .lengths import poisson_lengths
    from .requests import load_trace, poisson_requests
    from .routing import popularity_from_file, synthetic_popularity

    systems, (start, window) = check_options(args)  # before any file is read and the search runs
    num_requests = 1000 if args.num_requests is None else args.num_requests
    sets = _overrides(args.set)
    model_notes: tuple[str, ...] = ()
    if args.model_config:
        from ..sim.hf_config import model_from_hf_config
        read = model_from_hf_config(args.model_config)
        model, model_notes = read.spec, (*read.notes, *_weight_format_notes(args.model_config, sets["serving"]))
    else:
        model = get_model(args.model)
    model = apply_overrides(model, "model", sets["model"])
    if not args.routing:  # the synthetic trace's expert counts, under the user's name for the field
        from ..sim.model_choice import check_trace_experts
        check_trace_experts(model, sets["model"], args.model_config and
                            f"--model-config {args.model_config!r}: {read.experts_field}", fix="--routing FILE")
    hardware = apply_overrides(get_hardware(args.hardware), "hardware", sets["hardware"])
    consts = override_constants(DEFAULT_CONSTANTS, sets["serving"])
    slo = {}
    if args.ttft_slo is not None:
        slo["ttft_slo_s"] = str(check_number("--ttft-slo", args.ttft_slo, 0, strict=True))
    if args.tpot_slo is not None:
        slo["tpot_slo_s"] = str(check_number("--tpot-slo", args.tpot_slo, 0, strict=True))
    consts = override_constants(consts, slo)
    nodes = check_int("--nodes", args.nodes)
    gpn = check_int("--gpus-per-node", args.gpus_per_node)
    if args.lengths != "trace":
        if args.trace:
            raise ValueError(f"--lengths {args.lengths} draws its own lengths; drop --trace or use --lengths trace")
        reqs = poisson_lengths(args.lengths, 10.0 if args.rate is None else args.rate, num_requests,
                               args.seed, args.output_len)
    else:
        path = args.trace or str(shared_data_dir() / DEFAULT_TRACE)
        if args.json and os.path.realpath(args.json) == os.path.realpath(path):
            raise ValueError(f"--json {args.json!r} is the trace itself; it would be overwritten (name another file)")
        reqs = load_trace(path)
        if window or start:
            reqs = reqs.window(start, window or math.inf)
        if args.rate is not None:
            reqs = poisson_requests(args.rate, num_requests, reqs, args.seed)
        elif reqs.duration_s <= 0:  # nothing to divide: a trace's rate is changed through its gaps
            raise ValueError(f"{reqs.source}: its {len(reqs)} request(s) arrive at one time, so it has no arrival "
                             f"rate to scale; allowed: a trace (window) whose arrivals spread over time (widen "
                             f"--window), or --rate R for Poisson arrivals with these lengths")
        if args.output_len is not None:
            reqs = reqs.with_output(check_int("--output-len", args.output_len))
    if args.routing:
        pi = popularity_from_file(args.routing, model.num_moe_layers, model.num_experts, model.top_k,
                                  model.num_dense_layers)
        routing = f"routing file {os.path.basename(args.routing)}"
    else:
        pi = synthetic_popularity(model.num_moe_layers, model.num_experts, model.top_k, args.seed)
        routing = "synthetic trace model (Qwen3-30B-A3B-calibrated heat, resampled to the model's shape)"
    tile_us, tile_src = None, "roofline (M_t x 6 D F FLOPs at the FP8 rate)"
    if args.gpu_check:
        from .runtime.calibration import kernel_flops  # the one reader of the runtime's measurement

        # the kernel's measured bf16 rate, doubled for the FP8 GEMMs the model prices (the roofline's
        # own ratio), over one row tile of this model's expert: the measured shape need not be the model's
        flops = kernel_flops(args.gpu_check)
        tile_us = consts.tile_m * 6 * model.hidden_size * model.moe_ffn / (2 * flops) * 1e6
        tile_src = f"measured: the gpu-check kernel's {flops / 1e12:.0f} bf16 TFLOP/s as FP8, {args.gpu_check}"
    if args.tile_time_us is not None:
        tile_us, tile_src = check_number("--tile-time-us", args.tile_time_us, 0, strict=True), "--tile-time-us"
    return CompareSetup(model, hardware, consts, nodes, gpn, reqs, pi, systems, routing, tile_us, tile_src,
                        args.allow_idle, args.seed, model_notes)


def run(args) -> int:
    from rich.console import Console

    from .compare import compare, rate_notes
    from .report import print_report, write_json, write_plot

    setup = setup_from_args(args)  # checks the options, --jobs included, before the trace is read
    jobs = args.jobs
    for note in rate_notes(setup.requests):  # before a search that such a rate makes long
        print(f"relibra serve-sim: warning: {note}", file=sys.stderr, flush=True)
    console = Console()
    if console.is_terminal:
        with console.status("searching configurations...") as status:
            doc = compare(setup, progress=lambda s, i, n: status.update(f"{s} done ({i}/{n})"), workers=jobs)
    else:  # a file or pipe: a line per system as it finishes, and a table wide enough for its columns
        console = Console(width=180)
        t0 = time.perf_counter()
        print(f"relibra serve-sim: searching {len(setup.systems)} system(s)", file=sys.stderr, flush=True)
        doc = compare(setup, workers=jobs, progress=lambda s, i, n: print(
            f"relibra serve-sim: {time.perf_counter() - t0:.0f} s: {s} done ({i}/{n})", file=sys.stderr, flush=True))
    print_report(doc, console)
    if args.json:
        write_json(doc, args.json)
    if args.plot:
        write_plot(doc, args.plot)
    if not any(r["fits"] for r in doc["systems"].values()):
        print("relibra serve-sim: error: no system has a configuration that fits this cluster (see the notes "
              "above); add --nodes or pick a smaller model", file=sys.stderr)
        return 2
    return 0
