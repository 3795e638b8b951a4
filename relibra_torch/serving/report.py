"""``relibra serve-sim`` output: a rich table, the JSON document, the SLO-attainment plot."""

from __future__ import annotations

import os

from ..sim import run_checks
from ..sim.presets import describe_model

__all__ = ["print_report", "write_json", "write_plot"]


def _ms(x) -> str:
    return "-" if x is None else (f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s")


def print_report(doc: dict, console=None) -> None:
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    s = doc["setup"]
    sv = s["serving"]
    console.print(f"[bold]{escape(s['model']['name'])}[/bold] on {s['nodes']} x {s['gpus_per_node']} "
                  f"{s['hardware']['name'].upper()}; trace {escape(s['trace'])} ({s['requests']} requests, "
                  f"{s['trace_rate']:.3g} req/s as recorded); SLO TTFT {sv['ttft_slo_s']:g} s, TPOT "
                  f"{sv['tpot_slo_s'] * 1e3:g} ms, P{sv['attainment'] * 100:g} goodput", highlight=False)
    console.print(f"model: {describe_model(s['model'])}", highlight=False)
    console.print(f"routing: {escape(s['routing'])}; tile time {s['tile_time_us']:.2f} us per row tile "
                  f"({escape(s['tile_time_source'])}), preemption bound {s['sm_tile_us']:.1f} us per layer",
                  highlight=False)
    table = Table(box=box.SIMPLE_HEAVY, title="P90 goodput (best configuration per system)")
    for col in ("system", "best configuration", "GPUs", "req/s", "per GPU", "per node",
                "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "SLO met"):
        table.add_column(col, justify="left" if col in ("system", "best configuration") else "right")
    for name, r in doc["systems"].items():
        if not r["fits"] or r.get("unbounded") or r.get("goodput") == 0:
            table.add_row(name, r.get("config_label", "") + " " + r["note"], *["-"] * 9)
            continue
        table.add_row(name, r["config_label"], str(r["gpus_used"]), f"{r['goodput']:.2f}",
                      f"{r['goodput_per_gpu']:.3f}", f"{r['goodput_per_node']:.2f}",
                      _ms(r.get("ttft_p50_s")), _ms(r.get("ttft_p90_s")), _ms(r.get("tpot_p50_s")),
                      _ms(r.get("tpot_p90_s")),
                      "-" if r.get("attainment") is None else f"{r['attainment'] * 100:.1f}%")
    console.print(table)
    for note in s.get("notes", []):
        console.print(f"note: {escape(note)}", highlight=False)
    paper = doc["paper_ratios"]
    for key, value in doc["ratios"].items():
        ref = f" (paper, {doc.get('paper_setting', 'its setting')}: {paper[key]:.2f}x)" if key in paper else ""
        shown = "-" if value is None else (value if isinstance(value, str) else f"{value:.2f}x")
        console.print(f"{key}: {shown}{ref}", highlight=False)
    console.print(f"search time {doc['seconds']:.1f} s", highlight=False)


def write_json(doc: dict, path: str) -> None:
    """Write ``doc`` to ``path`` (:func:`relibra_torch.sim.run_checks.write_json`: atomic, names ``--json``)."""
    run_checks.write_json(doc, path, indent=1)


def write_plot(doc: dict, path: str) -> None:
    """SLO attainment against arrival rate, one curve per system: the best configuration's
    complete runs (the search's, and four past its goodput)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, r in doc["systems"].items():
        pts = r.get("curve") or []
        if pts:
            xs, ys, exact = zip(*pts)
            gp = "unbounded" if r["goodput"] is None else f"{r['goodput']:.1f} req/s"
            ax.plot(xs, [100 * y for y in ys], marker="o", ms=3, lw=1, label=f"{name} ({gp})")
    target = doc["setup"]["serving"]["attainment"] * 100
    ax.axhline(target, color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("requests meeting TTFT and TPOT SLO (%)")
    s = doc["setup"]
    ax.set_title(f"{s['model']['name']} on {s['nodes']}x{s['gpus_per_node']} {s['hardware']['name'].upper()}")
    if ax.get_legend_handles_labels()[1]:
        ax.legend(fontsize=8)
    else:  # no system fits or has a curve: say so on the figure (an empty legend only warns on stderr)
        ax.text(0.5, 0.5, "no system has a configuration that fits", ha="center", va="center",
                transform=ax.transAxes)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
