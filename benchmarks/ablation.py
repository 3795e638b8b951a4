"""What each of relibra's mechanisms contributes: the scoreboard's runs with one switched.

The mechanisms are the boolean fields of the ``[relibra]`` settings section
(``relibra_torch.sim.baselines.SECTIONS["relibra"]``, e.g. ``balance``, ``cross_node_replicas``,
``traffic_search``, ``reorder``): every one is flipped from its default in turn (a switch
that is on by default is turned off; one that is off, such as an opt-in, is turned on), and
one more row turns every default-on mechanism off. Each row is ``relibra simulate`` with the
run's arguments plus ``--set relibra.FIELD=VALUE`` (the run's arguments come from
``benchmarks/results.py``'s ``RUNS``, the rows of docs/results.md); the baselines are run
once per run, since no relibra switch changes them.

Printed per row: relibra's step, its lead over eplb-oracle and over the fastest baseline
(that system's step over relibra's: > 1 means relibra is faster), over static, and the change
against relibra with every mechanism at its default.

    python benchmarks/ablation.py                      # the default run (relibra simulate --micro-batches 8)
    python benchmarks/ablation.py --run collapsed --run skew-0.5 --json out/ablation.json

The default run (6 relibra runs and one of the baselines) took 9.5 minutes on this project's
2-core machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, run as a script

from results import RUNS, _run  # noqa: E402

from relibra_torch.sim.baselines import SECTIONS, BaselineOptions  # noqa: E402
from relibra_torch.sim.simulator import REFERENCES, SYSTEMS  # noqa: E402

MINE = "relibra"


def switches() -> list[tuple[str, list[str]]]:
    """``(label, --set arguments)`` per row: every boolean ``[relibra]`` field flipped from its
    default, then every default-on one off together."""
    defaults = BaselineOptions()
    rows, on = [], []
    for name, kind in SECTIONS["relibra"].items():
        if kind is not bool:
            continue
        default = getattr(defaults, f"relibra_{name}")
        value = "false" if default else "true"
        rows.append((f"{name}={value}", [f"relibra.{name}={value}"]))
        if default:
            on.append(name)
    if len(on) > 1:
        rows.append(("all of " + ", ".join(on) + " off", [f"relibra.{n}=false" for n in on]))
    return rows


def _sets(args: list[str]) -> list[str]:
    return [a for flag in (["--set", s] for s in args) for a in flag]


def ablate(run: str, extra: list[str], tmp: Path, log) -> dict:
    """The run's baselines once, then relibra at its defaults and with each switch."""
    base_args = [*RUNS[run], *extra]
    rivals = [s for s in SYSTEMS if s not in REFERENCES and s != MINE]
    doc, _, secs = _run([*base_args, "--systems", ",".join(rivals)], tmp / f"{run}-baselines.json")
    log(f"{run}: baselines in {secs:.0f} s")
    steps = {n: f["step_time_s"] for n, f in doc["systems"].items() if n not in REFERENCES}
    base = {n: s for n, s in steps.items() if n != "static"}
    fastest = min(base, key=base.get)
    rows = []
    for label, sets in [("all at their defaults", []), *switches()]:
        doc, _, secs = _run([*base_args, "--systems", MINE, *_sets(sets)], tmp / f"{run}-{len(rows)}.json")
        f = doc["systems"][MINE]
        rows.append({"row": label, "set": sets, "step_s": f["step_time_s"],
                     "lead_over_eplb_oracle": steps["eplb-oracle"] / f["step_time_s"],
                     "lead_over_fastest": steps[fastest] / f["step_time_s"],
                     "lead_over_static": steps["static"] / f["step_time_s"],
                     "fraction_of_bound": f["fraction_of_bound"], "charged_s": f["planning_charged_s"],
                     "planner_s": f["planner_s"], "seconds": secs})
        log(f"{run}: {label}: relibra {f['step_time_s']:.3f} s ({secs:.0f} s)")
    full = rows[0]["step_s"]
    for r in rows:
        r["step_over_full"] = r["step_s"] / full
    return {"run": run, "command": "relibra simulate " + " ".join(base_args), "baseline_steps_s": steps,
            "fastest_baseline": fastest, "rows": rows}


def print_tables(results: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=200) if not sys.stdout.isatty() else Console()
    for res in results:
        table = Table(title=f"{res['run']}: {res['command']} (fastest baseline {res['fastest_baseline']}); "
                            f"lead = the system's step / relibra's")
        fast = res["fastest_baseline"] != "eplb-oracle"  # else the two columns are one
        for col in ("relibra", "step", "vs defaults", "lead over eplb-oracle",
                    *([f"lead over {res['fastest_baseline']}"] if fast else []),
                    "lead over static", "of bound", "host charged"):
            table.add_column(col, justify="left" if col == "relibra" else "right")
        for r in res["rows"]:
            table.add_row(r["row"], f"{r['step_s']:.3f} s", f"{r['step_over_full']:.4f}",
                          f"{r['lead_over_eplb_oracle']:.3f}x", *([f"{r['lead_over_fastest']:.3f}x"] if fast else []),
                          f"{r['lead_over_static']:.3f}x", f"{r['fraction_of_bound']:.3f}", f"{r['charged_s']:.3f} s")
        console.print(table)


def markdown(results: list[dict]) -> str:
    """The tables as Markdown, for docs/results.md."""
    lines = []
    for res in results:
        fast = res["fastest_baseline"] != "eplb-oracle"
        lines += [f"`{res['command']}` (fastest baseline: {res['fastest_baseline']})", "",
                  "| relibra | step | vs defaults | lead over eplb-oracle | "
                  + (f"lead over {res['fastest_baseline']} | " if fast else "") + "lead over static | of bound |",
                  "|---|---:|---:|---:|" + ("---:|" if fast else "") + "---:|---:|"]
        for r in res["rows"]:
            lines.append(f"| {r['row']} | {r['step_s']:.3f} s | {r['step_over_full']:.4f} | "
                         f"{r['lead_over_eplb_oracle']:.3f}x | " + (f"{r['lead_over_fastest']:.3f}x | " if fast else "")
                         + f"{r['lead_over_static']:.3f}x | {r['fraction_of_bound']:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", choices=list(RUNS),
                   help="a run of docs/results.md (repeatable; default: default)")
    p.add_argument("--list", action="store_true", help="print the rows (switches) and exit")
    p.add_argument("--arg", action="append", default=[], metavar="ARG",
                   help="an extra relibra simulate argument for every row (repeatable), e.g. --arg=--nodes=2")
    p.add_argument("--json", type=Path, help="write every row's figures here")
    p.add_argument("--markdown", action="store_true", help="also print the tables as Markdown")
    args = p.parse_args(argv)
    if args.list:
        for label, sets in switches():
            print(f"{label}: {' '.join(_sets(sets))}")
        return 0
    t0 = time.perf_counter()

    def log(text: str) -> None:
        print(f"[{time.perf_counter() - t0:5.0f} s] {text}", file=sys.stderr, flush=True)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in args.run or ["default"]:
            results.append(ablate(run, args.arg, Path(tmp), log))
    print_tables(results)
    if args.markdown:
        print(markdown(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
