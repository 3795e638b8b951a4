"""Is relibra ever behind? Stand-in loads files of real shape through every system.

Issue 22's "never behind" target: on real-shaped loads files (counts only, so no
co-activation and hierarchical traffic estimated; collapsed routers; top-1, top-2 and top-8;
8 to 256 experts; 16-64 tokens per GPU per micro-batch, and the same counts multiplied by
integer factors up to about 64) relibra's step is at most 1% longer than static's and than
every baseline's. This builds a matrix of such files with ``benchmarks/standin_loads.py``,
writes each as a ``relibra.loads/1`` file and reads it back the way ``relibra simulate FILE``
does (``sim.workload.workload_from_file``), runs every system of ``sim.simulator.SYSTEMS``
on it, and prints one table: relibra's step over static's and over the fastest baseline's
(> 1: relibra slower), worst case last. ``--json`` writes every case's figures.

The model around each shape: Switch-base for top-1 (d_model 768, d_ff 3072), Mixtral-8x7B
for 8 experts top-2, OLMoE-1B-7B for 64 experts top-8, Qwen3-30B-A3B for 128 and
DeepSeek-V3's dims for 256 experts top-8 (its dense layers and MTP left out), each cut to
``--layers`` MoE layers (every layer MoE) so that a case takes about a second; ratios
between systems are per layer, so the cut changes them little.

    python benchmarks/never_behind.py                 # 144 cases, 2 processes (--jobs)
    python benchmarks/never_behind.py --quick         # 36 cases
    python benchmarks/never_behind.py --quick         # the smaller matrix
    python benchmarks/never_behind.py --set relibra.traffic_search=false   # ablate a mechanism

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, K top-k.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # standin_loads, run as a script

import torch  # noqa: E402
from standin_domains import MODELS as DOMAIN_SHAPES  # noqa: E402
from standin_domains import domain_loads  # noqa: E402
from standin_loads import standin_loads  # noqa: E402

from relibra_torch.planning.topology import Topology  # noqa: E402
from relibra_torch.replay.loads import save_loads  # noqa: E402
from relibra_torch.sim.baselines import SECTIONS, baseline_options  # noqa: E402
from relibra_torch.sim.cost import CostOptions  # noqa: E402
from relibra_torch.sim.presets import MODELS, ModelSpec, get_hardware, parse_override  # noqa: E402
from relibra_torch.sim.report import static_imbalance  # noqa: E402
from relibra_torch.sim.simulator import REFERENCES, SYSTEMS, SimConfig, simulate  # noqa: E402
from relibra_torch.sim.workload import workload_from_file  # noqa: E402

MINE = "relibra"
BAR = 1.01  # the bar: relibra's step at most 1% longer than static's and every baseline's


def _switch(E: int, L: int) -> ModelSpec:
    """Switch-base-E (google/switch-base-{8..256}: d_model 768, d_ff 3072, 12 heads x 64,
    vocab 32128), top-1, every layer MoE."""
    return ModelSpec(f"switch-base-{E}", num_layers=L, num_moe_layers=L, hidden_size=768, moe_ffn=3072,
                     num_experts=E, top_k=1, num_heads=12, num_kv_heads=12, head_dim=64, vocab_size=32128)


def _cut(spec: ModelSpec, L: int, name: str) -> ModelSpec:
    """``spec`` with ``L`` layers, all MoE (dense layers dropped)."""
    return dataclasses.replace(spec, name=name, num_layers=L, num_moe_layers=L, dense_ffn=0)


def _mixtral(L: int) -> ModelSpec:
    # Mixtral-8x7B-v0.1 config.json: hidden 4096, intermediate 14336, 8 experts top-2,
    # 32 heads / 8 KV heads x 128, vocab 32000
    return ModelSpec("mixtral-8x7b", num_layers=L, num_moe_layers=L, hidden_size=4096, moe_ffn=14336,
                     num_experts=8, top_k=2, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000)


def _olmoe(L: int) -> ModelSpec:
    # OLMoE-1B-7B-0924 config.json: hidden 2048, intermediate 1024, 64 experts top-8,
    # 16 heads x 128, vocab 50304
    return ModelSpec("olmoe-1b-7b", num_layers=L, num_moe_layers=L, hidden_size=2048, moe_ffn=1024,
                     num_experts=64, top_k=8, num_heads=16, num_kv_heads=16, head_dim=128, vocab_size=50304)


@dataclass(frozen=True)
class Shape:
    """A model shape of the matrix: ``E`` experts, top-``K``, and the model around them."""

    label: str
    num_experts: int
    top_k: int
    real_layers: int  # the MoE layers of the model around the shape (``--layers real``)

    def model(self, L: int) -> ModelSpec:
        E, K = self.num_experts, self.top_k
        if K == 1:
            return _switch(E, L)
        if (E, K) == (8, 2):
            return _mixtral(L)
        if (E, K) == (64, 8):
            return _olmoe(L)
        if (E, K) == (128, 8):
            return _cut(MODELS["qwen3-30b-a3b"], L, "qwen3-30b-a3b")
        if (E, K) == (256, 8):
            return _cut(dataclasses.replace(MODELS["deepseek-v3"], num_expert_groups=8), L, "deepseek-v3")
        return dataclasses.replace(_olmoe(L), name=f"olmoe-shape-{E}e-top{K}", num_experts=E, top_k=K)


# real MoE layer counts: Switch-base's 12 sparse blocks (every other of 12 encoder + 12
# decoder blocks), Mixtral-8x7B 32, OLMoE-1B-7B 16, Qwen3-30B-A3B 48, DeepSeek-V3 58 (61
# layers, 3 dense); the 32-expert top-2 shape takes OLMoE's 16
SHAPES = {
    "switch-8": Shape("top-1 8e", 8, 1, 12),
    "switch-64": Shape("top-1 64e", 64, 1, 12),
    "switch-256": Shape("top-1 256e", 256, 1, 12),
    "mixtral": Shape("top-2 8e", 8, 2, 32),
    "top2-32": Shape("top-2 32e", 32, 2, 16),
    "olmoe": Shape("top-8 64e", 64, 8, 16),
    "qwen3": Shape("top-8 128e", 128, 8, 48),
    "deepseek": Shape("top-8 256e", 256, 8, 58),
}


def case_layers(shape: Shape, layers) -> int:
    """MoE layers of a case: ``--layers`` (an int), or the model's own count for ``real``."""
    return shape.real_layers if layers == "real" else int(layers)

