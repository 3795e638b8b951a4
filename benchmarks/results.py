"""Regenerate the tables of docs/results.md: every run of the page, one command.

Each run is a ``relibra simulate`` command line (the page lists it next to its table); this
script runs them in one process, writes each run's JSON under ``--out`` and prints Markdown:
one summary row per run (relibra's step over the fastest baseline and over static, of the
lower bound, the static imbalance of the trace at that EP size) and one full table per run.
``--only NAME`` picks runs by name (repeatable); ``--list`` names them.

    python benchmarks/results.py --out out/results > out/results.md

Not a timed test: the figures come from the simulator's cost model and are deterministic
except planner CPU times (which are charged only beyond the overlap window; the output says
so when a charge applies).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

from relibra_torch.cli import main as relibra_main
from relibra_torch.sim.simulator import REFERENCES  # rows no planner runs: never "the fastest baseline"

MINE = "relibra"

# name -> simulate arguments. Multi-node runs use the default (hierarchical) dispatch. Every
# run uses 8 micro-batches of 8,192 tokens per GPU (not 32): the same for every system, so
# that each command runs in minutes on 2 cores; the step is 4x shorter than the 32-micro-batch
# default's, and ratios between systems are what the tables compare.
FAST = ["--micro-batches", "8"]
RUNS: dict[str, list[str]] = {
    "default": [*FAST],
    "default-flat": [*FAST, "--dispatch", "flat"],
    "skew-0.5": [*FAST, "--set", "trace.skew=0.5"],
    "skew-0.25": [*FAST, "--set", "trace.skew=0.25"],
    "rank-mix": [*FAST, "--trace", "rank-mix"],
    "collapsed": [*FAST, "--trace", "collapsed"],
    "glm-4.5-air": [*FAST, "--model", "glm-4.5-air", "--nodes", "4"],
    "qwen3-235b": [*FAST, "--model", "qwen3-235b-a22b", "--nodes", "8", "--set", "memory.shard=params"],
}


def _run(args: list[str], json_path: Path) -> tuple[dict, str, float]:
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        rc = relibra_main(["simulate", "--no-progress", *args, "--json", str(json_path)])
    if rc != 0:
        raise SystemExit(f"relibra simulate {' '.join(args)} exited {rc}")
    return json.loads(json_path.read_text()), out.getvalue(), time.perf_counter() - t0


def baselines(systems: dict[str, dict]) -> dict[str, dict]:
    """The systems a practitioner could run instead of relibra (not static, not references)."""
    return {n: f for n, f in systems.items() if n not in REFERENCES and n not in ("static", MINE)}


def summary_row(name: str, args: list[str], doc: dict) -> str:
    systems = doc["systems"]
    mine = systems.get(MINE)
    base = baselines(systems)
    cells = [name, f"{doc['config'].get('static_imbalance', float('nan')):.2f}"]
    if mine and base:
        fastest = min(base, key=lambda n: base[n]["step_time_s"])
        cells += [f"{mine['step_time_s']:.2f} s", f"{fastest} {base[fastest]['step_time_s']:.2f} s",
                  f"{base[fastest]['step_time_s'] / mine['step_time_s']:.3f}x",
                  f"{systems['static']['step_time_s'] / mine['step_time_s']:.3f}x"]
        bound = mine.get("fraction_of_bound")
        cells.append("-" if bound is None else f"{bound:.3f}")
    else:
        cells += ["-"] * 5
    cells.append("`relibra simulate " + " ".join(args) + "`")
    return "| " + " | ".join(cells) + " |"


def full_table(doc: dict) -> str:
    systems = doc["systems"]
    cols = [("step", "step_time_s", "{:.2f} s"), ("vs static", "speedup_vs_static", "{:.3f}x"),
            ("of bound", "fraction_of_bound", "{:.3f}"), ("imb mean", "imbalance_mean", "{:.3f}"),
            ("imb p99", "imbalance_p99", "{:.3f}"), ("MoE", "moe_layer_time_s", "{:.2f} s"),
            ("all-to-all", "all_to_all_s", "{:.2f} s"), ("cross GB", "cross_node_bytes", "{:,.0f}"),
            ("peak GB/GPU", "memory_peak_bytes", "{:.1f}"), ("plan CPU", "planner_s", "{:.3f} s"),
            ("charged", "planning_charged_s", "{:.3f} s")]
    cols = [c for c in cols if any(c[1] in f for f in systems.values())]
    lines = ["| system | " + " | ".join(c[0] for c in cols) + " |", "|---|" + "---:|" * len(cols)]
    for n, f in systems.items():
        vals = []
        for _, key, fmt in cols:
            v = f.get(key)
            vals.append("-" if v is None else fmt.format(v / 1e9 if key in ("cross_node_bytes", "memory_peak_bytes") else v))
        lines.append(f"| {n} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/results"), help="folder for each run's JSON")
    parser.add_argument("--only", action="append", default=[], help="run only this name (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the runs and exit")
    args = parser.parse_args(argv)
    if args.list:
        for n, a in RUNS.items():
            print(f"{n}: relibra simulate {' '.join(a)}")
        return 0
    unknown = [n for n in args.only if n not in RUNS]
    if unknown:
        parser.error(f"--only {unknown[0]!r}; allowed: {', '.join(RUNS)}")
    names = args.only or list(RUNS)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = {}
    for n in names:
        print(f"[results] {n}: relibra simulate {' '.join(RUNS[n])}", file=sys.stderr, flush=True)
        doc, text, secs = _run(RUNS[n], args.out / f"{n}.json")
        docs[n] = doc
        print(f"[results] {n}: {secs:.0f} s", file=sys.stderr, flush=True)
    print("| run | static imb. | relibra | fastest baseline | relibra vs it | vs static | relibra of bound | command |")
    print("|---|---:|---:|---|---:|---:|---:|---|")
    for n in names:
        print(summary_row(n, RUNS[n], docs[n]))
    for n in names:
        print(f"\n### {n}: `relibra simulate {' '.join(RUNS[n])}`\n")
        print(full_table(docs[n]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
