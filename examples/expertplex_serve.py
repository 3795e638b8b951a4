"""ExpertPlex on CPU: a stream of the Azure conversation trace served by the tiny MoE LM.

Attention is disaggregated by phase (one prefill-attention and one decode-attention rank),
and the experts run on expert ranks that the attention ranks write into and read from
(``relibra_torch.serving.runtime``). The same stream is served twice:

* ``shared``: ONE expert rank serves both phases (ExpertPlex): its loop checks between tiles
  and runs decode tiles first, so a decode waits for at most one prefill tile;
* ``separate``: each phase has its own expert rank, a full copy of the experts (what
  instance-level prefill/decode disaggregation does): no interference, twice the weights.

The trace (``../shared/data/azure-llm-inference-2023-conv.csv``, Azure LLM inference traces
2023, CC-BY 4.0) is scaled down: the first ``--requests`` requests, inter-arrival times
divided by ``--speedup``, prompt lengths ``ceil(context / 256)`` clipped to 2..12 and output
lengths ``ceil(generated / 32)`` clipped to 1..(24 - prompt) (the tiny LM's 24 positions),
tokens drawn at random and fed teacher-forced. Each tile of the expert loop takes at least
``--tile-ms`` (an emulated GPU tile time: on a CPU the tiny experts are far faster than the
loop around them). It prints TTFT (arrival -> prompt prefilled) and TPOT (time between a
request's decode tokens) per phase, percentiles over the requests, for both setups.

    python examples/expertplex_serve.py [--requests 32] [--speedup 4] [--tile-ms 1]

Runs in about a minute or two on 2 CPU cores (most of it starting the 4 processes).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import random
import sys
import time
from datetime import datetime

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tiny_lm  # noqa: E402

from relibra_torch.serving.runtime.attention import ExpertClient, split_attention  # noqa: E402
from relibra_torch.serving.runtime.driver import Request, run_decode, run_prefill_online  # noqa: E402
from relibra_torch.serving.runtime.expert import ExpertServer, ExpertWeights  # noqa: E402
from relibra_torch.serving.runtime.kv import KVHandoff  # noqa: E402
from relibra_torch.serving.runtime.mesh import DECODE, PREFILL, ServingMesh  # noqa: E402
from relibra_torch.serving.runtime.transport import FINISHED, Backoff, ShmTransport  # noqa: E402
from relibra_torch.testing import RankPool  # noqa: E402

TRACE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "data",
                     "azure-llm-inference-2023-conv.csv")
CFG = tiny_lm.TinyLMConfig()
BACKOFF = Backoff(initial_s=50e-6, max_s=1e-3)


def load_requests(path: str, n: int, speedup: float, seed: int) -> list[Request]:
    """The first ``n`` requests of the trace, scaled down to the tiny LM (see the docstring)."""
    rng = random.Random(seed)
    out, first = [], None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            t = datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp()
            first = t if first is None else first
            p = min(12, max(2, math.ceil(int(row["ContextTokens"]) / 256)))
            c = min(CFG.max_len - p, max(1, math.ceil(int(row["GeneratedTokens"]) / 32)))
            out.append(Request(len(out), tuple(rng.randrange(CFG.vocab_size) for _ in range(p)),
                               tuple(rng.randrange(CFG.vocab_size) for _ in range(c)), (t - first) / speedup))
            if len(out) == n:
                break
    if not out:
        raise ValueError(f"{path} has no requests; allowed: the Azure trace CSV (TIMESTAMP, ContextTokens, "
                         f"GeneratedTokens)")
    return out


def make_model() -> tiny_lm.TinyMoELM:
    torch.manual_seed(0)
    return tiny_lm.TinyMoELM(CFG).eval()


def rank_main(setup: str, mesh: ServingMesh, transports: list, kv: KVHandoff, requests: list[Request],
              t0: float, tile_s: float) -> tuple[str, dict]:
    """Rank 0 prefill, rank 1 decode, ranks 2 (and 3 in ``separate``) expert ranks."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    # shared: every role on transport 0; separate: prefill + expert rank 2 on 0, decode + 3 on 1
    mine = 1 if setup == "separate" and rank in (1, 3) else 0
    if rank >= 2:
        if setup == "shared" and rank == 3:
            return "idle", {}
        server = ExpertServer(mesh, transports[mine].expert(0), ExpertWeights.from_model(make_model(), mesh, 0),
                              tile_m=4, min_tile_s=tile_s, backoff=BACKOFF)
        stats = server.serve(max_seconds=300)
        return "expert", stats
    phase = PREFILL if rank == 0 else DECODE
    client = ExpertClient(mesh, transports[mine], phase, 0, timeout_s=120, backoff=BACKOFF)
    model = split_attention(make_model(), client)
    try:
        if phase == PREFILL:
            log = run_prefill_online(model, kv, requests, max_tokens=48, t0=t0)
        else:
            log = run_decode(model, kv, requests, t0=t0, backoff=BACKOFF, keep_logits=False)
    finally:
        client.finish()
    waits = [d[PREFILL] - r[PREFILL] for _, _, r, d in client.events if d]
    return ("prefill" if phase == PREFILL else "decode"), {"times": log.times, "steps": len(log.steps),
                                                            "max_prefill_tiles_waited": max(waits, default=0)}