# (tokens per GPU per micro-batch, factor): the real sizes, and the same counts multiplied
SIZES = [(16, 1), (32, 8), (16, 64), (64, 64)]

# routers: Zipf popularity (exponent) and chance of a collapsed first choice
ROUTERS = {"zipf": (1.0, 0.0), "collapsed": (1.0, 0.95)}
# "domains": real per-domain expert counts, one domain per (micro-batch, rank), so the hot
# experts move between micro-batches (standin_domains.py); for the shapes with such data


@dataclass(frozen=True)
class Case:
    shape: str
    router: str
    tokens: int      # per GPU per micro-batch, before the factor
    factor: int
    nodes: int
    gpus_per_node: int

    @property
    def name(self) -> str:
        return (f"{self.shape}/{self.router}/t{self.tokens}x{self.factor}/"
                f"{self.nodes}x{self.gpus_per_node}")


def clusters(E: int, multi_only: bool = False) -> list[tuple[int, int]]:
    """One node of 8 GPUs (flat dispatch) and two nodes (hierarchical): 2 x 8, or 2 x 4 where
    8 experts cannot fill 16 GPUs."""
    two = (2, 8) if E % 16 == 0 else (2, 4)
    return [two] if multi_only else [(1, 8), two]


def matrix(quick: bool) -> list[Case]:
    """The cases: every shape x router x tokens x factor x cluster (``quick``: fewer)."""
    if quick:
        shapes = ["switch-64", "mixtral", "qwen3", "deepseek"]
        sizes = [(16, 1), (64, 64)]
    else:
        shapes = list(SHAPES)
        sizes = SIZES
    out = []
    for s, r, (t, f) in itertools.product(shapes, [*ROUTERS, "domains"], sizes):
        if r == "domains" and s not in DOMAIN_SHAPES:
            continue
        for n, g in clusters(SHAPES[s].num_experts):
            out.append(Case(s, r, t, f, n, g))
    return out


