"""Token-level generator: per-token top-k expert ids of synthetic samples (routing replay).

:func:`generate_routing` draws every token's ``K`` experts from its sample's weights
(:mod:`.model`): by default with fast systematic sampling from the per-sample inclusion
probabilities, or exactly from the Plackett-Luce distribution with the Gumbel-top-k trick.

Legend: T tokens, L layers, K top-k, E experts, N samples (n: a chunk of them),
U lookup buckets, c tokens of a chunk, R rows (any flattened leading dims).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...checks import check_int
from ...replay.counts import count_experts
from .config import TraceConfig, check_cfg
from .model import cap_inclusion, draw_samples, sample_inclusion, sample_log_weights, seeded_generator, step_state

__all__ = ["SyntheticRouting", "generate_routing"]

# Tokens per chunk of the Gumbel-top-k keys are sized from this element budget (16 MiB of
# float32 keys). It depends on the config only, never on the machine, so the random stream
# and hence the output are the same everywhere.
_KEY_CHUNK_ELEMS = 1 << 22
# Buckets of the per-(sample, layer) lookup that finds a systematic draw's interval.
_LUT_BUCKETS = 2048


# --------------------------------------------------------------------------------------
# per-token routing


@dataclass
class SyntheticRouting:
    """Routing replay of synthetic samples (same layout as the replay file format).

    Attributes:
        routed_experts_TLK: int16 ``[T, L, K]``, distinct expert ids per token and layer;
            samples are concatenated.
        sample_offsets_N1: int64 ``[N + 1]``, token offsets of the samples.
        sample_task_N: int64 ``[N]``, index into ``tasks``.
        sample_length_N: int64 ``[N]``, tokens per sample (prompt + response).
        sample_prompt_length_N: int64 ``[N]``, prompt tokens (the first tokens of a sample).
        tasks: task names.
        num_experts: E.
        step: optimizer step whose drift state was used.
        method: per-token sampler (``"systematic"`` or ``"gumbel"``).
    """

    routed_experts_TLK: torch.Tensor
    sample_offsets_N1: torch.Tensor
    sample_task_N: torch.Tensor
    sample_length_N: torch.Tensor
    sample_prompt_length_N: torch.Tensor
    tasks: tuple[str, ...]
    num_experts: int
    step: int
    method: str = "systematic"

    def to_replay(self, model: str | None = None):
        """A validated :class:`relibra_torch.replay.RoutingReplay` (``save_routing`` writes it
        as a ``relibra.routing/1`` file), with ``sample_step`` and ``sample_task`` set."""
        from ...replay.routing import RoutingReplay
        N = self.sample_task_N.numel()
        return RoutingReplay(self.routed_experts_TLK, self.sample_offsets_N1, self.num_experts,
                             model=model, sample_step=torch.full((N,), self.step, dtype=torch.int64),
                             sample_task=self.sample_task_N)

    def loads_LE(self) -> torch.Tensor:
        """int64 ``[L, E]``: tokens per (layer, expert) over the whole trace."""
        return count_experts(self.routed_experts_TLK, self.num_experts, name="routed_experts_TLK")


_ROUTING_METHODS = ("gumbel", "systematic")


def _systematic_tables(pi_RE: torch.Tensor, K: int, g: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Lookup tables for systematic top-k sampling from inclusion probabilities ``pi_RE``.

    Experts are laid on ``[0, K)`` in a random order (one per row), expert ``e`` covering a
    segment of length ``pi_e <= 1``; a token draws ``u ~ U(0, 1)`` and takes the experts
    under the points ``u, u + 1, ..., u + K - 1``. A segment no longer than 1 holds at most
    one point, so the K experts are distinct, and expert ``e`` is taken with probability
    exactly ``pi_e``. The map ``u -> experts`` is constant between the fractional parts of the
    segment ends, so it is tabulated once per row.

    Returns:
        ``starts_RE`` float64 (sorted interval starts in ``[0, 1)``, the first is 0) and
        ``table_REK`` int64 (the K experts of each interval).
    """
    R, E = pi_RE.shape
    # 1 - 1e-6: rounding must never let a segment hold two points 1 apart.
    pi_RE = cap_inclusion(pi_RE.to(torch.float64), K, 1.0 - 1e-6)
    perm_RE = torch.rand(R, E, generator=g, dtype=torch.float64).argsort(-1)
    ends_RE = pi_RE.gather(-1, perm_RE).cumsum(-1)
    ends_RE[:, -1] = K
    starts_RE = torch.cat([torch.zeros(R, 1, dtype=torch.float64), torch.frac(ends_RE[:, :-1])], -1)
    starts_RE = starts_RE.sort(-1).values
    nxt_RE = torch.cat([starts_RE[:, 1:], torch.ones(R, 1, dtype=torch.float64)], -1)
    points = ((starts_RE + nxt_RE) / 2).unsqueeze(-1) + torch.arange(K, dtype=torch.float64)
    slot = torch.searchsorted(ends_RE, points.view(R, E * K), right=True).clamp_(max=E - 1)
    return starts_RE, perm_RE.gather(-1, slot).view(R, E, K)


