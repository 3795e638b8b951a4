"""Count generator: per (step, micro-batch, layer, source rank, expert) token counts of
synthetic samples packed into ranks and micro-batches, without token ids.

A documented fast approximation of counting :func:`.tokens.generate_routing`'s ids (see
docs/traces.md): per packed bin and layer, counts are drawn from the summed per-sample
inclusion probabilities.

Legend: X steps, M micro-batches, L layers, S source ranks, E experts, K top-k,
N samples (n: a chunk of them), A tasks, B packed bins (one rank's micro-batch of a step),
R rows (any flattened leading dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_int
from .config import TraceConfig, check_cfg
from .model import draw_samples, iter_step_states, sample_inclusion, sample_log_weights, seeded_generator

__all__ = ["SyntheticLoads", "draw_counts", "generate_load_trace", "generate_loads", "max_over_mean"]

# Samples drawn per block while packing micro-batches (a multiple of group_size is used).
DRAW_BLOCK = 4096
# Rows (bin x layer) per block of the count draw: bounds the float64 temporaries.
_COUNT_ROWS = 8192


# --------------------------------------------------------------------------------------
# per micro-batch loads


@dataclass
class SyntheticLoads:
    """Token counts of synthetic samples packed into ranks and micro-batches.

    Attributes:
        loads_XMLSE: int64 ``[X, M, L, S, E]``: tokens of (step, micro-batch, source rank)
            routed to expert ``e`` in layer ``l``. ``loads_XMLSE[x]`` is the planner's
            ``loads_MLSE`` of step ``x``.
        tokens_XMS: int64 ``[X, M, S]``: tokens in each packed micro-batch (every
            ``loads_XMLSE[x, m, l, s]`` row sums to ``top_k * tokens_XMS[x, m, s]``).
        task_tokens_XMSA: int64 ``[X, M, S, A]``: those tokens per task.
        sample_length_N / sample_task_N: int64 ``[N]``, every packed sample (all steps).
        sample_bin_N: int64 ``[N]``: flat index ``(x * M + m) * S + s`` of its micro-batch.
        mix_XA: float64 ``[X, A]``: task mixing weights of each step (they drift).
        tasks: task names.
    """

    loads_XMLSE: torch.Tensor
    tokens_XMS: torch.Tensor
    task_tokens_XMSA: torch.Tensor
    sample_length_N: torch.Tensor
    sample_task_N: torch.Tensor
    sample_bin_N: torch.Tensor
    mix_XA: torch.Tensor
    tasks: tuple[str, ...]


def pack_sequential(lengths: list[int], budget: int, num_bins: int, start_bin: int,
          start_fill: int) -> tuple[list[int], int, int]:
    """Sequential packing: a sample that does not fit closes the current bin.

    Returns the bin of each consumed sample, and the (bin, fill) to continue from. Stops
    when every bin is closed; samples after that are not consumed.
    """
    bins: list[int] = []
    b, fill = start_bin, start_fill
    for n in lengths:
        if b >= num_bins:
            break
        if fill > 0 and fill + n > budget:
            b += 1
            fill = 0
            if b >= num_bins:
                break
        bins.append(b)
        fill += n
    return bins, b, fill


def bin_counts(p_RE: torch.Tensor, tokens_R: torch.Tensor, K: int,
                g: torch.Generator) -> torch.Tensor:
    """Counts ``[R, E]`` of ``K * tokens`` expert slots with per-slot probabilities ``p / K``.

    A multinomial drawn as a chain of conditional binomials, each clamped to
    ``[max(0, left - tokens * experts_after), min(tokens, left)]``, so every count is at most
    ``tokens`` (a token picks an expert at most once) and each row sums to ``K * tokens``.
    """
    R, E = p_RE.shape
    q_ER = (p_RE.to(torch.float64) / p_RE.to(torch.float64).sum(-1, keepdim=True)).t().contiguous()
    tail_ER = q_ER.flip(0).cumsum(0).flip(0)  # tail[e] = sum_{j >= e} q_j
    prob_ER = (q_ER / tail_ER.clamp_min(1e-300)).clamp_(0.0, 1.0)
    n = tokens_R.to(torch.float64)
    left = n * K
    out_ER = torch.empty(E, R, dtype=torch.float64)
    for e in range(E - 1):
        c = torch.binomial(left, prob_ER[e], generator=g)
        c = torch.minimum(torch.maximum(c, (left - n * (E - 1 - e)).clamp_min_(0.0)),
                          torch.minimum(n, left))
        out_ER[e] = c
        left = left - c
    out_ER[E - 1] = left
    return out_ER.t().to(torch.int64)


def draw_counts(p_RE: torch.Tensor, tokens_R: torch.Tensor, K: int, g: torch.Generator) -> torch.Tensor:
    """int64 ``[R, E]`` counts of ``K * tokens`` expert slots per row with inclusion
    probabilities ``p_RE`` (rows ~ sum ``K``), each count at most ``tokens``: the count draw
    of :func:`generate_load_trace`, in blocks of rows (for other trace families)."""
    return torch.cat([bin_counts(p_RE[r:r + _COUNT_ROWS], tokens_R[r:r + _COUNT_ROWS], K, g)
                      for r in range(0, p_RE.shape[0], _COUNT_ROWS)])


def generate_load_trace(cfg: TraceConfig, num_micro_batches: int, num_ranks: int,
                        tokens_per_micro_batch_per_rank: int, steps: int = 1) -> SyntheticLoads:
    """Per-(step, micro-batch, layer, source rank, expert) token counts, and the packing.

    Per step, samples are drawn in order and packed rank-major (rank 0's micro-batches
    first, as a trainer splits its batch over data-parallel ranks) into micro-batches of at
    most ``tokens_per_micro_batch_per_rank`` tokens: a sample that does not fit closes the
    micro-batch (samples longer than the budget are truncated to it).

    Counts come from the per-sample model without token ids (fast approximation, see
    docs/traces.md): each sample's expected inclusion vector ``pi = 1 - exp(-tau w)``
    (Rosen's approximation of the Plackett-Luce top-k marginals), token-weighted per
    micro-batch, then ``K * tokens`` slots drawn multinomially with every count clamped to
    at most ``tokens``. Means match :func:`generate_routing` to ~1-2%; the variance of hot
    experts' counts is slightly above the per-token process (``n p (1 - p/K)`` instead of
    ``<= n p (1 - p)``), far below the sample-to-sample variation.

    Returns:
        :class:`SyntheticLoads`; ``loads_XMLSE`` int64 ``[steps, M, L, S, E]``.
    """
    check_cfg(cfg)
    M = check_int("num_micro_batches", num_micro_batches, 1)
    S = check_int("num_ranks", num_ranks, 1)
    budget = check_int("tokens_per_micro_batch_per_rank", tokens_per_micro_batch_per_rank, 1)
    X = check_int("steps", steps, 1)
    L, E, K, A = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tasks
    G = cfg.group_size
    B = M * S
    block = max(G, (DRAW_BLOCK // G) * G)

    loads = torch.empty(X, M, L, S, E, dtype=torch.int64)
    tokens_XMS = torch.zeros(X, M, S, dtype=torch.int64)
    task_tokens = torch.zeros(X, M, S, A, dtype=torch.int64)
    all_len, all_task, all_bin, mixes = [], [], [], []
    for x, state in enumerate(iter_step_states(cfg, X)):
        mixes.append(state.mix_A)
        g_samples = seeded_generator(cfg.seed, "loads-samples", x)
        tasks_parts, len_parts, bin_parts = [], [], []
        b, fill = 0, 0
        while b < B:
            task_N, prompt_N, response_N = draw_samples(cfg, state.mix_A, block, g_samples)
            length_N = (prompt_N + response_N).clamp(max=budget)
            bins, b, fill = pack_sequential(length_N.tolist(), budget, B, b, fill)
            used = len(bins)
            if G > 1 and b >= B:
                used = -(-used // G) * G  # keep whole groups so noise draws align
            tasks_parts.append(task_N[:used])
            len_parts.append(length_N[:used])
            bin_parts.append(torch.tensor(bins + [-1] * (used - len(bins)), dtype=torch.int64))
            if b >= B:
                break
        task_N = torch.cat(tasks_parts)
        length_N = torch.cat(len_parts)
        bin_N = torch.cat(bin_parts)  # -1: group members drawn but not packed
        # bin index is rank-major (b = s * M + m); the output is [M, S]
        keep = bin_N >= 0

        # Token-weighted expected inclusion per bin and layer.
        acc_BLE = torch.zeros(B, L, E, dtype=torch.float32)
        g_noise = seeded_generator(cfg.seed, "loads-noise", x)
        tau_AL = state.tau_AL.to(torch.float32)
        start = 0
        for log_w in sample_log_weights(cfg, state, task_N, g_noise):
            n = log_w.shape[0]
            t = task_N[start:start + n]
            bins = bin_N[start:start + n]
            pi = sample_inclusion(log_w.exp_(), K, tau_AL[t])
            pi.mul_(length_N[start:start + n].to(torch.float32).view(n, 1, 1))
            sel = bins >= 0
            if bool(sel.all()):
                acc_BLE.index_add_(0, bins, pi)
            else:
                acc_BLE.index_add_(0, bins[sel], pi[sel])
            start += n

        tok_B = torch.zeros(B, dtype=torch.int64).index_add_(0, bin_N[keep], length_N[keep])
        task_BA = torch.zeros(B * A, dtype=torch.int64).index_add_(
            0, bin_N[keep] * A + task_N[keep], length_N[keep]).view(B, A)
        g_counts = seeded_generator(cfg.seed, "loads-counts", x)
        p_RE, tok_R = acc_BLE.view(B * L, E), tok_B.repeat_interleave(L)
        counts = torch.cat([bin_counts(p_RE[r:r + _COUNT_ROWS], tok_R[r:r + _COUNT_ROWS], K, g_counts)
                            for r in range(0, B * L, _COUNT_ROWS)])
        # rank-major bins [S, M, L, E] -> [M, L, S, E]
        loads[x] = counts.view(S, M, L, E).permute(1, 2, 0, 3)
        tokens_XMS[x] = tok_B.view(S, M).t()
        task_tokens[x] = task_BA.view(S, M, A).transpose(0, 1)
        s_of, m_of = torch.div(bin_N[keep], M, rounding_mode="floor"), bin_N[keep] % M
        all_bin.append((x * M + m_of) * S + s_of)
        all_len.append(length_N[keep])
        all_task.append(task_N[keep])
    return SyntheticLoads(loads, tokens_XMS, task_tokens, torch.cat(all_len), torch.cat(all_task),
                          torch.cat(all_bin), torch.stack(mixes), cfg.tasks)


def generate_loads(cfg: TraceConfig, num_micro_batches: int, num_ranks: int,
                   tokens_per_micro_batch_per_rank: int, steps: int = 1) -> torch.Tensor:
    """int64 ``loads_XMLSE [steps, M, L, S, E]`` (see :func:`generate_load_trace`)."""
    return generate_load_trace(cfg, num_micro_batches, num_ranks,
                               tokens_per_micro_batch_per_rank, steps).loads_XMLSE


def max_over_mean(loads_E: torch.Tensor) -> torch.Tensor:
    """float64 ``[...]``: max over the last (expert) dim / mean over it, for ``[..., E]`` counts."""
    x = loads_E.to(torch.float64)
    return x.amax(-1) / x.mean(-1)