def case_workload(case: Case, args, options, tmp: Path):
    """Write the case's loads file and read it back as ``relibra simulate FILE`` does:
    ``(loads_XMLSE, workload, config)`` with every system of ``SYSTEMS``."""
    shape = SHAPES[case.shape]
    L = case_layers(shape, args.layers)
    model = shape.model(L)
    G = case.nodes * case.gpus_per_node
    zipf, collapse = ROUTERS.get(case.router, (0.0, 0.0))
    seed = args.seed + (zlib.crc32(case.name.encode()) & 0xFFFF) if args.vary_seed else args.seed
    if case.router == "domains":
        loads = domain_loads(case.shape, L, args.micro_batches, G, case.tokens, steps=args.steps,
                             factor=case.factor, seed=seed)
    else:
        loads = standin_loads(shape.num_experts, shape.top_k, L, args.micro_batches, G, case.tokens,
                              steps=args.steps, zipf=zipf, collapse=collapse, factor=case.factor, seed=seed)
    path = tmp / (case.name.replace("/", "_") + ".safetensors")
    save_loads(path, loads, shape.top_k)
    topo = Topology(case.nodes, case.gpus_per_node, shape.num_experts, args.replica_slots)
    workload = workload_from_file(str(path), model, topo, args.micro_batches)
    dispatch = "hierarchical" if case.nodes > 1 else "flat"
    config = SimConfig(model, get_hardware(args.hardware), topo, SYSTEMS, CostOptions(dispatch=dispatch),
                       warmup_steps=1 if args.steps > 1 else 0, baseline_options=options)
    return loads, workload, config


def run_case(case: Case, args, options, tmp: Path) -> dict:
    """Run every system on the case's loads file; the figures per system and relibra's ratios."""
    shape = SHAPES[case.shape]
    G = case.nodes * case.gpus_per_node
    loads, workload, config = case_workload(case, args, options, tmp)
    model = config.model
    dispatch = config.cost_options.dispatch
    t0 = time.perf_counter()
    result = simulate(workload, config)
    figs, used = result.figures(), result.config.baseline_options
    secs = time.perf_counter() - t0
    step = {n: f["step_time_s"] for n, f in figs.items()}
    charged = {n: f["planning_charged_s"] for n, f in figs.items()}
    # the cost model's step without the host work charged beyond the overlap window: that
    # charge is measured CPU time (one thread), so it varies with the machine and its load
    model_s = {n: step[n] - charged[n] for n in step}
    rivals = [n for n in step if n not in REFERENCES and n != MINE]  # static and every baseline
    base = [n for n in rivals if n != "static"]
    out = {
        "case": case.name, **dataclasses.asdict(case), "model": model.name, "experts": shape.num_experts,
        "top_k": shape.top_k, "dispatch": dispatch,
        "static_imbalance": static_imbalance(loads[config.warmup_steps:], G),
        **drift(loads[config.warmup_steps:], G),
        "step_s": step, "charged_s": charged, "model_step_s": model_s,
        "relibra_replica_s": figs[MINE]["replica_transfer_s"],
        "relibra_migration_s": figs[MINE]["migration_s"],
        "relibra_planner_s": figs[MINE]["planner_s"],
        # the guard's host scales the run used (measured in this process unless --set)
        "host_scale": [used.relibra_host_scale, used.relibra_host_scale_nodes],
        "sim_s": secs,
    }
    for tag, t in (("", model_s), ("charged_", step)):
        fastest = min(base, key=t.get)
        worst = max(rivals, key=lambda n: t[MINE] / t[n])  # the system relibra trails most
        out.update({f"{tag}relibra_over_static": t[MINE] / t["static"], f"{tag}fastest_baseline": fastest,
                    f"{tag}relibra_over_fastest": t[MINE] / t[fastest], f"{tag}worst_against": worst,
                    f"{tag}relibra_over_worst": t[MINE] / t[worst],
                    f"{tag}relibra_over_node_demand": t[MINE] / t["eplb-node-demand"]})
    return out


