"""relibra simulate: how much faster is a training step with relibra than with static
placement or DeepSeek EPLB, on your model, cluster and RL data?

Runs every requested balancing system on the same expert loads and prints, per system,
imbalance, MoE-layer and step time, speedup over static and over oracle EPLB, fraction of
the lower bound's step time (sim/bound.py), traffic and planner time. With no file it generates the default
synthetic RL trace (seeded, mixed tasks). A routing replay file (relibra.routing/1) is
batched into ranks and micro-batches by relibra_torch.replay.batch_samples (see
docs/simulator.md); a loads file (relibra.loads/1) is used as batched. --trace picks the
synthetic trace family, --packing how each step's samples are packed into ranks and
micro-batches (fixed: the source's rule; length; routepack: replay-aware, docs/packing.md).

Precedence of settings: command-line options > --config FILE > built-in defaults. For the
model: --set model.FIELD=VALUE > --model-config (a Hugging Face config.json) > --config FILE
> --model; with a file and none of them, the preset named by the file's model metadata, or
the only preset with the file's experts, top-k and MoE layers. --set SECTION.FIELD=VALUE
overrides single fields (e.g. --set hardware.inter_node_gbps=25).

examples:
  relibra simulate
  relibra simulate --model qwen3-235b-a22b --nodes 16 --systems static,eplb-oracle,relibra
  relibra simulate replay.safetensors --model qwen3-30b-a3b --json out.json --plot out.png
  relibra simulate replay.safetensors --model-config Mixtral-8x7B/config.json --nodes 1
  relibra simulate --trace long-tail --packing routepack --systems static,eplb-oracle,relibra
  relibra simulate --trace rank-mix --dispatch hierarchical
"""

from __future__ import annotations

import argparse
import sys

from ..checks import check_choice, check_int, check_number
from .baselines import SECTIONS as BASELINE_SECTIONS
from .baselines import baseline_options
from .cost import CostOptions
from .dispatch import DISPATCH_MODES
from .memory import memory_settings, memory_verdict, peak_warnings, replicating, workload_activations
from .memory_fit import TraceShape, home_activations, precheck, synthetic_activations
from .layouts import cluster_layout, group_home_activations
from .model_choice import check_file_model, file_shape, resolve_model
from .presets import (HARDWARE, MODELS, apply_overrides, get_hardware, load_config_file,
                      parse_override)
from .simulator import SYSTEMS, SimConfig, parse_systems, simulate
from .traces.families import FAMILIES
from .workload import DEFAULT_SAMPLE_TOKENS, synthetic_workload, workload_from_file
from ..planning.packing import PACKING_METHODS
from .packed import replay_packing_workload, sample_workload
from .trace_families import TRACE_FAMILIES
from .run_checks import PlainProgress, check_output_path, check_warmup, file_steps, refuse_synthetic_options

# Count-level families (generated per rank and micro-batch) and sample-level ones (per
# sample, so --packing can repack them); "default" is both.
ALL_TRACES = tuple(FAMILIES) + tuple(f for f in TRACE_FAMILIES if f not in FAMILIES)


def _cost_model(s: dict):
    from .cost import CostModel
    return CostModel(s["model_spec"], s["hardware_spec"], s["cost_options"])

HELP = "compare step times of static, EPLB, online replication and relibra balancing on a simulated cluster"

