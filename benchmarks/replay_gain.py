"""What only replay gives: relibra planned from per-micro-batch loads against the same planner
fed the step's totals, and against ``eplb-node-demand``.

``relibra-totals`` is relibra's own planner given, for every micro-batch, the step's mean
loads per (layer, source rank, expert) (what a planner from step totals knows: each node's
demand for the step, no micro-batch's). Its replicas are then the same in every micro-batch
(one fill per step); each (micro-batch, layer, expert)'s real tokens are split over the
planned instances in proportion to their planned quotas (the remainder to the native slot).
So ``relibra-totals`` against ``relibra`` isolates the per-micro-batch knowledge with every
other part of the planner equal; ``eplb-node-demand`` (eplb-oracle's placement plus step-long
traffic replicas from each node's step demand) is the baseline from step totals.

    python benchmarks/replay_gain.py                    # stand-ins (never_behind.py cases)
    python benchmarks/replay_gain.py --family default --family collapsed   # docs/results.md runs

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import never_behind as nb  # noqa: E402

from relibra_torch.planning.base import Planner  # noqa: E402
from relibra_torch.planning.plan import StepPlan  # noqa: E402
from relibra_torch.sim.simulator import REFERENCES, SimConfig, default_planner_factory, simulate  # noqa: E402

SYSTEMS = ("static", "eplb-oracle", "eplb-node-demand", "relibra", "relibra-totals")


def refit(plan: StepPlan, loads_MLSE: torch.Tensor) -> StepPlan:
    """``plan`` with each (m, l, e)'s real load split over e's instances in proportion to the
    planned quotas (integer floor; the remainder, and any load e had none planned for, to e's
    native slot)."""
    M, L, G, J = plan.slot_expert_MLGJ.shape
    E = loads_MLSE.shape[-1]
    El = E // G
    A_MLE = loads_MLSE.sum(2)
    se_MLP = plan.slot_expert_MLGJ.reshape(M, L, G * J)
    q_MLP = plan.slot_tokens_MLGJ.reshape(M, L, G * J)
    valid = se_MLP >= 0
    idx = se_MLP.clamp_min(0)
    q_MLP = torch.where(valid, q_MLP, 0)
    Q_MLE = torch.zeros(M, L, E, dtype=torch.int64).scatter_add_(2, idx, q_MLP)
    Qs, As = Q_MLE.gather(2, idx), A_MLE.gather(2, idx)
    new_MLP = torch.where(valid & (Qs > 0), As * q_MLP // Qs.clamp_min(1), 0)
    rem_MLE = A_MLE - torch.zeros_like(A_MLE).scatter_add_(2, idx, new_MLP)
    p_LE = plan.placement_LE
    native_LE = (p_LE // El) * J + p_LE % El  # slot j = local index of the expert on its owner
    native_MLE = native_LE.unsqueeze(0).expand(M, L, E)
    assert bool((se_MLP.gather(2, native_MLE) == torch.arange(E).view(1, 1, E)).all()), "native slot mismatch"
    new_MLP.scatter_add_(2, native_MLE, rem_MLE)
    return dataclasses.replace(plan, slot_tokens_MLGJ=new_MLP.view(M, L, G, J))


class FromTotals(Planner):
    """``inner`` planned from the step's mean loads in every micro-batch, then refitted."""

    name = "relibra-totals"

    def __init__(self, inner: Planner):
        super().__init__(inner.topology)
        self.inner = inner

    @property
    def uses_coactivation(self) -> bool:
        return getattr(self.inner, "uses_coactivation", False)

    def plan(self, loads_MLSE: torch.Tensor, pairs_LEE: torch.Tensor | None = None) -> StepPlan:
        M = loads_MLSE.shape[0]
        mean_MLSE = (loads_MLSE.sum(0, keepdim=True) // M).expand_as(loads_MLSE).contiguous()
        plan = self.inner.plan(mean_MLSE) if pairs_LEE is None else self.inner.plan(mean_MLSE, pairs_LEE)
        return refit(plan, loads_MLSE)

    def commit(self, plan: StepPlan, loads_MLSE: torch.Tensor) -> None:
        self.inner.commit(plan, loads_MLSE)


def run(workload, config: SimConfig) -> dict:
    """Model steps (host charge left out) of :data:`SYSTEMS` on ``workload``."""
    config = dataclasses.replace(config, systems=SYSTEMS)

    def factory(name, topology, cost):
        if name == "relibra-totals":
            return FromTotals(default_planner_factory("relibra", topology, cost, config.baseline_options))
        return default_planner_factory(name, topology, cost, config.baseline_options)

    figs = simulate(workload, config, planner_factory=factory).figures()
    return {n: f["step_time_s"] - f["planning_charged_s"] for n, f in figs.items() if n not in REFERENCES}


def stand_in(case: nb.Case, args, tmp: Path) -> dict:
    """One never_behind.py case through :data:`SYSTEMS`."""
    loads, workload, config = nb.case_workload(case, args, nb._options([]), tmp)
    G = config.topology.num_gpus
    return {"case": case.name, **nb.drift(loads[config.warmup_steps:], G), "steps": run(workload, config)}


def family(name: str, micro_batches: int) -> dict:
    """A docs/results.md run (Qwen3-30B-A3B, 4 x 8 H200, hierarchical) through :data:`SYSTEMS`."""
    from relibra_torch.planning.topology import Topology
    from relibra_torch.sim.cost import CostOptions
    from relibra_torch.sim.presets import get_hardware, get_model
    from relibra_torch.sim.workload import synthetic_workload
    trace, skew = {"default": ("default", 1.0), "skew-0.5": ("default", 0.5), "skew-0.25": ("default", 0.25),
                   "rank-mix": ("rank-mix", 1.0), "collapsed": ("collapsed", 1.0)}[name]
    model, topo = get_model("qwen3-30b-a3b"), Topology(4, 8, 128, 2)
    wl = synthetic_workload(model, topo, micro_batches, 8192, 2, 0, trace=trace, skew=skew)
    config = SimConfig(model, get_hardware("h200"), topo, SYSTEMS, CostOptions(dispatch="hierarchical"), 1)
    return {"case": name, **nb.drift(wl.loads_XMLSE[1:], topo.num_gpus), "steps": run(wl, config)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", action="append", default=[],
                   choices=["default", "skew-0.5", "skew-0.25", "rank-mix", "collapsed"],
                   help="a docs/results.md run (8 micro-batches) instead of the stand-ins (repeatable)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT", help="stand-in cases containing TEXT")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    settings = argparse.Namespace(layers=4, micro_batches=8, steps=2, replica_slots=2, hardware="h200", seed=0,
                                  vary_seed=False)
    t0 = time.perf_counter()
    rows = []
    if args.family:
        for name in args.family:
            rows.append(family(name, 8))
            print(f"[{time.perf_counter() - t0:5.0f} s] {name}", file=sys.stderr, flush=True)
    else:
        cases = [c for c in nb.matrix(False) if c.factor > 1 and (not args.only or any(t in c.name for t in args.only))]
        with tempfile.TemporaryDirectory() as tmp:
            for c in cases:
                rows.append(stand_in(c, settings, Path(tmp)))
                print(f"[{time.perf_counter() - t0:5.0f} s] {c.name}", file=sys.stderr, flush=True)
    print(f"{'case':<34} {'mb/step imb':>11} {'totals/relibra':>14} {'node-demand/relibra':>19} "
          f"{'node-demand/totals':>18} {'static/relibra':>14}")
    for r in rows:
        s = r["steps"]
        print(f"{r['case']:<34} {r['mb_imbalance'] / r['step_imbalance']:>11.3f} "
              f"{s['relibra-totals'] / s['relibra']:>14.4f} {s['eplb-node-demand'] / s['relibra']:>19.4f} "
              f"{s['eplb-node-demand'] / s['relibra-totals']:>18.4f} {s['static'] / s['relibra']:>14.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
