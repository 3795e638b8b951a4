"""The ``collapsed`` trace family: in some layers a few experts are each chosen by most
tokens, and which ones changes every micro-batch.

Routers sometimes collapse: in a real Switch-Transformer decoder trace one expert takes
95% of a layer's tokens (top-1). When such an expert sits on one node, that node holds more
than its share of the layer's pairs even if its GPUs split its load perfectly, so
replicas kept inside a node cannot reach the global mean (the node lower bound exceeds
it). Here, on top of the default trace (same samples, packing and counts elsewhere), every
``layer_every``-th layer (``l % layer_every == layer_every - 1``) collapses: per
(step, micro-batch, layer) ``num_hot`` experts are drawn uniformly without replacement,
the same for every rank (the router collapses for the whole batch), and each is chosen
with probability ``hot_inclusion`` per token; the other experts share the remaining
``K - num_hot * hot_inclusion`` in proportion to the default trace's counts of that
(micro-batch, rank, layer) (plus 0.5, so no expert is impossible). Counts are drawn like the
default generator's (multinomial over ``K * tokens`` slots, each count at most ``tokens``).

For a top-1 model ``num_hot`` is capped at ``K`` and ``hot_inclusion`` at ``0.95 * K /
num_hot``, which gives the extreme case above: one expert chosen by 95% of the tokens.

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, R rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_int, check_number
from .config import TraceConfig, check_cfg
from .loads import SyntheticLoads, draw_counts, generate_load_trace
from .model import seeded_generator

__all__ = ["CollapsedConfig", "COLLAPSED", "generate_collapsed_trace", "collapsed_layers"]


@dataclass(frozen=True)
class CollapsedConfig:
    """Parameters of the ``collapsed`` family (fixed before any planner tuning).

    Attributes:
        layer_every: layer ``l`` collapses when ``l % layer_every == layer_every - 1``
            (48 layers, 4: 12 collapsed layers).
        num_hot: experts that collapse per (micro-batch, layer).
        hot_inclusion: share of tokens that choose each of them.
    """

    layer_every: int = 4
    num_hot: int = 2
    hot_inclusion: float = 0.9

    def __post_init__(self) -> None:
        check_int("CollapsedConfig.layer_every", self.layer_every, 1)
        check_int("CollapsedConfig.num_hot", self.num_hot, 1)
        check_number("CollapsedConfig.hot_inclusion", self.hot_inclusion, 0.0, strict=True, maximum=0.95)


COLLAPSED = CollapsedConfig()
"""The preset ``relibra simulate --trace collapsed`` runs."""


def collapsed_layers(num_layers: int, params: CollapsedConfig = COLLAPSED) -> list[int]:
    """The layers that collapse."""
    return [l for l in range(num_layers) if l % params.layer_every == params.layer_every - 1]


def generate_collapsed_trace(cfg: TraceConfig, num_micro_batches: int, num_ranks: int,
                             tokens_per_micro_batch_per_rank: int, steps: int = 1,
                             params: CollapsedConfig = COLLAPSED) -> SyntheticLoads:
    """Loads ``[X, M, L, S, E]`` of the collapsed family (see the module docstring).

    Same signature and result type as :func:`.loads.generate_load_trace`; only the collapsed
    layers' counts differ from it.
    """
    check_cfg(cfg)
    if not isinstance(params, CollapsedConfig):
        raise TypeError(f"params is {type(params).__name__}; allowed: a CollapsedConfig")
    base = generate_load_trace(cfg, num_micro_batches, num_ranks, tokens_per_micro_batch_per_rank, steps)
    layers = collapsed_layers(cfg.num_layers, params)
    if not layers:
        return base
    X, M, S = base.tokens_XMS.shape
    E, K = cfg.num_experts, cfg.top_k
    H = min(params.num_hot, K)
    incl = min(params.hot_inclusion, 0.95 * K / H)
    g = seeded_generator(cfg.seed, "collapsed")
    loads = base.loads_XMLSE.clone()
    C = len(layers)
    for x in range(X):
        # hot experts per (micro-batch, collapsed layer): uniform, without replacement
        hot_MCH = torch.rand(M, C, E, generator=g).argsort(-1)[..., :H]
        hot_MCE = torch.zeros(M, C, E, dtype=torch.bool).scatter_(-1, hot_MCH, True)
        rest_MCSE = loads[x][:, layers].to(torch.float64) + 0.5  # [M, C, S, E]
        hot = hot_MCE.unsqueeze(2)
        rest_MCSE = rest_MCSE.masked_fill(hot, 0.0)
        p = rest_MCSE * ((K - H * incl) / rest_MCSE.sum(-1, keepdim=True))
        p = p.masked_fill(hot, incl)
        tok_R = base.tokens_XMS[x].view(M, 1, S).expand(M, C, S).reshape(-1)
        counts = draw_counts(p.reshape(-1, E), tok_R, K, g).view(M, C, S, E)
        loads[x][:, layers] = counts
    return SyntheticLoads(loads, base.tokens_XMS, base.task_tokens_XMSA, base.sample_length_N,
                          base.sample_task_N, base.sample_bin_N, base.mix_XA, base.tasks)
