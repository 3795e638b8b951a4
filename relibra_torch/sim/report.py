"""Reports of a simulation: the JSON document, a terminal table and a PNG.

Legend: X steps, M micro-batches, L MoE layers.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from ..planning.lis import lis, lis_summary
from . import run_checks
from .memory import capacity_bytes
from .presets import describe_model
from .simulator import SimResult

__all__ = ["result_json", "write_json", "format_seconds", "format_table", "print_table", "write_plot",
           "imbalance_ylim", "STEP_PARTS"]

# colours per system, shared by the table and the plot
COLOURS = {"static": "#7f7f7f", "eplb": "#ff7f0e", "eplb-oracle": "#d62728",
           "eplb-instance": "#e6a96b", "eplb-oracle-instance": "#e08a8a", "online-node": "#9467bd",
           "online-global": "#8c564b", "online-global-planned": "#c49c94", "eplb-node-demand": "#ff9896",
           "relibra": "#1f77b4", "uniform": "#98df8a", "bound": "#2ca02c"}


def result_json(result: SimResult, extra_config: dict | None = None) -> dict:
    """``{"config": {...}, "lis_mean", "lis_max", "systems": {NAME: figures}}`` (figures: see
    ``SimResult.figures``). ``lis_*``: the Load-Imbalance Score of every measured (step,
    micro-batch, layer), loads summed over source ranks: once per run, it depends on the
    loads only."""
    cfg = result.config
    topo = cfg.topology
    wl = result.workload
    config = {
        "model": dataclasses.asdict(cfg.model),
        "hardware": dataclasses.asdict(cfg.hardware),
        "nodes": topo.num_nodes,
        "gpus_per_node": topo.gpus_per_node,
        "ep_size": topo.num_gpus,
        "replica_slots": topo.replica_slots,
        "micro_batches": wl.num_micro_batches,
        "steps": wl.num_steps,
        "warmup_steps": cfg.warmup_steps,
        "measured_steps": wl.num_steps - cfg.warmup_steps,
        "empty_micro_batches": _empty_micro_batches(result),
        "tokens_per_step": int(wl.tokens_XMS.sum() // wl.num_steps),
        "systems": list(cfg.systems),
        "cost_options": dataclasses.asdict(cfg.cost_options),
        "baseline_options": dataclasses.asdict(cfg.baseline_options),
        "memory_options": dataclasses.asdict(cfg.memory),
        "memory_capacity_bytes": capacity_bytes(cfg.hardware, cfg.memory),
        "source": wl.source,
        "notes": dict(wl.notes),
    }
    if extra_config:
        config.update(extra_config)
    config["static_imbalance"] = static_imbalance(wl.loads_XMLSE[cfg.warmup_steps:], topo.num_gpus)
    lis_XML = lis(wl.loads_XMLSE[cfg.warmup_steps:].sum(3, dtype=torch.int64))
    figures = result.figures()
    note = migration_note(figures, wl.num_micro_batches)
    if note:
        config["notes"]["migration"] = note
    return {"config": config, **lis_summary(lis_XML), "systems": figures}


#: Share of a system's step above which the report says that migration, not balance, sets it.
MIGRATION_NOTE_SHARE = 0.25


def migration_note(figures: dict, micro_batches: int) -> str:
    """A note naming the systems whose step is mostly a new placement's migration (``""``:
    none): on a short step (few micro-batches, a small file) a placement change a training run
    pays once and keeps for many steps is charged to the one step measured."""
    heavy = {n: f for n, f in figures.items() if f["migration_s"] > MIGRATION_NOTE_SHARE * f["step_time_s"] > 0}
    if not heavy:
        return ""
    parts = ", ".join(f"{n} {f['migration_s'] / f['step_time_s']:.0%} ({f['migration_s']:.3g} of "
                      f"{f['step_time_s']:.3g} s)" for n, f in heavy.items())
    return (f"moving experts to a new placement is most of the step for {parts}: with {micro_batches} "
            f"micro-batch(es) a step is too short to repay a move a run pays once and keeps; those ratios "
            f"say how a lone step pays for it, not how the system balances (more samples or micro-batches "
            f"per step, more steps, or compare the MoE column)")


def static_imbalance(loads_XMLSE: torch.Tensor, num_gpus: int) -> float:
    """How skewed a trace is at this EP size: max/mean GPU load under static placement
    (expert ``e`` on GPU ``e // (E / G)``), averaged over (step, micro-batch, layer) with
    tokens. The same trace gives different values at different EP sizes, so every speedup is
    reported next to it."""
    X, M, L, S, E = loads_XMLSE.shape
    gpu_R = loads_XMLSE.sum(3, dtype=torch.int64).view(X * M * L, num_gpus, E // num_gpus).sum(-1)
    total_R = gpu_R.sum(-1)
    busy = total_R > 0
    if not bool(busy.any()):
        return 1.0
    ratio = gpu_R[busy].max(-1).values.double() * num_gpus / total_R[busy].double()
    return float(ratio.mean())
def _empty_micro_batches(result: SimResult) -> int:
    """Measured micro-batches with no tokens on any rank (left out of the imbalance figures)."""
    active = next(iter(result.systems.values())).active_XM if result.systems else None
    return 0 if active is None else int((~active).sum())


def _active_imbalance_ML(r) -> torch.Tensor:
    """The first measured step's ``[M, L]`` imbalance, ``nan`` for empty micro-batches (gaps in the plot)."""
    imb_ML = r.imbalance_XML[0].clone()
    if r.active_XM is not None and bool(r.active_XM[0].any()):
        imb_ML[~r.active_XM[0]] = float("nan")
    return imb_ML


def write_json(doc: dict, path: str) -> None:
    """Write ``doc`` to ``path`` (:func:`relibra_torch.sim.run_checks.write_json`: atomic, names ``--json``)."""
    run_checks.write_json(doc, path, indent=2)


def _gb(x: float) -> str:
    gb = x / 1e9
    return f"{gb:,.0f}" if gb >= 100 else f"{gb:.1f}"


def format_seconds(x: float) -> str:
    """A duration in the unit that fits it: ``12.3 s``, ``45.6 ms``, ``7.89 us`` (three
    significant digits; the JSON keeps seconds)."""
    if x != x:  # NaN
        return "-"
    if x == 0:
        return "0"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        v = x / scale
        digits = 0 if abs(v) >= 99.5 else 1 if abs(v) >= 9.95 else 2
        text = f"{v:.{digits}f}"
        if abs(float(text)) >= 1 or unit == "us":  # 0.9996 s prints as 1.00 s, not 1000 ms
            return f"{text} {unit}"
    raise AssertionError("unreachable")


def _ratio(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}x"


COLUMNS = ("system", "imb mean", "imb p50", "imb p99", "MoE", "step", "vs static",
           "vs eplb-oracle", "of bound", "balanced", "cross-node GB", "replica GB", "migrated", "planner")
"""Columns of :func:`format_table` (one wide plain-text table, for logs and docs)."""


def table_rows(figures: dict[str, dict]) -> list[list[str]]:
    """One row of strings per system, in :data:`COLUMNS` order."""
    rows = []
    for name, f in figures.items():
        rows.append([
            name, f"{f['imbalance_mean']:.3f}", f"{f['imbalance_p50']:.3f}", f"{f['imbalance_p99']:.3f}",
            format_seconds(f['moe_layer_time_s']), format_seconds(f['step_time_s']), _ratio(f["speedup_vs_static"]),
            _ratio(f["speedup_vs_eplb_oracle"]), f"{f['fraction_of_bound']:.3f}",
            format_seconds(f["balanced_at_own_bytes_s"]),
            _gb(f["cross_node_bytes"]), _gb(f["replica_bytes"]),
            f"{f['migrated_experts']:.0f} ({_gb(f['migrated_bytes'])} GB)",
            format_seconds(f['planner_s']),
        ])
    return rows


def format_table(figures: dict[str, dict]) -> str:
    """A plain-text table (for logs and docs)."""
    rows = [list(COLUMNS)] + table_rows(figures)
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


# Times carry their own unit (s, ms, us), so the headers do not.
# "of bound": the lower bound's step / the system's (sim/bound.py); "bal.": the system's step
# with its own bytes spread evenly and its GPUs balanced (the rest of its gap is imbalance)
# ("imb": the mean imbalance; short so that twelve systems fit 80 columns)
TIME_COLUMNS = ("system", "imb", "p99", "MoE", "step", "bal.", "vs static", "vs oracle", "of bound")
TRAFFIC_COLUMNS = ("system", "imb p50", "cross GB", "intra GB", "repl. GB", "migr.",
                   "migr. GB", "plan")
# per GPU, GB, the busiest GPU of the worst measured step (relibra_torch.sim.memory)
MEMORY_COLUMNS = ("system", "weights", "grads", "optim.", "replicas", "activ.", "staging", "peak")


# One line per column, printed under each table (columns without an entry get none).
LEGEND = {
    "imb": "max / mean GPU expert load, mean over micro-batches x layers (1.000 = balanced)",
    "p99": "99th percentile of that imbalance",
    "imb p50": "median of that imbalance",
    "MoE": "MoE-layer time per step (expert compute, all-to-all, replica transfer)",
    "step": "training step time (MoE layers + attention / dense + migration)",
    "vs static": "speedup over static placement (static step / this step)",
    "vs oracle": "speedup over eplb-oracle, EPLB fed the step's own loads",
    "bal.": "this system's step with its own bytes spread evenly and its GPUs balanced (not a bound)",
    "of bound": "lower bound's step / this step (bound: no plan can be faster; docs/simulator.md)",
    "cross GB": "token bytes sent between nodes per step (all-to-all, fwd + bwd)",
    "intra GB": "token bytes sent between GPUs of a node per step",
    "repl. GB": "replica weights filled + gradients returned per step",
    "migr.": "experts whose owner GPU changed (a new placement) per step",
    "migr. GB": "bytes those migrations move (weights + optimizer state)",
    "plan": "planner CPU per step (one thread; split planning: the slowest EP rank's share + gathers)",
}


def legend_lines(columns) -> list[str]:
    """``"COLUMN: meaning"`` for every column of ``columns`` that :data:`LEGEND` explains."""
    return [f"{c}: {LEGEND[c]}" for c in columns if c in LEGEND]


def _time_row(name: str, f: dict) -> list[str]:
    return [name, f"{f['imbalance_mean']:.3f}", f"{f['imbalance_p99']:.3f}", format_seconds(f['moe_layer_time_s']),
            format_seconds(f['step_time_s']), format_seconds(f["balanced_at_own_bytes_s"]),
            _ratio(f["speedup_vs_static"]), _ratio(f["speedup_vs_eplb_oracle"]), f"{f['fraction_of_bound']:.3f}"]


def _traffic_row(name: str, f: dict) -> list[str]:
    return [name, f"{f['imbalance_p50']:.3f}", _gb(f["cross_node_bytes"]), _gb(f["intra_node_bytes"]),
            _gb(f["replica_bytes"]), f"{f['migrated_experts']:.0f}", _gb(f["migrated_bytes"]),
            format_seconds(f['planner_s'])]


def _memory_row(name: str, f: dict) -> list[str]:
    b = f["memory"]
    return [name, _gb(b["expert_weights"] + b["dense_weights"]), _gb(b["gradients"]), _gb(b["optimizer"]),
            _gb(b["replica_slots"]), _gb(b["activations"]), _gb(b["migration_staging"]), _gb(b["peak"])]


def print_table(doc: dict, console=None) -> None:
    """Print two rich tables (step time; traffic and planning) and the run's assumptions.

    Two narrow tables instead of one wide one, so that an 80-column terminal shows every
    figure (``vs oracle`` is the speedup over eplb-oracle).
    """
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    cfg = doc["config"]
    from rich.markup import escape
    console.print(f"[bold]{escape(cfg['model']['name'])}[/bold] on {cfg['nodes']} x {cfg['gpus_per_node']} "
                  f"{cfg['hardware']['name']} (EP {cfg['ep_size']}, R={cfg['replica_slots']}), "
                  f"{cfg['micro_batches']} micro-batches, {cfg['measured_steps']} measured step(s), "
                  f"figures per step", highlight=False)
    if "static_imbalance" in cfg:
        console.print(f"trace skew: static imbalance {cfg['static_imbalance']:.2f} at EP {cfg['ep_size']} "
                      f"(max/mean GPU load under static placement)"
                      + (f", trace.skew = {cfg['trace_skew']:g}" if cfg.get("trace_skew") is not None else ""),
                      highlight=False)
    console.print(f"model: {describe_model(cfg['model'])}", highlight=False)
    if cfg.get("model_from") and cfg.get("file"):
        console.print(f"model dims from {cfg['model_from']}", highlight=False)
    elif cfg.get("model_from", "").startswith("--model-config"):
        console.print(f"model from {cfg['model_from']}", highlight=False)
    tables = [("step time", TIME_COLUMNS, _time_row), ("traffic and planning", TRAFFIC_COLUMNS, _traffic_row)]
    if all(f.get("memory") for f in doc["systems"].values()):
        tables.append((f"memory per GPU, GB (busiest GPU; {cfg['memory_capacity_bytes'] / 1e9:,.1f} GB "
                       f"usable)", MEMORY_COLUMNS, _memory_row))
    for title, columns, row in tables:
        # no cell padding: the box's column separator is the one space, so nine systems fit 80 columns
        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True, padding=(0, 0), show_edge=False)
        for i, col in enumerate(columns):
            table.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
        for name, f in doc["systems"].items():
            table.add_row(*row(name, f), style=COLOURS.get(name))
        console.print(table)
        console.print("\n".join(legend_lines(columns)), style="dim", highlight=False)
    overlap = cfg["cost_options"]["overlap_replication"]
    console.print(f"source: {cfg['source']}", highlight=False)
    for key, text in cfg["notes"].items():
        console.print(f"{key.replace('_', ' ')}: {text}", highlight=False)
    console.print("replica fill / gradient return: " + ("hidden behind attention where it fits"
                  if overlap else "not overlapped (--overlap-replication hides it behind attention)"),
                  highlight=False)
    online = [n for n in doc["systems"] if n.startswith("online-") and not n.endswith("-planned")]
    if online:
        b = cfg.get("baseline_options", {})
        console.print(f"{', '.join(online)}: run-time planning {b.get('online_plan_latency_us')} us per "
                      f"layer and micro-batch on the critical path (--set online.plan_latency_us=...)",
                      highlight=False)
    console.print(host_planning_line(doc), highlight=False)


