"""Real-shaped stand-in loads files (counts only) for relibra's planner tests and measurements.

Issue 22 is checked on hidden loads files of real routing: 8 to 256 experts, top-1, top-2
or top-8, 16-64 tokens per GPU per micro-batch, some with a collapsed router (one expert
takes about 95% of a layer's tokens), and the same counts multiplied by integer factors up
to about 64 (which keeps the small-batch skew, so it overstates imbalance). This writes
loads of that kind: per layer a Zipf popularity over a random permutation of the experts
(``--zipf``; 0 = uniform), per micro-batch a Dirichlet-like jitter of it (small batches
drift), each token choosing ``top_k`` distinct experts; with ``--collapse p`` a layer's
first choice is its hot expert with probability ``p``.

    python benchmarks/standin_loads.py out.safetensors --experts 64 --top-k 2 --tokens 32 --factor 16

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, T tokens, K top-k.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def standin_loads(num_experts: int, top_k: int, num_layers: int, micro_batches: int, num_ranks: int,
                  tokens_per_rank: int, *, steps: int = 2, zipf: float = 1.0, collapse: float = 0.0,
                  factor: int = 1, seed: int = 0) -> torch.Tensor:
    """int64 ``[X, M, L, S, E]`` counts (token-expert pairs), multiplied by ``factor``.

    ``collapse``: chance that a token's first expert is its layer's hot expert (0.95 gives
    the collapsed routers of real decoder traces).
    """
    # the drift's gamma draws come from torch's global generator (Gamma takes no generator):
    # seed it too, and leave the caller's state as it was, so the loads depend on the seed only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return _standin_loads(num_experts, top_k, num_layers, micro_batches, num_ranks, tokens_per_rank,
                              steps, zipf, collapse, factor, seed)


def _standin_loads(num_experts: int, top_k: int, num_layers: int, micro_batches: int, num_ranks: int,
                   tokens_per_rank: int, steps: int, zipf: float, collapse: float, factor: int,
                   seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    E, K, L, T = num_experts, top_k, num_layers, tokens_per_rank
    ranks = torch.arange(1, E + 1, dtype=torch.float64)
    base_LE = torch.stack([(ranks ** -zipf)[torch.randperm(E, generator=gen)] for _ in range(L)])
    hot_L = base_LE.argmax(1)
    out = torch.zeros(steps, micro_batches, L, num_ranks, E, dtype=torch.int64)
    for x in range(steps):
        for m in range(micro_batches):
            # per micro-batch drift of the popularity (gamma noise, shape 20: +-22%)
            w_LE = base_LE * torch.distributions.Gamma(20.0, 20.0).sample((L, E)).to(torch.float64)
            w = w_LE.unsqueeze(1).expand(L, num_ranks * T, E).reshape(-1, E)
            ids = torch.multinomial(w, K, replacement=False, generator=gen).view(L, num_ranks, T, K)
            if collapse > 0:
                hot = torch.rand(L, num_ranks, T, generator=gen) < collapse
                first = torch.where(hot, hot_L.view(L, 1, 1).expand(L, num_ranks, T), ids[..., 0])
                # keep the token's experts distinct: the hot expert displaced from a later pick
                # takes the first pick's old expert
                swap = (ids[..., 1:] == first.unsqueeze(-1)) & hot.unsqueeze(-1)
                rest = torch.where(swap, ids[..., :1].expand_as(ids[..., 1:]), ids[..., 1:])
                ids = torch.cat([first.unsqueeze(-1), rest], -1)
            counts = torch.zeros(L, num_ranks, E, dtype=torch.int64)
            counts.scatter_add_(2, ids.reshape(L, num_ranks, T * K), torch.ones(L, num_ranks, T * K, dtype=torch.int64))
            out[x, m] = counts
    return out * factor


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--ranks", type=int, default=32)
    p.add_argument("--tokens", type=int, default=32, help="tokens per GPU per micro-batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--collapse", type=float, default=0.0)
    p.add_argument("--factor", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from relibra_torch.replay.loads import save_loads
    loads = standin_loads(a.experts, a.top_k, a.layers, a.micro_batches, a.ranks, a.tokens, steps=a.steps,
                          zipf=a.zipf, collapse=a.collapse, factor=a.factor, seed=a.seed)
    save_loads(a.out, loads, a.top_k)
    print(f"wrote {a.out}: {tuple(loads.shape)} [X, M, L, S, E], top-{a.top_k}")


if __name__ == "__main__":
    main()
