"""Where a step goes under hierarchical dispatch: each term of the cost model, per system.

The cost model charges each of the four all-to-all passes at the slowest GPU's
``max(cross_send, cross_recv) / X + max(intra_send, intra_recv) / V`` (rows: one per
(token, remote node) across nodes, one per (token, GPU) over NVLink; estimated from counts
for synthetic traces, ``sim.dispatch``). This benchmark plans a synthetic trace with each
system, evaluates the last step as the simulator does and prints, per system:

* the step's terms: expert compute, all-to-all (split into the binding GPU's inter-node
  and NVLink parts), exposed fills and gradient returns, collective latency, migration;
* which side binds at the slowest GPU (cross send, cross receive; NVLink send, receive),
  as shares of the (micro-batch, layer) rows;
* per node, the mean over rows of its GPUs' summed cross-node send and receive rows, and
  the max/mean over GPUs of each;
* the ranks' tokens (max/mean per micro-batch), cross-node rows per token, and the busiest
  sender's rows against the most tokens times the mean rows per token (1.0: the busiest
  GPU sends what its token count implies); the inter-node fills the busiest owner sends
  per layer;
* counterfactual all-to-all seconds priced by the same cost model: NVLink free; inter-node
  free; each node's GPUs sending / receiving evenly; cross-node rows even over the
  cluster (what balancing the NICs could reach at the same row count).

    python benchmarks/hier_breakdown.py [--trace rank-mix] [--systems relibra,eplb-oracle]

Options are ``relibra simulate``'s; ``--json`` writes the figures
(default ``out/hier_breakdown.json``).

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

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a2a_breakdown, run as a script

from a2a_breakdown import node_even, with_default  # noqa: E402
from relibra_torch.planning import evaluate  # noqa: E402
from relibra_torch.sim import cli  # noqa: E402
from relibra_torch.sim.cost import CostModel  # noqa: E402
from relibra_torch.sim.dispatch import hierarchical_metrics  # noqa: E402
from relibra_torch.sim.simulator import default_planner_factory  # noqa: E402
from relibra_torch.sim.workload import synthetic_workload  # noqa: E402


def breakdown(plan, metrics, cost: CostModel, tokens_MS, pairs_MS, N: int, g: int) -> dict:
    """The figures of the module docstring for one evaluated plan."""
    sc = cost.step_cost(plan, metrics, tokens_MS, pairs_MS)
    cs, cr = metrics.cross_send_MLG.double(), metrics.cross_recv_MLG.double()
    is_, ir = metrics.intra_send_MLG.double(), metrics.intra_recv_MLG.double()
    b, X, V = cost.token_bytes, cost.inter_node_bytes_per_s, cost.nvlink_bytes_per_s
    cross_t = b * torch.maximum(cs, cr) / X
    intra_t = b * torch.maximum(is_, ir) / V
    per_gpu = cross_t + intra_t
    arg = per_gpu.argmax(-1, keepdim=True)
    at = lambda t: t.gather(-1, arg).squeeze(-1)  # noqa: E731
    rows = per_gpu.shape[0] * per_gpu.shape[1]
    z = torch.zeros_like(cs)

    def a2a(*parts) -> float:
        return 4.0 * float(cost.all_to_all_s(*parts).sum())

    M, L, G = cs.shape
    cs_n, cr_n = cs.view(M, L, N, g), cr.view(M, L, N, g)
    even = lambda x: x.mean(-1, keepdim=True).expand_as(x)  # noqa: E731
    return {
        "step_s": sc.step_s,
        "attention_dense_s": sc.attention_dense_s,
        "expert_s": float(sc.expert_s_ML.sum()),
        "all_to_all_s": float(sc.all_to_all_s_ML.sum()),
        "a2a_cross_part_s": 4.0 * float(at(cross_t).sum()),
        "a2a_nvlink_part_s": 4.0 * float(at(intra_t).sum()),
        "replica_exposed_s": float(sc.replica_exposed_s_ML.sum()),
        "latency_s": float(sc.latency_s_ML.sum()) if sc.latency_s_ML is not None else 0.0,
        "migration_s": sc.migration_s,
        "binding_cross_recv_share": float((at(cr) > at(cs)).double().sum()) / rows,
        "binding_cross_over_nvlink_share": float((at(cross_t) > at(intra_t)).double().sum()) / rows,
        "cross_rows_total_per_row": float(cs.sum()) / rows,
        "node_send_rows": cs_n.sum(-1).mean((0, 1)).tolist(),
        "node_recv_rows": cr_n.sum(-1).mean((0, 1)).tolist(),
        "cross_send_gpu_max_over_mean": float((cs.amax(-1) / cs.mean(-1).clamp(min=1e-9)).mean()),
        "cross_recv_gpu_max_over_mean": float((cr.amax(-1) / cr.mean(-1).clamp(min=1e-9)).mean()),
        "node_max_over_mean_send": float((cs_n.sum(-1).amax(-1) / cs_n.sum(-1).mean(-1)).mean()),
        "node_max_over_mean_recv": float((cr_n.sum(-1).amax(-1) / cr_n.sum(-1).mean(-1)).mean()),
        "source_tokens_max_over_mean": float((tokens_MS.double().amax(-1) / tokens_MS.double().mean(-1)).mean()),
        "cross_rows_per_token": float(cs.sum() / (tokens_MS.double().sum() * L)),
        "busiest_send_over_max_tokens_x_rows_per_token": float(
            (cs.amax(-1) / (tokens_MS.double().amax(-1, keepdim=True) * cs.sum(-1)
                            / tokens_MS.double().sum(-1, keepdim=True))).mean()),
        "cross_fills_busiest_sender_per_layer": float(
            cost.replica_counts(plan, metrics)["fetch_send_cross"].amax(-1).sum(0).double().mean()),
        "if_nvlink_free_s": a2a(cs, cr, z, z),
        "if_cross_free_s": a2a(z, z, is_, ir),
        "if_send_even_in_node_s": a2a(node_even(cs, N, g), cr, is_, ir),
        "if_recv_even_in_node_s": a2a(cs, node_even(cr, N, g), is_, ir),
        "if_cross_even_in_node_s": a2a(node_even(cs, N, g), node_even(cr, N, g), is_, ir),
        "if_cross_even_cluster_s": a2a(even(cs), even(cr), is_, ir),
        "if_all_even_cluster_s": a2a(even(cs), even(cr), even(torch.maximum(is_, ir)), even(torch.maximum(is_, ir))),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_arguments(parser)
    argv = with_default(list(sys.argv[1:] if argv is None else argv), "--systems", "eplb-oracle,relibra")
    args = parser.parse_args(argv)
    s = cli.resolve(args)
    if s["cost_options"].dispatch != "hierarchical":
        raise SystemExit("hier_breakdown: hierarchical dispatch only (--dispatch hierarchical, more than one node)")
    model, topo = s["model_spec"], s["topology"]
    N, g = topo.num_nodes, topo.gpus_per_node
    workload = synthetic_workload(model, topo, s["micro_batches"], s["micro_batch_tokens"], s["steps"],
                                  s["seed"], s["sample_tokens"], s["trace"], s["skew"])
    cost = CostModel(model, s["hardware_spec"], s["cost_options"])
    rows = {}
    from relibra_torch.sim.simulator import REFERENCES
    for name in (n for n in s["systems"] if n not in REFERENCES):
        planner = default_planner_factory(name, topo, cost, s["baseline_options"])
        for x in range(workload.num_steps):
            plan = planner.plan(workload.loads_XMLSE[x])
            if x < workload.num_steps - 1:
                planner.commit(plan, workload.loads_XMLSE[x])
        loads = workload.loads_XMLSE[-1]
        tokens_MS, pairs_MS = workload.tokens_XMS[-1], workload.attn_pairs_XMS[-1]
        metrics = hierarchical_metrics(plan, evaluate(plan, loads), loads, tokens_MS, model.top_k)
        rows[name] = breakdown(plan, metrics, cost, tokens_MS, pairs_MS, N, g)
        print(f"planned {name}", file=sys.stderr)
    keys = list(next(iter(rows.values())).keys())
    w = max(len(k) for k in keys)
    print(f"{'term':<{w}}  " + "  ".join(f"{n:>22}" for n in rows))
    for k in keys:
        cells = []
        for n in rows:
            v = rows[n][k]
            cells.append(f"{' '.join(f'{x:,.0f}' for x in v):>22}" if isinstance(v, list) else f"{v:>22.3f}")
        print(f"{k:<{w}}  " + "  ".join(cells))
    out = Path(args.json or "out/hier_breakdown.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items()
                                          if isinstance(v, (str, int, float, bool, type(None)))},
                               "systems": rows}, indent=2))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