def host_planning_line(doc: dict) -> str:
    """What each system's host work ahead of the step cost and what of it was charged."""
    ahead = {n: f for n, f in doc["systems"].items() if f.get("host_cpu_s")}
    if not ahead:
        return "host planning ahead of the step: none"
    window = cfg_window = doc["config"].get("baseline_options", {}).get("planning_overlap_s")
    window = ("static's forward pass" if cfg_window is None
              else f"{format_seconds(cfg_window)} (planning.overlap_s)")
    line = ("host planning ahead of the step (one thread's CPU: the planner, its slowest EP rank's share "
            "under split planning, + relibra's layer schedules): "
            + ", ".join(f"{n} {format_seconds(f['host_cpu_s'])}" for n, f in ahead.items())
            + f"; overlap window {window}")
    charged = {n: f["planning_charged_s"] for n, f in ahead.items() if f["planning_charged_s"] > 0}
    b = doc["config"].get("baseline_options", {})
    one, nodes = b.get("relibra_host_scale"), b.get("relibra_host_scale_nodes")
    guard = (f"\nrelibra's guard: host scale {one:.3g} on one node, {nodes:.3g} across nodes (this host's planning "
             f"time over that of the machine its host-time constants were fitted on; --set relibra.host_scale="
             f"{one:.3g} --set relibra.host_scale_nodes={nodes:.3g} repeats the run)"
             if "relibra" in ahead and one is not None and nodes is not None else "")
    if not charged:
        return line + "; charged: none (every system fits the window)" + guard
    return line + ("; charged (measured CPU time: varies run to run): "
                   + ", ".join(f"{n} {format_seconds(v)}" for n, v in charged.items())) + guard


