"""What relays give every system: the scoreboard's runs with every plan relayed.

Relays (``relibra_torch.planning.relay``) spread a node's inter-node rows over its GPUs before
the hierarchical exchange; they do not depend on where the experts sit, so any system's layer
could run them. This script reruns ``benchmarks/results.py``'s runs twice in one process: as
the simulator runs them (relibra relays, the baselines do not), and with the same rule
(``add_relays``, relibra's prices) applied to every other system's plan too, static included,
at no host cost for them. It prints, per run, every system's step both ways and relibra's
lead over the fastest baseline both ways: the second is the lead that does not come from the
relays.

    python benchmarks/relay_for_all.py                    # every run of docs/results.md
    python benchmarks/relay_for_all.py --only default --only skew-0.5

Not a timed test: deterministic figures from the cost model (planner CPU aside).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # results.py, run as a script

from results import RUNS, _run, baselines  # noqa: E402

import relibra_torch.sim.simulator as simulator  # noqa: E402
from relibra_torch.planning.relay_choice import add_relays  # noqa: E402

MINE = "relibra"


@contextlib.contextmanager
def relays_for_every_system():
    """Within the block, every planner's plan but relibra's (which relays already) gets
    relays by relibra's rule and prices (its planner's config in the same run)."""
    original = simulator.plan_as_run

    def plan_as_run(planner, loads_MLSE, pairs_LEE, config):
        plan, secs, splits = original(planner, loads_MLSE, pairs_LEE, config)
        if planner.name != MINE:
            cost = simulator.CostModel(config.model, config.hardware, config.cost_options)
            rcfg = simulator.default_planner_factory(MINE, config.topology, cost, config.baseline_options).config
            plan = add_relays(plan, loads_MLSE, rcfg)
        return plan, secs, splits

    simulator.plan_as_run = plan_as_run
    try:
        yield
    finally:
        simulator.plan_as_run = original


def lead(doc: dict) -> tuple[str, float]:
    base = baselines(doc["systems"])
    fastest = min(base, key=lambda n: base[n]["step_time_s"])
    return fastest, base[fastest]["step_time_s"] / doc["systems"][MINE]["step_time_s"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], help="run only this name (repeatable)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only if n not in RUNS]
    if unknown:
        parser.error(f"--only {unknown[0]!r}; allowed: {', '.join(RUNS)}")
    names = args.only or list(RUNS)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in names:
            print(f"[relay_for_all] {n}: as the simulator runs it", file=sys.stderr, flush=True)
            plain = _run(RUNS[n], Path(tmp) / f"{n}.json")[0]
            print(f"[relay_for_all] {n}: every system relayed", file=sys.stderr, flush=True)
            with relays_for_every_system():
                every = _run(RUNS[n], Path(tmp) / f"{n}-all.json")[0]
            rows.append((n, plain, every))
    print("| run | system | step (relibra relays) | step (every system relays) | change |")
    print("|---|---|---:|---:|---:|")
    for n, plain, every in rows:
        for s, f in plain["systems"].items():
            if s in baselines(plain["systems"]) or s in ("static", MINE):
                a, b = f["step_time_s"], every["systems"][s]["step_time_s"]
                print(f"| {n} | {s} | {a:.3f} s | {b:.3f} s | {a / b:.3f}x |")
    print("\n| run | relibra's lead, only relibra relays | relibra's lead, every system relays |")
    print("|---|---:|---:|")
    for n, plain, every in rows:
        (f1, l1), (f2, l2) = lead(plain), lead(every)
        print(f"| {n} | {l1:.3f}x over {f1} | {l2:.3f}x over {f2} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