def drift(loads_XMLSE: torch.Tensor, num_gpus: int) -> dict:
    """What only per-micro-batch loads show: static placement's max/mean GPU load per (micro-batch,
    layer) (``mb_imbalance``), against the same of the step's totals (``step_imbalance``), each
    averaged over layers and steps. Their ratio is how much skew a planner from step totals
    cannot see."""
    X, M, L, S, E = loads_XMLSE.shape
    gpu_XMLG = loads_XMLSE.sum(3).reshape(X, M, L, num_gpus, E // num_gpus).sum(-1).to(torch.float64)
    mb = gpu_XMLG.amax(-1) / gpu_XMLG.mean(-1).clamp_min(1e-9)
    tot_XLG = gpu_XMLG.sum(1)
    step = tot_XLG.amax(-1) / tot_XLG.mean(-1).clamp_min(1e-9)
    return {"mb_imbalance": float(mb.mean()), "step_imbalance": float(step.mean())}


def replay_summary(rows: list[dict]) -> None:
    """relibra (per-micro-batch replay loads) against eplb-node-demand (eplb-oracle's placement
    plus step-long traffic replicas from step totals): the lead per router, size and cluster."""
    from collections import defaultdict

    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[(r["router"], f"t{r['tokens']}x{r['factor']}", "1 node" if r["nodes"] == 1 else "2 nodes")].append(r)
    print("relibra's lead over eplb-node-demand (its step / relibra's; cost model), min / median / max over shapes;"
          " mb/step imb: static's per-micro-batch max/mean over that of the step's totals")
    for key in sorted(groups):
        vals = sorted(r["model_step_s"]["eplb-node-demand"] / r["model_step_s"][MINE] for r in groups[key])
        gap = sum(r["mb_imbalance"] / r["step_imbalance"] for r in groups[key]) / len(groups[key])
        print(f"  {' / '.join(key):<28} {vals[0]:.3f}  {vals[len(vals) // 2]:.3f}  {vals[-1]:.3f}   "
              f"mb/step imb {gap:.2f}")


def _run_case_star(item) -> dict:
    return run_case(*item)


def _options(sets: list[str]):
    sections: dict[str, dict] = {}
    for text in sets:
        section, name, value = parse_override(text)
        if section not in SECTIONS:
            raise SystemExit(f"--set {text}: allowed sections {', '.join(SECTIONS)}")
        sections.setdefault(section, {})[name] = value
    return baseline_options(sections)


def print_table(rows: list[dict]) -> None:
    """One row per case, worst last; the worst case and every case behind the bar named."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="relibra's step over static's and over the fastest baseline's (> 1.010: behind the bar); "
                        "model: the cost model's step; +host: with host work charged beyond the overlap window")
    for col, just in (("case", "left"), ("disp.", "left"), ("static imb", "right"), ("relibra", "right"),
                      ("/ static", "right"), ("fastest baseline", "left"), ("/ fastest", "right"),
                      ("trails most", "left"), ("/ it", "right"), ("/ node-demand", "right"),
                      ("+host: / it", "right"), ("host charged", "right")):
        table.add_column(col, justify=just)
    for r in sorted(rows, key=lambda r: max(r["relibra_over_worst"], r["charged_relibra_over_worst"])):
        style = "bold red" if r["relibra_over_worst"] > BAR else ("red" if r["charged_relibra_over_worst"] > BAR
                                                                    else None)
        table.add_row(r["case"], r["dispatch"][:4], f"{r['static_imbalance']:.2f}",
                      f"{r['model_step_s'][MINE] * 1e3:.3f} ms", f"{r['relibra_over_static']:.4f}",
                      r["fastest_baseline"], f"{r['relibra_over_fastest']:.4f}", r["worst_against"],
                      f"{r['relibra_over_worst']:.4f}", f"{r['relibra_over_node_demand']:.4f}",
                      f"{r['charged_relibra_over_worst']:.4f}", f"{r['charged_s'][MINE] * 1e3:.2f} ms", style=style)
    console = Console(width=220) if not sys.stdout.isatty() else Console()
    console.print(table)
    for tag, what in (("", "cost model's step"), ("charged_", "step with host work charged")):
        behind = [r for r in rows if r[f"{tag}relibra_over_worst"] > BAR]
        worst = max(rows, key=lambda r: r[f"{tag}relibra_over_worst"])
        console.print(f"{what}: worst case {worst['case']}: relibra {worst[f'{tag}relibra_over_worst']:.4f}x "
                      f"{worst[f'{tag}worst_against']}'s step (over static {worst[f'{tag}relibra_over_static']:.4f}x, "
                      f"over the fastest baseline {worst[f'{tag}fastest_baseline']} "
                      f"{worst[f'{tag}relibra_over_fastest']:.4f}x); {len(behind)} of {len(rows)} cases more than "
                      f"1% behind static or a baseline" + (": " + ", ".join(r["case"] for r in behind) if behind else ""),
                      highlight=False, soft_wrap=True)
    scales = sorted({tuple(r["host_scale"]) for r in rows if "host_scale" in r})
    console.print(f"relibra's guard: host scale (one node, across nodes) {', '.join(map(str, scales))}",
                  highlight=False)


def _layers_arg(text: str):
    if text == "real":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}; allowed: a positive int or 'real'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--layers {value}; allowed: a positive int or 'real'")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the smaller matrix (4 shapes, 16 tokens x 1 and 64 x 64)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="cases whose name contains TEXT (repeatable: any of them)")
    p.add_argument("--layers", type=_layers_arg, default=4,
                   help="MoE layers per case (default 4), or 'real': each model's own count (12-58); "
                        "split planning's share per EP rank then has the layer count it has in training")
    p.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default 8)")
    p.add_argument("--steps", type=int, default=2, help="steps, the first a warm-up (default 2)")
    p.add_argument("--replica-slots", type=int, default=2, help="R (default 2)")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vary-seed", action="store_true", help="a different stand-in seed per case")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="baseline or relibra setting, as relibra simulate --set (e.g. relibra.balance=false)")
    p.add_argument("--jobs", type=int, default=2,
                   help="cases run in this many processes (default 2, the project's 2 cores; 1: in this one)")
    p.add_argument("--json", type=Path, help="write every case's figures here")
    args = p.parse_args(argv)
    options = _options(args.set)
    cases = [c for c in matrix(args.quick) if not args.only or any(t in c.name for t in args.only)]
    if not cases:
        raise SystemExit("no case matches --only")
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        work = [(case, args, options, Path(tmp)) for case in cases]
        if args.jobs > 1:  # cases are independent; each worker plans on one thread
            import multiprocessing
            pool = multiprocessing.get_context("fork").Pool(args.jobs, initializer=torch.set_num_threads,
                                                             initargs=(1,))
            results = pool.imap(_run_case_star, work)
        else:
            pool, results = None, map(_run_case_star, work)
        try:
            for i, r in enumerate(results, 1):
                rows.append(r)
                flag = ("  BEHIND" if r["relibra_over_worst"] > BAR else
                        "  behind with host charge" if r["charged_relibra_over_worst"] > BAR else "")
                print(f"[{i}/{len(cases)} {time.perf_counter() - t0:5.0f} s] {r['case']}: relibra / static "
                      f"{r['relibra_over_static']:.4f}, / {r['fastest_baseline']} {r['relibra_over_fastest']:.4f}"
                      f"{flag}", file=sys.stderr, flush=True)
        finally:
            if pool is not None:
                pool.close()
                pool.join()
    print_table(rows)
    replay_summary(rows)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": {k: (str(v) if isinstance(v, Path) else v)
                                                      for k, v in vars(args).items()},
                                         "bar": BAR, "cases": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
