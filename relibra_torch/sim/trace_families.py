"""Named families of synthetic RL traces, and per-sample expert counts for packing.

Legend: N samples, L layers, E experts, K top-k, M micro-batches, S ranks, X steps.

A family is a documented preset over :class:`relibra_torch.sim.traces.TraceConfig` (task
mix, lengths, skew) plus how its samples are cut to the micro-batch budget. ``relibra
simulate --trace NAME`` picks one; more families slot into :data:`TRACE_FAMILIES`.

* ``default``: today's trace (``TraceConfig()``; responses of 8 to 8,192 tokens, samples
  longer than the budget truncated to it).
* ``long-tail``: RL with long chain-of-thought responses: response lengths lognormal
  from 100 to 16,384 tokens (medians 3,000 / 2,200 / 1,400 / 500 for math / code /
  science / chat, log-sigma 1.0, so about 4% of math responses reach the 16K clip), the
  default task experts and skew. A sample longer than the micro-batch budget is kept whole
  in a micro-batch of its own (as a trainer must: it cannot cut a response).

:func:`generate_sample_trace` draws a family's samples per step with their per-sample
per-layer expert counts (a multinomial per sample and layer from the sample's inclusion
vector, the same per-sample model as :func:`relibra_torch.sim.traces.generate_load_trace`,
which instead draws per micro-batch) and the family's fixed packing: samples in draw order,
rank-major, a sample that does not fit closes the micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import check_choice, check_int
from .traces import TraceConfig
from .traces.config import check_cfg
from .traces.loads import DRAW_BLOCK, bin_counts, pack_sequential
from .traces.model import draw_samples, iter_step_states, sample_inclusion, sample_log_weights, seeded_generator

__all__ = ["TraceFamily", "TRACE_FAMILIES", "SampleStep", "generate_sample_trace", "family_config",
           "packed_loads"]


@dataclass(frozen=True)
class TraceFamily:
    """A named trace preset.

    Attributes:
        name: the ``--trace`` value.
        description: one line for help texts.
        overrides: ``TraceConfig`` fields that differ from the default trace.
        truncate: samples longer than the micro-batch budget are cut to it (``default``:
            today's generator) instead of getting a micro-batch of their own.
    """

    name: str
    description: str
    overrides: dict = field(default_factory=dict)
    truncate: bool = False


TRACE_FAMILIES: dict[str, TraceFamily] = {
    "default": TraceFamily(
        "default", "mixed math/code/science/chat, responses 8-8,192 tokens (docs/traces.md)",
        truncate=True),
    "long-tail": TraceFamily(
        "long-tail", "long chain-of-thought RL: responses ~100-16,384 tokens, long tail",
        overrides={"response_len_median": (3000.0, 2200.0, 1400.0, 500.0),
                   "response_len_sigma": (1.0, 1.0, 1.0, 1.0),
                   "min_response_len": 100, "max_response_len": 16384}),
}


def family_config(name: str, **fields) -> TraceConfig:
    """The ``TraceConfig`` of family ``name`` with ``fields`` (shape, seed) set."""
    fam = TRACE_FAMILIES[check_choice("trace", name, tuple(TRACE_FAMILIES))]
    return TraceConfig(**{**fam.overrides, **fields})


@dataclass
class SampleStep:
    """One step's samples.

    Attributes:
        lengths_N: int64 ``[N]`` tokens (prompt + response; truncated to the budget when
            the family truncates).
        task_N: int64 ``[N]`` task index.
        counts_NLE: int16 ``[N, L, E]`` token-expert pairs per sample, layer and expert
            (every ``(n, l)`` row sums to ``K * lengths_N[n]``, no count above the length).
        rank_N / micro_batch_N: int64 ``[N]``: the family's fixed packing.
    """

    lengths_N: torch.Tensor
    task_N: torch.Tensor
    counts_NLE: torch.Tensor
    rank_N: torch.Tensor
    micro_batch_N: torch.Tensor


def generate_sample_trace(cfg: TraceConfig, num_micro_batches: int, num_ranks: int,
                          tokens_per_micro_batch_per_rank: int, steps: int = 1,
                          truncate: bool = False) -> list[SampleStep]:
    """Per-step samples with per-sample expert counts and the fixed packing.

    Per step ``x``, samples are drawn (task, prompt and response lengths) and packed
    rank-major into ``num_ranks * num_micro_batches`` micro-batches of at most
    ``tokens_per_micro_batch_per_rank`` tokens: a sample that does not fit closes the
    micro-batch, a sample longer than the budget fills one alone (``truncate=True``: it is
    cut to the budget). Counts: per sample and layer, ``K * length`` slots from the sample's
    Rosen inclusion vector (:mod:`relibra_torch.sim.traces`), each count at most the length.

    Deterministic in ``cfg`` (seed included) and the arguments; streams are separate from
    :func:`~relibra_torch.sim.traces.generate_load_trace`'s.
    """
    check_cfg(cfg)
    M = check_int("num_micro_batches", num_micro_batches, 1)
    S = check_int("num_ranks", num_ranks, 1)
    budget = check_int("tokens_per_micro_batch_per_rank", tokens_per_micro_batch_per_rank, 1)
    X = check_int("steps", steps, 1)
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    if cfg.max_prompt_len + cfg.max_response_len > 32767:
        raise ValueError("max_prompt_len + max_response_len must stay <= 32767 (counts are int16)")
    G = cfg.group_size
    B = M * S
    block = max(G, (DRAW_BLOCK // G) * G)
    out = []
    for x, state in enumerate(iter_step_states(cfg, X)):
        g_samples = seeded_generator(cfg.seed, "packing-samples", x)
        parts_t, parts_n, parts_b = [], [], []
        b, fill = 0, 0
        while b < B:
            task_N, prompt_N, response_N = draw_samples(cfg, state.mix_A, block, g_samples)
            length_N = prompt_N + response_N
            if truncate:
                length_N = length_N.clamp(max=budget)
            bins, b, fill = pack_sequential(length_N.tolist(), budget, B, b, fill)
            used = len(bins)
            if G > 1 and b >= B:
                used = -(-used // G) * G
            parts_t.append(task_N[:used])
            parts_n.append(length_N[:used])
            parts_b.append(torch.tensor(bins + [-1] * (used - len(bins)), dtype=torch.int64))
        task_N, length_N, bin_N = torch.cat(parts_t), torch.cat(parts_n), torch.cat(parts_b)
        g_noise = seeded_generator(cfg.seed, "packing-noise", x)
        g_counts = seeded_generator(cfg.seed, "packing-counts", x)
        tau_AL = state.tau_AL.to(torch.float32)
        counts = torch.empty(task_N.numel(), L, E, dtype=torch.int16)
        start = 0
        for log_w in sample_log_weights(cfg, state, task_N, g_noise):
            n = log_w.shape[0]
            pi = sample_inclusion(log_w.exp_(), K, tau_AL[task_N[start:start + n]])
            tok = length_N[start:start + n].repeat_interleave(L)
            counts[start:start + n] = bin_counts(pi.view(n * L, E), tok, K, g_counts).view(n, L, E)
            start += n
        keep = bin_N >= 0  # group members drawn but not packed are dropped
        bin_N = bin_N[keep]
        out.append(SampleStep(length_N[keep], task_N[keep], counts[keep],
                              torch.div(bin_N, M, rounding_mode="floor"), bin_N % M))
    return out


def packed_loads(step: SampleStep, rank_N: torch.Tensor, micro_batch_N: torch.Tensor,
                 num_micro_batches: int, num_ranks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loads_MLSE int64, tokens_MS int64, pairs_MS float64)`` of ``step`` under a packing."""
    M, S = num_micro_batches, num_ranks
    L, E = step.counts_NLE.shape[1:]
    flat = micro_batch_N * S + rank_N
    loads = torch.zeros(M * S, L, E, dtype=torch.int64).index_add_(0, flat, step.counts_NLE.to(torch.int64))
    n = step.lengths_N.to(torch.int64)
    tokens = torch.zeros(M * S, dtype=torch.int64).index_add_(0, flat, n).view(M, S)
    pairs = torch.zeros(M * S, dtype=torch.int64).index_add_(0, flat, n * (n + 1) // 2).view(M, S)
    return loads.view(M, S, L, E).permute(0, 2, 1, 3).contiguous(), tokens, pairs.to(torch.float64)