# step-time parts of the plot's stacked bars: (label, figure key, colour)
STEP_PARTS = (("expert compute", "expert_compute_s", "#4c72b0"),
              ("all-to-all", "all_to_all_s", "#dd8452"),
              ("replica transfer", "replica_exposed_s", "#55a868"),
              ("migration", "migration_s", "#c44e52"),
              ("host planning", "planning_charged_s", "#8172b3"),
              ("collective latency", "collective_latency_s", "#937860"),
              ("attention / dense", "attention_dense_s", "#b0b0b0"))


def imbalance_ylim(tops: dict[str, float], floor: float = 1.3) -> tuple[float, list[str]]:
    """Upper y limit of the imbalance panel and the systems drawn past it.

    The panel shows ``[0.95, top]`` with ``top`` at least ``floor`` and at most what the
    balanced systems need, so that 1.0-1.3 stays readable; a system whose mean imbalance is
    more than twice the best planned one (static, usually 2-4) is clipped and annotated; the
    references (uniform, bound) are always 1.0 and do not count.
    """
    others = {n: v for n, v in tops.items() if n not in ("uniform", "bound")}
    if not others:
        return floor, []
    best = min(others.values())
    clipped = [n for n, v in others.items() if v > 2.0 * best]
    kept = [v for n, v in others.items() if n not in clipped]
    top = max([floor] + [1.02 * v for v in kept])
    return top, clipped


