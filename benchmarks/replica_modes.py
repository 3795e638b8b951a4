"""Replica modes: keep replica weights alive for backward, or re-fetch them in backward.

Runs a stack of ``ReplayBalancedMoE`` layers with relibra plans on gloo CPU ranks (2 nodes
x G/2 GPUs when G > 2 is even), forward + backward, in both modes on the same weights,
plans and tokens, and reports the median wall seconds and the peak replica-buffer bytes per
rank of each mode, with their ratio. Modes alternate per iteration so machine load hits
both alike. Not a timed test; the figures quoted in docs/moe.md come from here.

    python benchmarks/replica_modes.py [--ranks 4] [--layers 4] [--dim 256] [--hidden 512] \\
        [--tokens 256] [--iters 6] [--json out/replica_modes.json]

Legend: T tokens per rank, D model dim, F expert hidden dim, E experts, K top-k, L layers,
S source ranks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

# The script runs from anywhere: make the repository (and this folder, for the ranks) importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def skewed_ids(tokens: int, ranks: int, num_experts: int, top_k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Per-rank int64 ``[T, K]`` distinct expert ids with Zipf-like (exponent 1.5) popularity."""
    w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** 1.5
    w = w[torch.randperm(num_experts, generator=gen)]
    return [torch.multinomial(w.expand(tokens, -1), top_k, replacement=False, generator=gen)
            for _ in range(ranks)]


def bench_replica_modes(layers: int, dim: int, hidden: int, tokens: int, iters: int, seed: int = 0) -> dict:
    """One rank's side: median fwd+bwd seconds and peak replica bytes for keep and re-fetch."""
    from torch.distributed.device_mesh import init_device_mesh

    from relibra_torch.moe import ReplayBalancedMoE, layer_plans, share_replica_memory
    from relibra_torch.planning import Topology, make_planner

    r, G = dist.get_rank(), dist.get_world_size()
    N = 2 if G % 2 == 0 and G > 2 else 1
    gen = torch.Generator().manual_seed(seed)
    E, K = 2 * G, 2
    topo = Topology(N, G // N, E, 2)
    ids_LS = [skewed_ids(tokens, G, E, K, gen) for _ in range(layers)]
    loads_MLSE = torch.stack([torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids_S])
                              for ids_S in ids_LS]).unsqueeze(0)
    plan = make_planner("relibra", topo).plan(loads_MLSE)
    lps = layer_plans(plan, loads_MLSE, 0)
    mesh = init_device_mesh("cpu", (N, G // N), mesh_dim_names=("node", "gpu"))
    models = {}
    for refetch in (False, True):
        torch.manual_seed(seed)  # the same weights in both modes
        mods = torch.nn.ModuleList()
        for l in range(layers):
            m = ReplayBalancedMoE(dim, hidden, E, K, mesh=mesh, replica_slots=2, refetch_replicas=refetch)
            m.apply_placement(plan.placement_LE[l])
            m.set_plan(lps[l])
            mods.append(m)
        models[refetch] = (mods, share_replica_memory(mods))
    x = torch.randn(tokens, dim, generator=gen)
    g = torch.randn(tokens, dim, generator=gen)
    times = {False: [], True: []}
    for it in range(iters + 1):
        for refetch in ((False, True) if it % 2 else (True, False)):
            mods, mem = models[refetch]
            dist.barrier()
            t0 = time.perf_counter()
            h = x.clone().requires_grad_()
            for m, ids_S in zip(mods, ids_LS):
                h = h + m(h, ids_S[r])
            h.backward(g)
            dist.barrier()
            if it:  # the first round warms up
                times[refetch].append(time.perf_counter() - t0)
    fills = sum(len(m.last_fills) for m in models[False][0])
    return {"keep_s": statistics.median(times[False]), "refetch_s": statistics.median(times[True]),
            "keep_peak": models[False][1].peak_bytes, "refetch_peak": models[True][1].peak_bytes,
            "fills": fills, "fill_bytes": fills * 3 * dim * hidden * 4}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import replica_modes  # this file as a module, so that spawned ranks can import the function

    from relibra_torch.testing import RankPool
    with RankPool(a.ranks, timeout_s=1800) as pool:
        res = pool.run(replica_modes.bench_replica_modes, a.layers, a.dim, a.hidden, a.tokens, a.iters)
    keep = max(x["keep_s"] for x in res)
    refetch = max(x["refetch_s"] for x in res)
    print(f"{a.ranks} gloo ranks, {a.layers} layers, D {a.dim}, F {a.hidden}, {a.tokens} tokens/rank, "
          f"R 2, relibra plans, fp32, median of {a.iters} fwd+bwd (slowest rank)")
    print(f"{'mode':<8} {'seconds':>9} {'vs keep':>8} {'peak replica MB/rank (max)':>28}")
    print(f"{'keep':<8} {keep:9.3f} {1.0:8.2f} {max(x['keep_peak'] for x in res) / 1e6:28.2f}")
    print(f"{'refetch':<8} {refetch:9.3f} {refetch / keep:8.2f} {max(x['refetch_peak'] for x in res) / 1e6:28.2f}")
    print(f"fills per rank: {[x['fills'] for x in res]}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "ranks": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
