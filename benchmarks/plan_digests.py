"""Digests of relibra's plans on never_behind's cases, to check that a planner change keeps
every plan (run it from two checkouts and diff the outputs).

    python benchmarks/plan_digests.py [--quick] [--layers real] [--only TEXT] > digests.txt

One line per case: the digest of relibra's plan at every step (``planning.plan_digest``),
then its replica and migration seconds, ``repr`` (every digit). The cost model is a
function of the plan, so equal digests give equal step times; never_behind's
``model_step_s`` (the step less its host charge, a float subtraction) can differ in the
last digit where the measured charge differs.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import never_behind as nb  # noqa: E402

from relibra_torch.planning.plan import plan_digest  # noqa: E402
from relibra_torch.sim.baselines import baseline_options  # noqa: E402
from relibra_torch.sim.simulator import simulate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--layers", type=nb._layers_arg, default=4)
    p.add_argument("--only", action="append", default=[])
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--replica-slots", type=int, default=2)
    p.add_argument("--hardware", default="h200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vary-seed", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cases = [c for c in nb.matrix(args.quick) if not args.only or any(t in c.name for t in args.only)]
    import relibra_torch.sim.simulator as sim
    digests: list[str] = []
    original = sim.plan_as_run

    def spy(planner, loads, pairs, config):
        plan, secs, split = original(planner, loads, pairs, config)
        if getattr(planner, "host_token_splits", False):  # relibra
            digests.append(plan_digest(plan))
        return plan, secs, split

    sim.plan_as_run = spy
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            digests.clear()
            # the guard at the fitted constants' scale: digests compare code, not hosts
            fixed = baseline_options({"relibra": {"host_scale": 1, "host_scale_nodes": 1}})
            _, wl, config = nb.case_workload(case, args, fixed, Path(tmp))
            config = dataclasses.replace(config, systems=("static", "relibra"))
            res = simulate(wl, config).figures()["relibra"]
            print(case.name, " ".join(digests), repr(res["replica_transfer_s"]), repr(res["migration_s"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
