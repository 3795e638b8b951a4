"""Write a per-token routing replay file from the synthetic trace model, for exact
hierarchical-dispatch figures (``relibra simulate FILE``: every token's remote nodes and
GPUs counted, co-activation known to the planner).

    python benchmarks/routing_file.py --samples 160 --steps 2 --out out/results/tokens.safetensors
    relibra simulate out/results/tokens.safetensors --model qwen3-30b-a3b

Samples are drawn per step with the step's drift state (``generate_routing``); the file's
``sample_step`` keeps the steps apart. ``--method gumbel`` (default) draws each token's
experts exactly from the Plackett-Luce model, so which experts co-occur in a token is the
model's; ``systematic`` is faster but spreads a token's experts more.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from relibra_torch.replay import save_routing
from relibra_torch.sim.presets import get_model
from relibra_torch.sim.traces import TraceConfig
from relibra_torch.sim.traces.tokens import generate_routing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30b-a3b", help="model preset whose shape the ids take")
    parser.add_argument("--samples", type=int, default=160, help="samples per step")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=("gumbel", "systematic"), default="gumbel")
    parser.add_argument("--out", type=Path, required=True, help="the routing file to write (.safetensors)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.steps < 1:
        parser.error("--samples and --steps must be >= 1")
    model = get_model(args.model)
    cfg = TraceConfig(num_layers=model.num_moe_layers, num_experts=model.num_experts, top_k=model.top_k,
                      seed=args.seed)
    ids, lengths, steps = [], [], []
    for x in range(args.steps):
        t0 = time.perf_counter()
        r = generate_routing(cfg, args.samples, step=x, method=args.method)
        ids.append(r.routed_experts_TLK)
        lengths.append(r.sample_length_N)
        steps.append(torch.full((r.sample_length_N.numel(),), x, dtype=torch.int64))
        print(f"step {x}: {r.routed_experts_TLK.shape[0]:,} tokens in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    lengths_N = torch.cat(lengths)
    offsets = torch.zeros(lengths_N.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths_N.cumsum(0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_routing(str(args.out), torch.cat(ids), offsets, model.num_experts, model=model.name,
                 sample_step=torch.cat(steps))
    print(f"wrote {args.out}: {int(offsets[-1]):,} tokens, {lengths_N.numel()} samples, {args.steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
