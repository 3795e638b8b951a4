"""Stand-in loads whose hot experts move between micro-batches, shaped from real domain counts.

``standin_loads.py`` fixes each layer's expert popularity for the whole run (only a +-22%
jitter per micro-batch), so the skew a planner sees in one micro-batch is the skew of the
step's totals. Real RL batches mix tasks: each rank's micro-batch holds a few samples of
one task, and the hot experts differ almost completely between text domains (OLMoE: top-8
Jaccard between domains about 0.16, ../shared/data/README.md). This generator draws, per
(step, micro-batch, source rank), one domain, and routes that rank's tokens by the domain's
real per-expert counts (``olmoe-domain-expert-counts.json``: OLMoE-1B-7B, 64 experts top-8,
and Mixtral-8x7B, 8 experts top-2, layers 0, 7 and 15; layer ``l`` of the stand-in uses real
layer ``l % 3``), with the same per-micro-batch jitter and top-k sampling as
``standin_loads.py``, multiplied by ``factor``.

    python benchmarks/standin_domains.py out.safetensors --model olmoe --tokens 32 --factor 16

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, D domains, T tokens, K top-k.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

MODELS = {"olmoe": ("olmoe", 8), "mixtral": ("mistral", 2)}  # our name -> the file's, and its top-k


def domain_popularity(model: str) -> tuple[torch.Tensor, int]:
    """float64 ``[D, 3, E]`` per-domain, per-layer expert counts (every top-k choice), and K.

    Read by :func:`relibra_torch.sim.data_refs.olmoe_domain_counts` (``../shared/data``, or
    ``$RELIBRA_SHARED_DATA``)."""
    from relibra_torch.sim.data_refs import olmoe_domain_counts
    name, K = MODELS[model]
    _, counts = olmoe_domain_counts(name)
    return torch.stack([counts[d] for d in sorted(counts)]).to(torch.float64), K


def domain_loads(model: str, num_layers: int, micro_batches: int, num_ranks: int, tokens_per_rank: int, *,
                 steps: int = 2, factor: int = 1, seed: int = 0) -> torch.Tensor:
    """int64 ``[X, M, L, S, E]`` counts: one domain per (step, micro-batch, rank), x ``factor``."""
    gen = torch.Generator().manual_seed(seed)
    pop_D3E, K = domain_popularity(model)
    D, _, E = pop_D3E.shape
    T = tokens_per_rank
    w_DLE = pop_D3E[:, torch.arange(num_layers) % 3]          # layer l uses real layer l % 3
    w_DLE = w_DLE / w_DLE.sum(-1, keepdim=True)
    out = torch.zeros(steps, micro_batches, num_layers, num_ranks, E, dtype=torch.int64)
    for x in range(steps):
        for m in range(micro_batches):
            dom_S = torch.randint(D, (num_ranks,), generator=gen)
            # per micro-batch drift (gamma, shape 20, as standin_loads), drawn from the seeded stream
            jitter_LE = torch._standard_gamma(torch.full((num_layers, E), 20.0, dtype=torch.float64),
                                              generator=gen) / 20.0
            w_LSE = w_DLE[dom_S].transpose(0, 1) * jitter_LE.unsqueeze(1)
            w = w_LSE.unsqueeze(2).expand(num_layers, num_ranks, T, E).reshape(-1, E)
            ids = torch.multinomial(w, K, replacement=False, generator=gen).view(num_layers, num_ranks, T * K)
            counts = torch.zeros(num_layers, num_ranks, E, dtype=torch.int64)
            counts.scatter_add_(2, ids, torch.ones_like(ids))
            out[x, m] = counts
    return out * factor


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--model", choices=list(MODELS), default="olmoe")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32, help="tokens per GPU per micro-batch")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--factor", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    from relibra_torch.replay.loads import save_loads
    loads = domain_loads(a.model, a.layers, a.micro_batches, a.ranks, a.tokens, steps=a.steps, factor=a.factor,
                         seed=a.seed)
    K = domain_popularity(a.model)[1]
    save_loads(a.out, loads, K)
    print(f"wrote {a.out}: {tuple(loads.shape)} [X, M, L, S, E], top-{K}")


if __name__ == "__main__":
    main()