DEFAULTS = {
    "model": "qwen3-30b-a3b",
    "model_config": None,
    "hardware": "h200",
    "nodes": 4,
    "gpus_per_node": 8,
    "replica_slots": 2,
    "micro_batch_tokens": 8192,
    "micro_batches": 32,
    "steps": 2,
    "warmup_steps": None,  # 1 when there are >= 2 steps (EPLB needs a step of history), else 0
    "systems": ",".join(SYSTEMS),
    "seed": 0,
    "sample_tokens": DEFAULT_SAMPLE_TOKENS,
    "overlap_replication": False,
    "refetch_replicas": False,
    "dispatch": None,  # hierarchical with more than one node (DeepEP-style, what cross-node EP runs), else flat
    "json": None,
    "plot": None,
    "trace": "default",
    "packing": "fixed",
    "ignore_memory": False,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``relibra simulate``'s options (defaults resolved in :func:`resolve`)."""
    d = DEFAULTS
    parser.add_argument("file", nargs="?", metavar="REPLAY_OR_LOADS_FILE",
                        help="routing replay or loads file (safetensors); default: synthetic RL trace")
    parser.add_argument("--model", help=f"model preset: {', '.join(MODELS)} (default {d['model']}; "
                        f"with a file: the model the file names)")
    parser.add_argument("--model-config", metavar="CONFIG.json",
                        help="the model's Hugging Face config.json (qwen3_moe, qwen2_moe, deepseek_v2/v3, "
                             "glm4_moe, mixtral, olmoe, gpt_oss); overrides --model and --config's model")
    parser.add_argument("--hardware", help=f"GPU preset: {', '.join(HARDWARE)} (default {d['hardware']})")
    parser.add_argument("--nodes", type=int, help=f"nodes (default {d['nodes']})")
    parser.add_argument("--gpus-per-node", type=int, help=f"GPUs per node (default {d['gpus_per_node']})")
    parser.add_argument("--replica-slots", type=int,
                        help=f"replica slots per GPU, R (default {d['replica_slots']})")
    parser.add_argument("--micro-batch-tokens", type=int,
                        help=f"tokens per micro-batch per GPU, synthetic trace (default {d['micro_batch_tokens']})")
    parser.add_argument("--micro-batches", type=int,
                        help=f"micro-batches per step (default {d['micro_batches']}; a routing replay file "
                             f"gets at most the fewest samples a rank holds in a step, and a note says so)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps, synthetic trace (default {d['steps']})")
    parser.add_argument("--warmup-steps", type=int,
                        help="leading steps run but not reported (default 1 when the trace or file has "
                             ">= 2 steps, else 0: a one-step file is planned from uniform history)")
    parser.add_argument("--systems", help=f"comma-separated, from {','.join(SYSTEMS)} "
                        f"(static and the references uniform and bound always run; default all)")
    parser.add_argument("--seed", type=int, help=f"synthetic trace seed (default {d['seed']})")
    parser.add_argument("--sample-tokens", type=int,
                        help=f"sample length assumed for the attention term when the source has no "
                             f"sample lengths (default {d['sample_tokens']})")
    parser.add_argument("--overlap-replication", action="store_true", default=None,
                        help="hide replica fill / gradient return behind attention (and shared "
                             "experts), for every system")
    parser.add_argument("--refetch-replicas", action="store_true", default=None,
                        help="price the layer's refetch_replicas=True: no kept replica buffers, two "
                             "weight fetches, one gradient return and the recomputed replica rows per "
                             "micro-batch (default: kept buffers, one fill and one return per residency)")
    parser.add_argument("--dispatch", choices=DISPATCH_MODES,
                        help=f"all-to-all model: flat = one copy per token-expert pair; hierarchical = "
                             f"one copy per token and remote node, NVLink fan-out (DeepEP) "
                             f"(default: hierarchical with more than one node, flat inside one)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a preset field or a baseline setting, e.g. "
                             "hardware.nvlink_gbps=300, eplb.interval=4, online.plan_latency_us=50 "
                             "(repeatable)")
    parser.add_argument("--config", metavar="FILE",
                        help="JSON or TOML file with model/hardware/eplb/online/simulate sections")
    parser.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", help="write the imbalance and step-time plot")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (a bar on a terminal, plain lines otherwise)")
    parser.add_argument("--compare-ep", metavar="SIZES",
                        help="compare EP layouts on this cluster, e.g. 8,16,32: the same trace split into "
                             "EP groups of each size, every system, expert gradient sync priced "
                             "(docs/simulator.md, 'EP layouts')")
    parser.add_argument("--trace", choices=ALL_TRACES,
                        help="synthetic trace family: " + "; ".join(f"{f.name}: {f.description}"
                                                                    for f in TRACE_FAMILIES.values())
                             + "; rank-mix: per-rank task mixes that drift (static imbalance >= 3); "
                               "collapsed: in some layers a few experts take most tokens, changing every "
                               f"micro-batch (default {d['trace']}; see docs/traces.md)")
    parser.add_argument("--packing", choices=PACKING_METHODS,
                        help="how a step's samples are packed into ranks and micro-batches, one packing "
                             "per step shared by every system: fixed (the source's rule), length "
                             "(longest first, balancing attention and tokens), routepack (replay-aware "
                             "search) "
                             f"(default {d['packing']})")
    parser.add_argument("--ignore-memory", action="store_true", default=None,
                        help="run a configuration that does not fit the GPUs' memory (what-if; a warning "
                             "line says so); the memory model: --set memory.FIELD=VALUE, docs/simulator.md")