def _interval_lut(starts_LE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket lookup for sorted interval starts (float32 ``[L, E]``, first 0).

    Returns ``lut_LU`` (int64: the last interval starting at or before ``b / U``) and
    ``next_LE`` (float32: each interval's end, 2.0 for the last), so the interval of ``u`` is
    ``lut[floor(u U)]`` advanced while ``next <= u``.
    """
    L, E = starts_LE.shape
    U = _LUT_BUCKETS
    first_bucket = torch.ceil(starts_LE * U).long()  # start s <= b / U  <=>  ceil(s U) <= b
    hist = torch.zeros(L, U + 1, dtype=torch.int64, device=starts_LE.device)
    hist.scatter_add_(1, first_bucket, torch.ones_like(first_bucket))
    lut_LU = hist.cumsum_(1)[:, :U].sub_(1)
    next_LE = torch.cat([starts_LE[:, 1:], torch.full((L, 1), 2.0, device=starts_LE.device)], 1)
    return lut_LU, next_LE


def generate_routing(cfg: TraceConfig, num_samples: int, *, step: int = 0,
                     method: str = "systematic",
                     device: torch.device | str | None = None) -> SyntheticRouting:
    """Per-token top-k routing of ``num_samples`` synthetic samples at optimizer ``step``.

    Each sample draws its task, lengths and noisy expert weights ``w[L, E]`` (the same model
    as :func:`generate_loads`); tokens of a sample are independent given ``w``. Per token and
    layer, ``method`` picks k distinct experts:

    * ``"systematic"`` (default, fast: ~7 s per 1M tokens x 48 layers on one core):
      systematic sampling from the sample's inclusion vector ``pi = 1 - exp(-tau w)``
      (Rosen's approximation of the Plackett-Luce marginals, within ~2%): one random
      number, a bucket lookup and a table lookup per token and layer; each expert's count
      in a sample is exactly ``Binomial(tokens, pi_e)``. The experts of one token are less
      clustered than under Plackett-Luce (co-activation differs, loads not).
    * ``"gumbel"`` (exact Plackett-Luce, slow: ~2 min per 1M tokens x 48 layers on CPU):
      the top-k of ``log(U) / w`` over experts, ``U ~ U(0, 1)``, i.e. the Gumbel-top-k
      trick (top-k of ``log w + Gumbel``) in exponential-race form; E random numbers and a
      top-k per token and layer. Use it when which experts co-occur in a token matters.

    Memory: ``T * L * K * 2`` bytes for the ids plus fixed ~16-64 MiB buffers.

    Args:
        cfg: trace model.
        num_samples: samples to generate (>= 1).
        step: drift state to use (>= 0).
        method: ``"systematic"`` (default) or ``"gumbel"``.
        device: where the per-token work runs (``"cuda"`` is much faster); the sample
            structure is always drawn on CPU. Results are bit-identical per device type,
            not across them.
    Returns:
        :class:`SyntheticRouting` (CPU tensors).
    """
    check_cfg(cfg)
    check_int("num_samples", num_samples, 1)
    check_int("step", step, 0)
    if method not in _ROUTING_METHODS:
        raise ValueError(f"method={method!r} is invalid; allowed: {_ROUTING_METHODS}")
    device = torch.device("cpu" if device is None else device)
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    state = step_state(cfg, step)
    g_samples = seeded_generator(cfg.seed, "routing-samples", step)
    n_draw = -(-num_samples // cfg.group_size) * cfg.group_size
    drawn_task_N, prompt_N, response_N = draw_samples(cfg, state.mix_A, n_draw, g_samples)
    task_N, prompt_N = drawn_task_N[:num_samples], prompt_N[:num_samples]
    length_N = prompt_N + response_N[:num_samples]
    offsets_N1 = torch.zeros(num_samples + 1, dtype=torch.int64)
    torch.cumsum(length_N, 0, out=offsets_N1[1:])
    T = int(offsets_N1[-1])
    out_TLK = torch.empty(T, L, K, dtype=torch.int16)
    if K == E:  # every token takes every expert (either method); weights do not matter
        out_TLK.copy_(torch.arange(E, dtype=torch.int16).expand(T, L, K))
        return SyntheticRouting(out_TLK, offsets_N1, task_N.clone(), length_N, prompt_N.clone(),
                                cfg.tasks, E, step, method)

    g_noise = seeded_generator(cfg.seed, "routing-noise", step)
    g_tables = seeded_generator(cfg.seed, "routing-tables", step)
    g_tokens = seeded_generator(cfg.seed, "routing-tokens", method, step, device=device)
    if method == "gumbel":
        chunk_tokens = max(1, _KEY_CHUNK_ELEMS // (L * E))
    else:
        chunk_tokens = max(1, _KEY_CHUNK_ELEMS // (L * K))
    tau_AL = state.tau_AL.to(torch.float32)
    lengths = length_N.tolist()
    offsets = offsets_N1.tolist()
    i = 0
    # Noise is drawn for whole groups (drawn_task_N); members past num_samples are unused.
    for log_w_nLE in sample_log_weights(cfg, state, drawn_task_N, g_noise):
        n_here = min(log_w_nLE.shape[0], num_samples - i)
        if n_here <= 0:
            break
        log_w_nLE = log_w_nLE[:n_here]
        if method == "gumbel":
            inv_w_nLE = torch.exp(-log_w_nLE).to(device)
        else:
            pi_nLE = sample_inclusion(log_w_nLE.exp(), K, tau_AL[task_N[i:i + n_here]])
            starts, table = _systematic_tables(pi_nLE.view(n_here * L, E), K, g_tables)
            starts = starts.to(torch.float32).view(n_here, L, E).to(device)
            table = table.to(torch.int16).view(n_here, L, E, K).to(device)
        for j in range(n_here):
            n, off = lengths[i], offsets[i]
            if method == "systematic":
                lut_LU, next_LE = _interval_lut(starts[j])
            for c0 in range(0, n, chunk_tokens):
                c = min(chunk_tokens, n - c0)
                if method == "gumbel":
                    keys = torch.empty(c, L, E, device=device, dtype=torch.float32)
                    keys.uniform_(generator=g_tokens).log_().mul_(inv_w_nLE[j])
                    idx = keys.topk(K, dim=-1, sorted=False).indices
                else:
                    u_Lc = torch.empty(L, c, device=device, dtype=torch.float32)
                    u_Lc.uniform_(generator=g_tokens)
                    # Interval of u: the bucket's first interval, then step past the (rare)
                    # interval starts inside the bucket.
                    interval_Lc = lut_LU.gather(1, (u_Lc * _LUT_BUCKETS).long())
                    while True:
                        step_Lc = next_LE.gather(1, interval_Lc) <= u_Lc
                        if not bool(step_Lc.any()):
                            break
                        interval_Lc += step_Lc
                    idx = table[j].gather(1, interval_Lc.unsqueeze(-1).expand(L, c, K)).transpose(0, 1)
                out_TLK[off + c0:off + c0 + c] = idx.to(torch.int16).cpu()
            i += 1
    return SyntheticRouting(out_TLK, offsets_N1, task_N.clone(), length_N, prompt_N.clone(),
                            cfg.tasks, E, step, method)
