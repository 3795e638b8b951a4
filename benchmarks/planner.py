"""Planner benchmark: balance and speed of every planner on one synthetic RL step.

All systems run on the same loads in one process. Default: 128 experts, top-8, 48 layers,
4 nodes x 8 GPUs, R = 2, 32 micro-batches of 16,384 tokens per GPU (the foundation issue's
setting). EPLB (history) gets ``--warmup`` earlier steps of the same trace as history; the
measured step is the last one.

Prints a table (imbalance = max GPU tokens / mean, per micro-batch and layer) and the
planning time on one CPU core, and writes JSON. Planning time is CPU time
(``time.process_time``, so other processes on the machine do not inflate it), the median of
``--repeats`` runs: of the whole step in one process, and, for planners that plan layers
independently (``Planner.splits_layers``), of one EP rank's share under split planning
(``ReplayBalancer`` gives rank ``r`` every ``G``-th layer from ``r``; the slowest rank's
median is reported, since the ranks wait for it in the all-gather).

    python benchmarks/planner.py [--json out/planner.json]
    python benchmarks/planner.py --no-copy-only     # relibra on the four small micro-batch cases
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from relibra_torch.planning import Topology, evaluate, lis, lis_summary, make_planner, token_split
from relibra_torch.planning.pricing import priced_config
from relibra_torch.sim.traces import TraceConfig, generate_loads, uniform_max_over_mean


def _quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.flatten().to(torch.float64), q))


# (tokens per GPU, Zipf popularity exponent, collapsed-router share) where relibra's final
# plan has no copy and no move at the default shape: mild skew, larger micro-batches, Zipf 1.0,
# a collapsed router (the target: <= 50 ms of one thread per step on each)
NO_COPY_CASES = [(16, 0.3, 0.0), (64, 0.3, 0.0), (16, 1.0, 0.0), (16, 0.3, 0.95)]


def _no_copy_case(args, topo: Topology, tokens: int, zipf: float, collapse: float) -> dict:
    """relibra's planning time on real micro-batch sizes, where no copy or move pays: the
    fast path (planning/fastpath.py) should prove it for next to nothing."""
    from relibra_torch.planning.fastpath import nothing_pays
    from standin_loads import standin_loads

    loads = standin_loads(args.experts, args.top_k, args.layers, args.micro_batches, topo.num_gpus,
                          tokens, steps=1, zipf=zipf, collapse=collapse, seed=args.seed)[0]
    # with choose (the stricter case: its fast path needs static placement's GPUs)
    cfg = priced_config(args.dim, args.ffn, "h200", dispatch="hierarchical", top_k=args.top_k, choose=True)
    planner = make_planner("relibra", topo, config=cfg)
    times = []
    for _ in range(args.repeats):
        t0 = time.process_time()
        plan = planner.finish(planner.plan(loads), loads)  # relays included (hierarchical)
        times.append(time.process_time() - t0)
    m = evaluate(plan, loads)
    return {"plan_s": statistics.median(times), "tokens_per_gpu": tokens, "zipf": zipf, "collapse": collapse,
            "fast_path": nothing_pays(loads, topo, topo.static_placement(args.layers), cfg),
            "replicas": int(m.fill_MLGJ.sum()), "migrated_experts": int(m.migrated_L.sum())}


def no_copy_cases(args, topo: Topology) -> list[dict]:
    """Every case of :data:`NO_COPY_CASES` (the first with ``--small-tokens`` and
    ``--small-zipf``), each printed as one line."""
    cases = [(args.small_tokens, args.small_zipf, 0.0), *NO_COPY_CASES[1:]]
    out = []
    for tokens, zipf, collapse in cases:
        r = _no_copy_case(args, topo, tokens, zipf, collapse)
        out.append(r)
        router = f"collapsed {collapse:.2f}" if collapse else f"zipf {zipf}"
        idle = not r["replicas"] and not r["migrated_experts"]
        target = "target <= 50 ms: no copy or move pays" if idle else "copies pay here: the 50 ms target does not apply"
        print(f"relibra on small micro-batches ({tokens} tokens/GPU, stand-in loads {router}, same shape): "
              f"{1000 * r['plan_s']:.1f} ms CPU ({target}); fast path taken: {r['fast_path']}; "
              f"replicas {r['replicas']}, migrated {r['migrated_experts']}")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--replica-slots", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per GPU per micro-batch")
    parser.add_argument("--warmup", type=int, default=3, help="earlier steps (EPLB history)")
    parser.add_argument("--repeats", type=int, default=5, help="timing repeats (the median is reported)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=2048, help="model dim D that prices relibra's fills")
    parser.add_argument("--ffn", type=int, default=768, help="expert hidden dim F that prices relibra's fills")
    parser.add_argument("--small-tokens", type=int, default=16,
                        help="tokens per GPU of the no-copy case (real micro-batch sizes: 16-64)")
    parser.add_argument("--small-zipf", type=float, default=0.3, help="expert popularity skew of that case")
    parser.add_argument("--no-copy-only", action="store_true",
                        help="only relibra's planning time on the cases where no copy pays (NO_COPY_CASES)")
    parser.add_argument("--json", type=Path, default=Path("out/planner.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the target is one CPU core

    topo = Topology(args.nodes, args.gpus_per_node, args.experts, args.replica_slots)
    if args.no_copy_only:
        return {"config": vars(args) | {"json": str(args.json)}, "relibra_no_copy_cases": no_copy_cases(args, topo)}
    cfg = TraceConfig(num_layers=args.layers, num_experts=args.experts, top_k=args.top_k, seed=args.seed)
    t0 = time.perf_counter()
    loads_XMLSE = generate_loads(cfg, args.micro_batches, topo.num_gpus, args.tokens, steps=args.warmup + 1)
    print(f"trace: {tuple(loads_XMLSE.shape)} [steps, M, L, S, E] in {time.perf_counter() - t0:.1f} s")
    loads_MLSE = loads_XMLSE[-1]

    rows = {}
    for name in ("static", "eplb", "eplb-oracle", "relibra"):
        # relibra priced like the simulator prices it (Qwen3-30B-A3B experts on H200): fills
        # and migrations cost what they cost, so it copies and moves only what pays.
        kwargs = {"config": priced_config(args.dim, args.ffn, "h200")} if name == "relibra" else {}
        planner = make_planner(name, topo, **kwargs)
        for step in range(args.warmup):  # history and placement from earlier steps
            planner.commit(planner.plan(loads_XMLSE[step]), loads_XMLSE[step])
        times = []
        for _ in range(args.repeats):
            t0 = time.process_time()
            plan = planner.finish(planner.plan(loads_MLSE), loads_MLSE)
            times.append(time.process_time() - t0)
        best = statistics.median(times)
        share = None
        if planner.splits_layers:
            G = topo.num_gpus
            per_rank = []
            for r in range(min(G, args.layers)):
                layers = list(range(r, args.layers, G))
                ts = []
                for _ in range(args.repeats):
                    t0 = time.process_time()
                    planner.plan_layers(loads_MLSE, layers)
                    ts.append(time.process_time() - t0)
                per_rank.append(statistics.median(ts))
            share = max(per_rank)
        m = evaluate(plan, loads_MLSE)
        layer_plans = args.layers * args.micro_batches
        rows[name] = {
            "imbalance_mean": float(m.imbalance_ML.mean()),
            "imbalance_p50": _quantile(m.imbalance_ML, 0.5),
            "imbalance_p99": _quantile(m.imbalance_ML, 0.99),
            "imbalance_max": float(m.imbalance_ML.max()),
            "plan_s": best,
            "rank_share_s": share,
            "layer_plans_per_s": layer_plans / best,
            "fills_per_micro_batch_layer": float(m.fill_MLGJ.sum() / layer_plans),
            "migrated_experts": int(m.migrated_L.sum()),
        }
    # The layer's host-side schedule: one token_split per micro-batch for all layers
    # (moe.schedule.layer_plans), on relibra's plan (the last planned above).
    split_s = []
    for m_ in range(min(args.repeats, args.micro_batches)):
        t0 = time.process_time()
        token_split(plan.micro_batch(m_), loads_MLSE[m_:m_ + 1])
        split_s.append(time.process_time() - t0)
    rows["relibra"]["token_split_ms_per_micro_batch"] = 1000 * statistics.median(split_s)
    mean = loads_MLSE.to(torch.float64).sum((2, 3)) / topo.num_gpus
    lb = m.lower_bound_ML / mean
    rows["lower-bound"] = {"imbalance_mean": float(lb.mean()), "imbalance_p50": _quantile(lb, 0.5),
                           "imbalance_p99": _quantile(lb, 0.99), "imbalance_max": float(lb.max())}
    uniform = uniform_max_over_mean(args.tokens * topo.num_gpus, args.experts, args.top_k, seed=args.seed)

    print(f"\n{args.nodes} nodes x {args.gpus_per_node} GPUs, E={args.experts}, top-{args.top_k}, "
          f"L={args.layers}, R={args.replica_slots}, M={args.micro_batches} x {args.tokens} tokens/GPU")
    header = (f"{'system':<12} {'imb mean':>9} {'p50':>7} {'p99':>7} {'max':>7} {'plan s':>8} {'rank ms':>8} "
              f"{'layer-plans/s':>14} {'fills':>7} {'migrated':>9}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        share = "-" if r.get("rank_share_s") is None else f"{1000 * r['rank_share_s']:.1f}"
        extra = (f" {r['plan_s']:>8.3f} {share:>8} {r['layer_plans_per_s']:>14.0f} "
                 f"{r['fills_per_micro_batch_layer']:>7.1f} {r['migrated_experts']:>9d}") if "plan_s" in r else ""
        print(f"{name:<12} {r['imbalance_mean']:>9.3f} {r['imbalance_p50']:>7.3f} {r['imbalance_p99']:>7.3f} "
              f"{r['imbalance_max']:>7.3f}{extra}")
    print(f"\nuniform-routing expert max/mean at {args.tokens * topo.num_gpus} tokens: {uniform:.3f} "
          "(sampling noise alone, for scale)")
    print(f"relibra vs static imbalance: {rows['static']['imbalance_mean'] / rows['relibra']['imbalance_mean']:.2f}x lower; "
          f"relibra planning {rows['relibra']['layer_plans_per_s'] / rows['eplb']['layer_plans_per_s']:.2f}x "
          f"the layer-plans/s of eplb")
    print(f"planning CPU time (median of {args.repeats}): whole step in one process {rows['relibra']['plan_s']:.3f} s "
          f"(target <= 1 s); one EP rank's share of split planning {1000 * rows['relibra']['rank_share_s']:.1f} ms "
          f"(target <= 100 ms)")
    print(f"token split of one micro-batch, all {args.layers} layers (the layer's host-side schedule, "
          f"median of {len(split_s)}): {rows['relibra']['token_split_ms_per_micro_batch']:.1f} ms")
    small = no_copy_cases(args, topo)
    lis_ML = lis(loads_MLSE.sum(2))  # depends on the loads only: once, not per system
    print(f"LIS (max expert / equal share) over micro-batches x layers: mean {float(lis_ML.mean()):.3f}, "
          f"max {float(lis_ML.max()):.3f}")
    result = {"config": vars(args) | {"json": str(args.json)}, **lis_summary(lis_ML), "systems": rows,
              "uniform_expert_max_over_mean": uniform, "relibra_no_copy_case": small[0],
              "relibra_no_copy_cases": small}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