def resolve(args: argparse.Namespace) -> dict:
    """Merge command line, config file and defaults; build and validate every setting.

    Returns a dict with ``model_spec``, ``hardware_spec``, ``topology``, ``cost_options``,
    ``model_from`` (how the model was chosen), ``model_notes`` and the plain options.
    Raises ``ValueError`` naming the option and what is allowed.
    """
    file_cfg = load_config_file(args.config) if args.config else {}
    sim_cfg = file_cfg.get("simulate", {}) or {}
    if not isinstance(sim_cfg, dict):
        raise ValueError("--config: 'simulate' must be an object of option: value")
    unknown = set(sim_cfg) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"--config: unknown simulate options {sorted(unknown)}; allowed: {sorted(DEFAULTS)}")
    opts = {}
    for key, default in DEFAULTS.items():
        cli = getattr(args, key, None)
        opts[key] = cli if cli is not None else sim_cfg.get(key, default)
    if isinstance(opts["systems"], list):  # a TOML/JSON list of names reads as the comma-separated option
        opts["systems"] = ",".join(map(str, opts["systems"]))

    def _int_option(name: str, value: object, minimum: int) -> int:  # the error names where the value came from
        given = f"--{name.replace('_', '-')}" if getattr(args, name, None) is not None or name not in sim_cfg else None
        return check_int(given or f"--config [simulate] {name}", value, minimum)

    def spec(section: str, getter):
        raw = file_cfg.get(section)
        fields_from_file: dict = {}
        preset = opts[section]
        if isinstance(raw, str):
            preset = raw if getattr(args, section) is None else preset
        elif isinstance(raw, dict):
            fields_from_file = {k: v for k, v in raw.items() if k != "preset"}
            if "preset" in raw and getattr(args, section) is None:
                preset = raw["preset"]
        elif raw is not None:
            raise ValueError(f"--config: '{section}' must be a preset name or an object of fields")
        base = apply_overrides(getter(preset), section, fields_from_file)
        sets = {}
        for text in args.set or []:
            sec, name, value = parse_override(text)
            if sec == section:
                sets[name] = value
        return apply_overrides(base, section, sets)

    nodes = _int_option("nodes", opts["nodes"], 1)
    gpn = _int_option("gpus_per_node", opts["gpus_per_node"], 1)
    # the model: --set > --model-config > --config > --model, or what a file names (model_choice)
    shape = file_shape(args.file) if args.file else None
    model, named_by, notes = resolve_model(args, opts, file_cfg, sim_cfg, shape)
    hardware = spec("hardware", get_hardware)
    if shape is not None:
        check_file_model(shape, model, named_by, nodes * gpn)
    opts["model"], opts["hardware"] = model.name, hardware.name

    replica_slots = _int_option("replica_slots", opts["replica_slots"], 0)
    for name in ("micro_batch_tokens", "micro_batches", "steps", "sample_tokens"):
        _int_option(name, opts[name], 1)
    _int_option("seed", opts["seed"], 0)
    # the whole cluster's topology; under --compare-ep on a cluster the experts do not divide:
    # the largest EP group's, and the cluster's shape for the trace (layouts.cluster_layout)
    topology, cluster, ep_sizes = cluster_layout(nodes, gpn, model.num_experts, replica_slots,
                                                 getattr(args, "compare_ep", None), model.name)
    world = None if cluster is topology else cluster.num_gpus  # the dense part's data-parallel GPUs
    if opts["warmup_steps"] is None and not args.file:
        opts["warmup_steps"] = 1 if opts["steps"] > 1 else 0
    if opts["warmup_steps"] is not None:  # a file's default depends on its steps (see run)
        _int_option("warmup_steps", opts["warmup_steps"], 0)
    baselines = _baseline_settings(args, file_cfg)
    opts["skew"] = _trace_skew(args, file_cfg)
    systems = parse_systems(opts["systems"])
    if args.file:
        refuse_synthetic_options(args.file, opts, {k for k in ("steps", "micro_batch_tokens", "seed", "micro_batches")
                                                   if getattr(args, k, None) is not None or k in sim_cfg})
    _check_trace_packing(args.file, opts)
    # checked now, not after a run of minutes
    check_output_path("json", opts["json"])
    check_output_path("plot", opts["plot"])
    check_warmup(opts["warmup_steps"], file_steps(args.file) if args.file else opts["steps"],
                 f"the file {args.file!r}" if args.file else "the synthetic trace (--steps)")
    overlap = opts["overlap_replication"]
    if not isinstance(overlap, bool):
        raise ValueError(f"--overlap-replication = {overlap!r}; allowed: true or false")
    if opts["dispatch"] is None:  # what cross-node EP runs in practice; one node: the two are the same
        opts["dispatch"] = "hierarchical" if nodes > 1 else "flat"
    check_choice("--dispatch", opts["dispatch"], DISPATCH_MODES)
    if not isinstance(opts["refetch_replicas"], bool):
        raise ValueError(f"--refetch-replicas = {opts['refetch_replicas']!r}; allowed: true or false")
    memory = memory_settings(file_cfg, args.set or [])
    # the state, replica slots and the ideal system's activations: refused before any trace
    # when a synthetic trace of fixed packing sets them (every rank holds --micro-batch-tokens);
    # otherwise once the trace or file is read (run), so the advice counts the same terms
    warnings = []
    if not args.file and opts["trace"] in FAMILIES and opts["packing"] == "fixed":
        act = synthetic_activations(model, memory, opts["micro_batch_tokens"])
        warnings = memory_verdict(precheck(model, topology, hardware, memory, replicating(systems), act,
                                           TraceShape("synthetic", opts["micro_batch_tokens"]), world=world),
                                  opts["ignore_memory"], [])
    return {**opts, "memory": memory, "memory_warnings": warnings,
            "model_spec": model, "hardware_spec": hardware, "topology": topology,
            "cluster": cluster, "ep_sizes": ep_sizes, "memory_world": world,
            "systems": systems,
            "cost_options": CostOptions(overlap_replication=overlap, dispatch=opts["dispatch"],
                                        refetch_replicas=opts["refetch_replicas"]),
            "model_from": named_by, "model_notes": notes, "baseline_options": baselines}


