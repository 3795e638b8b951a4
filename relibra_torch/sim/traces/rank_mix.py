"""The ``rank-mix`` trace family: every source rank has its own task mix, and the mixes
drift from micro-batch to micro-batch.

In RL training each data-parallel rank draws its own prompts, so one rank's micro-batch
can be mostly maths while another's is mostly chat, and the next micro-batch differs
again. Here the log task mix of (micro-batch ``m``, rank ``s``) is the step's mixing
weights plus a component shared by all ranks of the micro-batch plus the rank's own
component, both AR(1) over consecutive micro-batches (the sequence continues across
steps). Tasks are sharper than in the default trace (each task's inclusion vector raised
to the power ``sharpen`` and rescaled), so the senders of a hot expert are a few ranks, and
static placement's mean max/mean GPU load is above 3 at the default size (Qwen3-30B-A3B,
EP 32, 32 x 8,192 tokens; ``docs/traces.md``).

Counts are drawn like :func:`.loads.generate_load_trace`'s (multinomial over ``K * tokens``
slots, every count at most ``tokens``) from the micro-batch's inclusion vector
``sum_a mix[a] * pi[a, l, e]`` times a lognormal factor per (rank, layer, expert) (the
sample-to-sample variation), capped at 0.95 and rescaled to sum ``K``. Token counts, sample
lengths and packing are those of the default generator on the same config, so the
attention term is unchanged.

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, A tasks, R rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...checks import check_number
from .config import TraceConfig, check_cfg
from .loads import SyntheticLoads, draw_counts, generate_load_trace
from .model import cap_inclusion, iter_step_states, seeded_generator, task_inclusion_ALE

# Largest inclusion probability a count row may ask for (as the default trace's cap).
_PI_CAP = 0.95

__all__ = ["RankMixConfig", "RANK_MIX", "generate_rank_mix_trace"]


@dataclass(frozen=True)
class RankMixConfig:
    """Parameters of the ``rank-mix`` family (fixed before any planner tuning).

    Attributes:
        sharpen: each task's per-layer inclusion vector ``pi[a, l]`` is replaced by
            ``pi ** sharpen`` rescaled to sum ``K`` (1: the default trace's tasks; larger:
            sharper tasks, hot experts hotter). The task model itself (calibration, drift)
            is the default trace's, so no recalibration is needed.
        shared_sigma: stationary sigma of the log task mix shared by the ranks of one
            micro-batch (what the whole micro-batch leans to).
        rank_sigma: stationary sigma of each rank's own log task mix.
        mix_correlation: AR(1) correlation of both components between consecutive
            micro-batches (0: independent each micro-batch; 1: frozen).
        noise_sigma: log sigma of the per (micro-batch, rank, layer, expert) factor on the
            inclusion probabilities (mean 1).
    """

    sharpen: float = 1.5
    shared_sigma: float = 1.5
    rank_sigma: float = 1.5
    mix_correlation: float = 0.5
    noise_sigma: float = 0.3

    def __post_init__(self) -> None:
        check_number("RankMixConfig.sharpen", self.sharpen, 0.0, strict=True, maximum=5.0)
        for name in ("shared_sigma", "rank_sigma", "noise_sigma"):
            check_number(f"RankMixConfig.{name}", getattr(self, name), 0.0, maximum=5.0)
        check_number("RankMixConfig.mix_correlation", self.mix_correlation, 0.0, maximum=1.0)


RANK_MIX = RankMixConfig()
"""The preset ``relibra simulate --trace rank-mix`` runs."""


def _ar1(prev: torch.Tensor | None, shape, rho: float, g: torch.Generator) -> torch.Tensor:
    z = torch.randn(shape, generator=g, dtype=torch.float64)
    return z if prev is None else rho * prev + math.sqrt(1.0 - rho * rho) * z


def generate_rank_mix_trace(cfg: TraceConfig, num_micro_batches: int, num_ranks: int,
                            tokens_per_micro_batch_per_rank: int, steps: int = 1,
                            params: RankMixConfig = RANK_MIX) -> SyntheticLoads:
    """Loads ``[X, M, L, S, E]`` of the rank-mix family (see the module docstring).

    Same signature and result type as :func:`.loads.generate_load_trace`; ``task_tokens_XMSA``
    holds each bin's tokens split by its task mix (rounded down), ``mix_XA`` the steps'
    base mixing weights.
    """
    check_cfg(cfg)
    if not isinstance(params, RankMixConfig):
        raise TypeError(f"params is {type(params).__name__}; allowed: a RankMixConfig")
    base = generate_load_trace(cfg, num_micro_batches, num_ranks, tokens_per_micro_batch_per_rank, steps)
    X, M, S = base.tokens_XMS.shape
    L, E, K, A = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tasks
    g = seeded_generator(cfg.seed, "rank-mix")
    rho = params.mix_correlation
    loads = torch.empty(X, M, L, S, E, dtype=torch.int64)
    task_tokens = torch.empty(X, M, S, A, dtype=torch.int64)
    shared = rank = None
    for x, state in enumerate(iter_step_states(cfg, X)):
        pi_ALE = task_inclusion_ALE(cfg, x) ** params.sharpen
        pi_ALE = pi_ALE * (K / pi_ALE.sum(-1, keepdim=True))
        log_mix_MSA = torch.empty(M, S, A, dtype=torch.float64)
        for m in range(M):
            shared = _ar1(shared, (A,), rho, g)
            rank = _ar1(rank, (S, A), rho, g)
            log_mix_MSA[m] = state.mix_A.log() + params.shared_sigma * shared + params.rank_sigma * rank
        mix_MSA = torch.softmax(log_mix_MSA, -1)
        # [M, S, A] x [A, L, E] -> [M, S, L, E], one micro-batch at a time
        for m in range(M):
            p_SLE = torch.einsum("sa,ale->sle", mix_MSA[m], pi_ALE)
            noise = torch.randn(S, L, E, generator=g, dtype=torch.float64)
            p_SLE = p_SLE * torch.exp(params.noise_sigma * noise - params.noise_sigma ** 2 / 2)
            p_RE = cap_inclusion(p_SLE.reshape(S * L, E), K, _PI_CAP)
            tok_R = base.tokens_XMS[x, m].repeat_interleave(L)
            loads[x, m] = draw_counts(p_RE, tok_R, K, g).view(S, L, E).transpose(0, 1)
        task_tokens[x] = (mix_MSA * base.tokens_XMS[x].unsqueeze(-1)).floor().to(torch.int64)
    return SyntheticLoads(loads, base.tokens_XMS, task_tokens, base.sample_length_N, base.sample_task_N,
                          base.sample_bin_N, base.mix_XA, cfg.tasks)
