"""Where the all-to-all goes: per-GPU cross-node send and receive, across and inside nodes.

The cost model charges each dispatch / combine at the slowest GPU (its inter-node plus
NVLink time, send or receive, whichever is larger). This benchmark plans a synthetic trace
with each system (the simulator's planners and pricing, flat dispatch), evaluates the last
step and reports, per system:

* max/mean over GPUs of cross-node receive and send, split into the node level (each
  node's mean over its GPUs) and the inside of the worst node;
* the all-to-all in seconds per step as planned, and as it would be if each node's GPUs
  received evenly, sent evenly, both, both plus even NVLink traffic, and cross-node send
  and receive even over the whole cluster (counterfactuals priced by the same cost
  model): how much each imbalance costs and which side binds;
* the ranks' token-expert pairs per micro-batch, max/mean inside the worst node: a rank
  with more tokens sends more under flat dispatch wherever the experts sit, which only the
  packing of samples into ranks can change.

    python benchmarks/a2a_breakdown.py [--trace rank-mix] [--systems relibra,eplb-oracle]

Options are ``relibra simulate``'s (model, hardware, nodes, micro-batches, trace, seed...);
``--json`` writes the figures (default ``out/a2a_breakdown.json``).

Relays (``planning.relay``, relibra's plans) are an NVLink stage of their own that these parts
leave out: with relays, relibra's parts do not add up to its all-to-all; ``--set
relibra.relay=false`` (where the script takes it) or the code before relays gives a breakdown that does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from relibra_torch.planning import evaluate
from relibra_torch.planning.evaluate import imbalance
from relibra_torch.sim import cli
from relibra_torch.sim.cost import CostModel
from relibra_torch.sim.simulator import default_planner_factory
from relibra_torch.sim.traces.families import FAMILIES
from relibra_torch.sim.workload import synthetic_workload


def with_default(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag value`` appended unless the user gave ``flag`` (this benchmark's
    default differs from ``relibra simulate``'s)."""
    if any(a == flag or a.startswith(flag + "=") for a in argv):
        return argv
    return [*argv, flag, value]


def node_even(x_MLG: torch.Tensor, N: int, g: int) -> torch.Tensor:
    """Each GPU's value replaced by its node's mean (float64)."""
    M, L, G = x_MLG.shape
    return x_MLG.double().view(M, L, N, g).mean(-1, keepdim=True).expand(M, L, N, g).reshape(M, L, G)


def _imbalance(x_MLG: torch.Tensor, N: int, g: int) -> dict:
    """max/mean over GPUs (the simulator's ``cross_node_recv_imbalance`` for receive), over
    the node means, and inside the worst node; each averaged over micro-batches x layers."""
    M, L, G = x_MLG.shape
    x_MLNg = x_MLG.double().view(M, L, N, g)
    return {"gpu": float(imbalance(x_MLG).mean()),
            "node": float(imbalance(x_MLNg.mean(-1)).mean()),
            "inside_worst_node": float(imbalance(x_MLNg).max(-1).values.mean())}