def _noop() -> None:
    return None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def serve(pool: RankPool, setup: str, requests: list[Request], tile_s: float) -> dict:
    mesh = ServingMesh(prefill_ranks=1, decode_ranks=1, expert_ranks=1, num_experts=CFG.num_experts,
                       num_layers=CFG.n_layers, dim=CFG.dim, hidden_dim=CFG.hidden_dim,
                       decode_capacity=2 * len(requests) * CFG.top_k, prefill_capacity=48 * CFG.top_k)
    transports = [ShmTransport(mesh), ShmTransport(mesh)]
    if setup == "separate":  # each copy serves one phase: the other phase's mailbox is done from the start
        transports[0].expert(0).set_flag(mesh.mailbox(DECODE, 0), FINISHED, 1)
        transports[1].expert(0).set_flag(mesh.mailbox(PREFILL, 0), FINISHED, 1)
    kv = KVHandoff(len(requests), CFG.n_layers, CFG.max_len, CFG.n_heads, CFG.dim // CFG.n_heads)
    t0 = time.monotonic() + 0.5  # every rank is up already: the stream starts in half a second
    results = pool.run(rank_main, setup, mesh, transports, kv, requests, t0, tile_s)
    out = {role: r for role, r in results if role != "idle"}
    experts = [r for role, r in results if role == "expert"]
    prefill, decode = out["prefill"], out["decode"]
    ttft = [prefill["times"][r.rid][0] - r.arrival for r in requests]
    tpot = []
    for r in requests:
        ts = decode["times"].get(r.rid, [])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
    w = ExpertWeights.from_model(make_model(), mesh, 0)
    copy_bytes = sum(t.numel() * t.element_size() for t in (w.w1_GFD, w.w2_GDF, w.w3_GFD))
    return {"ttft": ttft, "tpot": tpot, "tiles": [e["tiles"] for e in experts],
            "errors": [x for e in experts for x in e["errors"]], "expert_bytes": copy_bytes * len(experts),
            "decode_steps": decode["steps"], "max_prefill_tiles_waited": decode["max_prefill_tiles_waited"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=TRACE, help="Azure LLM inference trace CSV (default: ../shared/data)")
    p.add_argument("--requests", type=int, default=32, help="first N requests of the trace (default 32)")
    p.add_argument("--speedup", type=float, default=4.0, help="divide inter-arrival times by this (default 4)")
    p.add_argument("--tile-ms", type=float, default=1.0, help="emulated time of one expert tile (default 1 ms)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    requests = load_requests(args.trace, args.requests, args.speedup, args.seed)
    span = requests[-1].arrival
    print(f"{len(requests)} requests over {span:.2f} s (trace / {args.speedup:g}); prompts "
          f"{min(len(r.prompt) for r in requests)}-{max(len(r.prompt) for r in requests)} tokens, outputs "
          f"{min(len(r.continuation) for r in requests)}-{max(len(r.continuation) for r in requests)}; "
          f"tile time {args.tile_ms:g} ms", flush=True)
    rows = []
    with RankPool(4, timeout_s=600) as pool:
        pool.run(_noop)  # start the processes before the clock starts
        for setup in ("shared", "separate"):
            r = serve(pool, setup, requests, args.tile_ms / 1e3)
            if r["errors"]:
                raise RuntimeError(f"{setup}: expert errors: {r['errors']}")
            rows.append((setup, r))
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="ExpertPlex on CPU: the tiny LM serving the Azure conversation trace")
        for col in ("setup", "expert ranks (KiB)", "TTFT p50 / p90 ms", "TPOT p50 / p90 ms", "tiles dec / pre",
                    "max prefill tiles a decode waited"):
            table.add_column(col, justify="right")
        for setup, r in rows:
            tiles = [sum(t[0] for t in r["tiles"]), sum(t[1] for t in r["tiles"])]
            table.add_row(setup, f"{len(r['tiles'])} ({r['expert_bytes'] / 1024:.0f})",
                          f"{1e3 * pct(r['ttft'], 50):.1f} / {1e3 * pct(r['ttft'], 90):.1f}",
                          f"{1e3 * pct(r['tpot'], 50):.1f} / {1e3 * pct(r['tpot'], 90):.1f}",
                          f"{tiles[0]} / {tiles[1]}", str(r["max_prefill_tiles_waited"]))
        Console(width=120).print(table)
    except ImportError:  # rich is a dependency; plain lines if it is missing anyway
        for setup, r in rows:
            print(setup, {k: r[k] for k in ("ttft", "tpot")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