def _check_trace_packing(file: str | None, opts: dict) -> None:
    """--trace and --packing: known names; a loads file has no samples to repack."""
    if opts["trace"] not in ALL_TRACES:
        raise ValueError(f"--trace {opts['trace']!r}; allowed: {', '.join(ALL_TRACES)}")
    if opts["trace"] not in TRACE_FAMILIES and opts["packing"] != "fixed":
        raise ValueError(f"--packing {opts['packing']} repacks samples, but --trace {opts['trace']} is generated "
                         f"as counts per rank and micro-batch; use --packing fixed, or a sample-level trace "
                         f"({', '.join(TRACE_FAMILIES)})")
    if opts["packing"] not in PACKING_METHODS:
        raise ValueError(f"--packing {opts['packing']!r}; allowed: {', '.join(PACKING_METHODS)}")
    if file and opts["packing"] != "fixed":
        if file_shape(file).kind == "loads":
            raise ValueError(f"--packing {opts['packing']} needs sample lengths, but the loads file {file!r} "
                             f"holds only batched counts; use --packing fixed, or a routing replay file")


def _trace_skew(args: argparse.Namespace, file_cfg: dict) -> float:
    """``trace.skew`` from ``--config``'s ``[trace]`` table, then ``--set trace.skew=X`` over it
    (the only trace field the command line sets: the exponent on the trace's expert weights)."""
    raw = file_cfg.get("trace")
    if raw is not None and not isinstance(raw, dict):
        raise ValueError(f"--config: 'trace' must be a table of FIELD = VALUE, got {raw!r}")
    fields = dict(raw or {})
    for text in args.set or []:
        section, name, value = parse_override(text)
        if section == "trace":
            fields[name] = value
    unknown = set(fields) - {"skew"}
    if unknown:
        raise ValueError(f"--set/--config trace.{sorted(unknown)[0]}: unknown trace field; allowed: trace.skew")
    value = fields.get("skew", 1.0)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"--set trace.skew={value!r}; allowed: a number in [0, 4] (1: the calibrated trace)") from None
    return check_number("--set trace.skew", value, 0.0, maximum=4.0)