def write_plot(result: SimResult, path: str) -> None:
    """PNG: per-micro-batch imbalance of each system over the first measured step (mean and
    max over layers; systems far above the rest are clipped and their mean is written on the
    panel), and step-time bars stacked by expert compute, all-to-all, exposed replica
    transfer, migration and attention/dense time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = result.figures()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 2]})
    means = {name: float(_active_imbalance_ML(r).mean(1).nan_to_num(0.0).max()) for name, r in result.systems.items()}
    top, clipped = imbalance_ylim(means)
    notes = []
    for name, r in result.systems.items():
        imb_ML = _active_imbalance_ML(r)
        m = range(imb_ML.shape[0])
        colour = COLOURS.get(name)
        label = f"{name} (mean over layers)"
        if name in clipped:
            label = f"{name}: off scale, mean {float(imb_ML.nanmean()):.2f}"
            notes.append(label)
        ax1.plot(m, imb_ML.mean(1).tolist(), color=colour, label=label)
        if name not in ("uniform", "bound"):
            ax1.plot(m, imb_ML.amax(1).tolist(), color=colour, linestyle=":", linewidth=1)
    ax1.set_xlabel("micro-batch")
    ax1.set_ylabel("max / mean GPU load")
    ax1.set_title("per-micro-batch imbalance (dotted: worst layer)")
    ax1.set_ylim(0.95, top)
    if notes:
        ax1.text(0.01, 0.98, "\n".join(notes) + " (clipped)", transform=ax1.transAxes, va="top",
                 fontsize=8, bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "#999999"})
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="center right", framealpha=0.85)

    names = list(figures)
    bottom = [0.0] * len(names)
    for label, key, colour in STEP_PARTS:
        part = [figures[n][key] for n in names]
        ax2.bar(names, part, bottom=bottom, color=colour, label=label)
        bottom = [b + p for b, p in zip(bottom, part)]
    for i, n in enumerate(names):
        ax2.text(i, figures[n]["step_time_s"], f"{figures[n]['speedup_vs_static']:.2f}x",
                 ha="center", va="bottom", fontsize=9)
    ax2.set_ylabel("step time (s)")  # one axis for all bars: seconds, as in the JSON
    ax2.set_title("step time by part (label: speedup over static)")
    plt.setp(ax2.get_xticklabels(), rotation=30, ha="right")  # a dozen system names
    ax2.legend(fontsize=8, loc="upper right")
    cfg = result.config
    fig.suptitle(f"{cfg.model.name}, {cfg.topology.num_nodes} x {cfg.topology.gpus_per_node} "
                 f"{cfg.hardware.name}, R={cfg.topology.replica_slots}, "
                 f"{cfg.cost_options.dispatch} dispatch", fontsize=11)
    fig.tight_layout()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