def breakdown(metrics, cost: CostModel, N: int, g: int) -> dict:
    """The figures of the module docstring for one evaluated plan."""
    cs, cr, is_, ir = metrics.cross_send_MLG, metrics.cross_recv_MLG, metrics.intra_send_MLG, metrics.intra_recv_MLG

    def a2a(*parts) -> float:  # dispatch + combine, forward + backward
        return 4.0 * float(cost.all_to_all_s(*parts).sum())

    def cluster_even(x_MLG: torch.Tensor) -> torch.Tensor:
        return x_MLG.double().mean(-1, keepdim=True).expand(x_MLG.shape)

    intra_even = node_even(torch.maximum(is_, ir), N, g)
    return {
        "cross_recv_imbalance": _imbalance(cr, N, g),
        "cross_send_imbalance": _imbalance(cs, N, g),
        "all_to_all_s": a2a(cs, cr, is_, ir),
        "if_recv_even_in_node_s": a2a(cs, node_even(cr, N, g), is_, ir),
        "if_send_even_in_node_s": a2a(node_even(cs, N, g), cr, is_, ir),
        "if_both_even_in_node_s": a2a(node_even(cs, N, g), node_even(cr, N, g), is_, ir),
        "if_both_and_nvlink_even_in_node_s": a2a(node_even(cs, N, g), node_even(cr, N, g), intra_even, intra_even),
        "if_all_even_s": a2a(cluster_even(cs), cluster_even(cr), intra_even, intra_even),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(parser)
    argv = with_default(list(sys.argv[1:] if argv is None else argv), "--systems", "eplb-oracle,online-global,relibra")
    # its counterfactuals are flat sends (simulate defaults to hierarchical)
    argv = with_default(argv, "--dispatch", "flat")
    args = parser.parse_args(argv)
    s = cli.resolve(args)
    if args.file or s["trace"] not in FAMILIES or s["packing"] != "fixed":
        raise SystemExit("a2a_breakdown: synthetic count-level traces with --packing fixed only "
                         f"(--trace one of {', '.join(FAMILIES)})")
    if s["cost_options"].dispatch != "flat":
        raise SystemExit("a2a_breakdown: --dispatch flat only (the per-GPU counterfactuals are flat sends)")
    model, topo = s["model_spec"], s["topology"]
    N, g = topo.num_nodes, topo.gpus_per_node
    workload = synthetic_workload(model, topo, s["micro_batches"], s["micro_batch_tokens"], s["steps"],
                                  s["seed"], s["sample_tokens"], s["trace"])
    cost = CostModel(model, s["hardware_spec"], s["cost_options"])
    loads_MLSE = workload.loads_XMLSE[-1]
    rows = {}
    from relibra_torch.sim.simulator import REFERENCES
    for name in (n for n in s["systems"] if n != "static" and n not in REFERENCES):
        planner = default_planner_factory(name, topo, cost, s["baseline_options"])
        for x in range(workload.num_steps):     # earlier steps: history and placement
            plan = planner.plan(workload.loads_XMLSE[x])
            planner.commit(plan, workload.loads_XMLSE[x])
        rows[name] = breakdown(evaluate(plan, loads_MLSE), cost, N, g)
        print(f"planned {name}", file=sys.stderr)
    tokens_MLNg = loads_MLSE.sum(-1).double().view(*loads_MLSE.shape[:2], N, g)
    rank_tokens = float((tokens_MLNg.max(-1).values / tokens_MLNg.mean(-1).clamp(min=1e-12)).max(-1).values.mean())

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{model.name} on {N} x {g} {s['hardware_spec'].name}, trace {s['trace']}, last of "
                        f"{workload.num_steps} step(s): cross-node max/mean over GPUs (gpu), of the node "
                        "means (node), inside the worst node; all-to-all s per step as planned and if even")
    for col in ("system", "recv gpu", "node", "inside", "send gpu", "node", "inside",
                "a2a s", "recv ev", "send ev", "both ev", "+nvlink", "all ev"):
        table.add_column(col, justify="left" if col == "system" else "right")
    for name, r in rows.items():
        rv, sd = r["cross_recv_imbalance"], r["cross_send_imbalance"]
        ratios = [rv["gpu"], rv["node"], rv["inside_worst_node"], sd["gpu"], sd["node"], sd["inside_worst_node"]]
        seconds = [r[k] for k in ("all_to_all_s", "if_recv_even_in_node_s", "if_send_even_in_node_s",
                                  "if_both_even_in_node_s", "if_both_and_nvlink_even_in_node_s", "if_all_even_s")]
        table.add_row(name, *(f"{x:.3f}" for x in ratios), *(f"{x:.2f}" for x in seconds))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)
    print(f"\nranks' token-expert pairs per micro-batch, max/mean inside the worst node: {rank_tokens:.3f} "
          "(flat dispatch sends each token from its own rank: a packing matter)")
    result = {"config": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
              "rank_tokens_inside_worst_node": rank_tokens, "systems": rows}
    out = Path(args.json or "out/a2a_breakdown.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