def file_warmup(num_steps: int) -> int:
    """Default warm-up for a file of ``num_steps`` steps: one step when it has two or more
    (history-based planners such as eplb then start from real history), else none."""
    return 1 if num_steps >= 2 else 0


def _baseline_settings(args: argparse.Namespace, file_cfg: dict):
    """The ``[eplb]`` / ``[online]`` sections of ``--config``, then ``--set eplb.X=..`` over them."""
    sections: dict[str, dict] = {}
    for section in BASELINE_SECTIONS:
        raw = file_cfg.get(section)
        if raw is not None and not isinstance(raw, dict):
            raise ValueError(f"--config: '{section}' must be a table of FIELD = VALUE, got {raw!r}")
        sections[section] = dict(raw or {})
    for text in args.set or []:
        section, name, value = parse_override(text)
        if section in BASELINE_SECTIONS:
            sections[section][name] = value
    try:
        return baseline_options(sections)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"--set/--config: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``relibra simulate``; returns the exit code (bad input raises ``ValueError``)."""
    from rich.console import Console

    from .report import print_table, result_json, write_json, write_plot

    s = resolve(args)
    model, topo, ranks = s["model_spec"], s["topology"], s["cluster"]  # the trace: the cluster's ranks
    err = Console(stderr=True)
    plain = None if args.no_progress or err.is_terminal else PlainProgress()  # logs and pipes get lines
    if plain:
        plain.phase(f"reading {args.file}" if args.file else f"generating the synthetic trace ({s['trace']})")
    if args.file:
        if s["packing"] != "fixed":
            workload = replay_packing_workload(args.file, model, ranks, _cost_model(s), s["micro_batches"],
                                               s["packing"], 0, s["sample_tokens"])
        else:
            workload = workload_from_file(args.file, model, ranks, s["micro_batches"], s["sample_tokens"])
        if s["warmup_steps"] is None:
            s["warmup_steps"] = file_warmup(workload.num_steps)
        if s["warmup_steps"] >= workload.num_steps:
            raise ValueError(f"--warmup-steps {s['warmup_steps']} leaves no measured step: the file "
                             f"holds {workload.num_steps} step(s); allowed: 0..{workload.num_steps - 1}")
    elif s["trace"] in FAMILIES and s["packing"] == "fixed":  # count-level; default: today's trace, bit for bit
        workload = synthetic_workload(model, ranks, s["micro_batches"], s["micro_batch_tokens"],
                                      s["steps"], s["seed"], s["sample_tokens"], s["trace"], s["skew"])
    else:
        workload = sample_workload(model, ranks, _cost_model(s), s["micro_batches"], s["micro_batch_tokens"],
                                   s["steps"], s["seed"], s["trace"], s["packing"], s["sample_tokens"],
                                   s["skew"])
    if s["warmup_steps"] == 0:  # the measured first step: said so, for a file and a synthetic trace alike
        first = "the file holds one step" if args.file and workload.num_steps == 1 else "the first step is measured"
        workload.notes["warm-up"] = (f"none: {first}, so history-based systems (eplb) plan it from uniform "
                                     f"history, and every move starts from static placement")
    # the ideal system's activations are a lower bound for every plan: refuse before planning
    act = workload_activations(model, s["memory"], workload, s["warmup_steps"])
    trace = _trace_shape(args, s, workload)
    home = (home_activations(model, s["memory"], workload, s["warmup_steps"]) if s["memory_world"] is None else
            group_home_activations(model, s["memory"], workload, s["warmup_steps"], topo.num_gpus))
    memory_verdict(precheck(model, topo, s["hardware_spec"], s["memory"], replicating(s["systems"]), act, trace,
                            home, world=s["memory_world"]),
                   s["ignore_memory"], s["memory_warnings"])
    config = SimConfig(model, s["hardware_spec"], topo, s["systems"], s["cost_options"], s["warmup_steps"],
                       baseline_options=s["baseline_options"], memory=s["memory"],
                       memory_check=not s["ignore_memory"], memory_trace=trace)
    if getattr(args, "compare_ep", None):
        from .layouts import run_compare  # --compare-ep
        return run_compare(args, s, workload, config)
    _memory_warnings(err, s["memory_warnings"])
    if plain:
        plain.phase(f"{workload.num_steps} step(s) x {workload.num_micro_batches} micro-batches; "
                    f"planning {', '.join(config.systems)}")
    show = not args.no_progress and err.is_terminal
    if show:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        total = len(config.systems) * workload.num_steps
        with Progress(TextColumn("planning {task.description:<12}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("", total=total)

            def progress(system: str, done: int, steps: int) -> None:
                bar.update(task, advance=1, description=system)

            result = simulate(workload, config, progress=progress)
    else:
        result = simulate(workload, config, progress=plain)
        if plain:
            plain.phase("done")

    if s["model_notes"]:
        workload.notes["approximated"] = "; ".join(s["model_notes"])
    extra = {"model_from": s["model_from"],
             "micro_batch_tokens": s["micro_batch_tokens"] if not args.file else None,
             "trace": s["trace"] if not args.file else None,
             "seed": s["seed"] if not args.file else None, "file": args.file,

             "command": "relibra simulate " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["simulate"] else None}
    if not args.file:
        extra["trace_skew"] = s["skew"]
    if s["trace"] != "default" or s["packing"] != "fixed":  # the default JSON stays as it was
        extra.update({"trace": s["trace"] if not args.file else None, "packing": s["packing"]})
    doc = result_json(result, extra)
    _memory_warnings(err, peak_warnings(doc))
    out = Console()
    if not out.is_terminal:
        out = Console(width=200)
    print_table(doc, out)
    if s["json"]:
        write_json(doc, s["json"])
        out.print(f"wrote {s['json']}")
    if s["plot"]:
        write_plot(result, s["plot"])
        out.print(f"wrote {s['plot']}")
    return 0


def _trace_shape(args, s: dict, workload) -> TraceShape:
    """What sets the activations, for a memory refusal's advice (memory_fit.TraceShape)."""
    if not args.file:
        return TraceShape("synthetic", s["micro_batch_tokens"], workload.num_micro_batches)
    kind = "loads" if workload.source.startswith("loads file") else "routing"
    return TraceShape(kind, int(workload.tokens_XMS.max()), workload.num_micro_batches)


def _memory_warnings(err, texts: list[str]) -> None:
    """One stderr line per memory check that failed (only under --ignore-memory: otherwise refused)."""
    for text in texts:
        err.print(f"relibra simulate: warning (--ignore-memory): {text}", highlight=False, soft_wrap=True)
