"""Packing benchmark: fixed / length / routepack side by side on one synthetic RL step.

One step of a trace family (default ``long-tail``) for Qwen3-30B-A3B on H200, 4 nodes x 8
GPUs (32 data-parallel ranks) x 32 micro-batches of at most 8,192 tokens per GPU. For each
packing method: the surrogate objective (seconds, :mod:`relibra_torch.planning.packing`),
its ratio to fixed, and the median CPU time of packing the step (``time.process_time``
over ``--repeats`` runs; the per-sample counts are generated once, outside the timing).
Writes JSON with ``--json``.

    python benchmarks/packing.py [--trace long-tail] [--repeats 5] [--json out/packing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from relibra_torch.planning.packing import PACKING_METHODS, PackingConfig, plan_packing
from relibra_torch.sim import CostModel, get_hardware, get_model
from relibra_torch.sim.packed import packing_costs
from relibra_torch.sim.trace_families import TRACE_FAMILIES, family_config, generate_sample_trace


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", default="long-tail", choices=tuple(TRACE_FAMILIES))
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--hardware", default="h200")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8192, help="token cap per GPU per micro-batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-proposals", type=int, default=None,
                        help="routepack search length (default: PackingConfig's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    model, hw = get_model(args.model), get_hardware(args.hardware)
    costs = packing_costs(CostModel(model, hw))
    S, M = args.nodes * args.gpus_per_node, args.micro_batches
    cfg = family_config(args.trace, num_experts=model.num_experts, top_k=model.top_k,
                        num_layers=model.num_moe_layers, seed=args.seed)
    t0 = time.perf_counter()
    step = generate_sample_trace(cfg, M, S, args.tokens, steps=1,
                                 truncate=TRACE_FAMILIES[args.trace].truncate)[0]
    gen_s = time.perf_counter() - t0
    extra = {} if args.max_proposals is None else {"max_proposals": args.max_proposals}
    rows = {}
    for method in PACKING_METHODS:
        pc = PackingConfig(S, M, args.tokens, gpus_per_node=args.gpus_per_node, method=method,
                           seed=args.seed, **extra)
        cpu = []
        for _ in range(args.repeats):
            c0 = time.process_time()
            plan = plan_packing(step.lengths_N, step.counts_NLE, pc, costs, initial=(step.rank_N, step.micro_batch_N))
            cpu.append(time.process_time() - c0)
        rows[method] = {"objective_s": plan.objective_s, "cpu_s_median": statistics.median(cpu),
                        "cpu_s": cpu, "proposals": plan.proposals, "accepted": plan.accepted}
    fixed = rows["fixed"]["objective_s"]
    for r in rows.values():
        r["objective_vs_fixed"] = r["objective_s"] / fixed
    doc = {"trace": args.trace, "model": model.name, "hardware": hw.name, "ranks": S, "micro_batches": M,
           "max_tokens": args.tokens, "samples": int(step.lengths_N.numel()),
           "tokens": int(step.lengths_N.sum()), "max_sample": int(step.lengths_N.max()),
           "generate_s": gen_s, "methods": rows}
    print(f"{args.trace}: {S} ranks x {M} micro-batches, cap {args.tokens} tokens, {doc['samples']} samples "
          f"({doc['tokens']:,} tokens, longest {doc['max_sample']:,}); {model.name} on {hw.name}")
    print(f"{'method':<10} {'objective':>11} {'vs fixed':>9} {'CPU median':>11} {'proposals':>10} {'accepted':>9}")
    for name, r in rows.items():
        print(f"{name:<10} {r['objective_s']:>9.3f} s {r['objective_vs_fixed']:>9.3f} "
              f"{r['cpu_s_median']:>9.3f} s {r['proposals']:>10} {r['accepted']:>9}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()
