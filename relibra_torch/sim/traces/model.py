"""The statistical model behind the synthetic traces: calibrated expert popularity per
task and layer, its drift across optimizer steps, and per-sample weights.

Both generators (:mod:`.tokens`, per-token ids; :mod:`.loads`, per-micro-batch counts)
draw from this model. Every random stream is keyed by (seed, purpose, step), so asking for
more samples or steps never changes earlier ones.

Legend: L layers, K top-k, E experts, N samples (n: a chunk of them), A tasks,
H Gauss-Hermite nodes, R rows (any flattened leading dims).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ...checks import check_int
from ..data_refs import qwen3_expert_heat
from .config import TraceConfig, check_cfg

__all__ = [
    "StepState",
    "base_inclusion_LE",
    "cap_inclusion",
    "draw_samples",
    "iter_step_states",
    "sample_inclusion",
    "sample_log_weights",
    "seeded_generator",
    "step_state",
    "task_inclusion_ALE",
]

# Samples per chunk when per-sample weights are materialised ([chunk, L, E] float32).
_SAMPLE_CHUNK = 256
# Newton steps for the per-sample inclusion solve, started from the task-level solution.
_SAMPLE_NEWTON_ITERS = 2
# Gauss-Hermite nodes for averaging over the lognormal per-sample noise in calibration.
_NOISE_NODES = 12
# Heat pseudo-count: experts with no token in the 75,773-token reference stay possible but rare.
_HEAT_FLOOR = 0.5
# Largest per-token inclusion probability the base popularity may ask for (needs < 1: an
# expert in every token's top-k has infinite Plackett-Luce weight).
_PI_CAP = 0.95
# Coarse experts: an E < E0 model's merged shares are raised to (E / E0) ** this (docs/traces.md,
# "Other expert counts"): 1/4 makes 8 experts as skewed as Mixtral-8x7B in the shared data.
_COARSE_EXPONENT = 0.25
_LOG_W_MIN = -60.0


# --------------------------------------------------------------------------------------
# seeding


def _sub_seed(seed: int, *tags) -> int:
    # Independent, platform-stable streams per purpose (and per step), so that e.g. asking
    # for more steps never changes the earlier ones.
    digest = hashlib.blake2b(repr((seed,) + tags).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seeded_generator(seed: int, *tags, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(_sub_seed(seed, *tags))
    return g


# --------------------------------------------------------------------------------------
# inclusion probabilities of Plackett-Luce top-k sampling


def _hermite_nodes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Hermite nodes/weights (Golub-Welsch) for E[f(Z)], Z ~ N(0, 1): float64 ``[H]``."""
    k = torch.arange(1, n, dtype=torch.float64)
    J = torch.diag(torch.sqrt(k / 2), 1) + torch.diag(torch.sqrt(k / 2), -1)
    x, V = torch.linalg.eigh(J)
    w = V[0] ** 2  # sums to 1: weights of the physicists' rule divided by sqrt(pi)
    return x * math.sqrt(2.0), w / w.sum()


def _solve_tau(w_RE: torch.Tensor, K: int, eps_H: torch.Tensor | None = None,
               g_H: torch.Tensor | None = None, tau0_R: torch.Tensor | None = None,
               iters: int = 60, tol: float | None = None) -> torch.Tensor:
    """``tau_R`` with ``sum_e E_eps[1 - exp(-tau w_e eps)] = K`` (Newton, float64 or float32).

    ``1 - exp(-tau * w_e)`` is Rosen's approximation of the probability that expert ``e`` is
    among the top-k of a Plackett-Luce (successive sampling) draw with weights ``w``; it is
    accurate to about 1-2% for 128 experts, top-8 (measured in docs/traces.md). With
    ``eps_H``/``g_H`` the expectation over a multiplicative noise factor is a quadrature.
    The sum is concave increasing in tau and ``K / sum(w)`` lies below the root, so Newton
    clamped at that bound converges monotonically. ``K >= E`` (every expert in every
    top-k): no finite root, ``tau = inf``.
    """
    if K >= w_RE.shape[-1]:
        return torch.full(w_RE.shape[:-1], math.inf, dtype=w_RE.dtype, device=w_RE.device)
    if eps_H is not None:
        w_RE = w_RE.unsqueeze(-1) * eps_H  # [R, E, H]
        sw = (w_RE * g_H).sum((-1, -2))
    else:
        sw = w_RE.sum(-1)
    lo_R = K / sw
    tau_R = lo_R if tau0_R is None else torch.maximum(tau0_R, lo_R)
    for _ in range(iters):
        t = tau_R.view(tau_R.shape + (1,) * (w_RE.dim() - tau_R.dim()))
        e = torch.exp(-t * w_RE)
        if eps_H is not None:
            f = ((1 - e) * g_H).sum((-1, -2)) - K
            df = (w_RE * e * g_H).sum((-1, -2))
        else:
            f = (1 - e).sum(-1) - K
            df = (w_RE * e).sum(-1)
        tau_R = torch.maximum(tau_R - f / df, lo_R)
        if tol is not None and float(f.abs().max()) < tol:
            break
    return tau_R


def _inclusion(w_RE: torch.Tensor, K: int, eps_H=None, g_H=None,
               tau0_R: torch.Tensor | None = None) -> torch.Tensor:
    """Expected per-token inclusion probabilities ``[R, E]`` (sum K) of weights ``w_RE``."""
    if K >= w_RE.shape[-1]:  # top-k of all experts: every expert is in every token's top-k
        return torch.ones_like(w_RE)
    tau_R = _solve_tau(w_RE, K, eps_H, g_H, tau0_R=tau0_R, tol=1e-10 * K)
    if eps_H is None:
        return -torch.expm1(-tau_R.unsqueeze(-1) * w_RE)
    p = -torch.expm1(-tau_R[..., None, None] * w_RE.unsqueeze(-1) * eps_H)
    return (p * g_H).sum(-1)


def cap_inclusion(pi_LE: torch.Tensor, K: int, cap: float) -> torch.Tensor:
    """Water-fill: clip ``pi`` at ``cap`` and rescale the rest so each row sums to ``K``."""
    pi_LE = pi_LE * (K / pi_LE.sum(-1, keepdim=True))
    for _ in range(pi_LE.shape[-1]):
        capped = pi_LE >= cap
        if not (pi_LE > cap * (1 + 1e-12)).any():
            break
        free = torch.where(capped, torch.zeros_like(pi_LE), pi_LE)
        room = K - cap * capped.sum(-1, keepdim=True).to(pi_LE.dtype)
        pi_LE = torch.where(capped, torch.full_like(pi_LE, cap),
                            free * room / free.sum(-1, keepdim=True).clamp_min(1e-300))
    return pi_LE


# --------------------------------------------------------------------------------------
# calibrated model


def _merge_experts(share_LE: torch.Tensor, E: int) -> torch.Tensor:
    """Merge each row's ``E0`` expert shares into ``E < E0`` coarser experts (rows keep their sums).

    New expert ``k`` stands for reference experts ``[k E0 / E, (k + 1) E0 / E)`` in id order
    (one cut by a boundary counts in proportion), and its share is theirs summed: a coarse
    expert takes the tokens of the fine experts it replaces. A group's share is at most its
    size times the largest and its mean is its size times the mean, so max/mean never rises;
    for ``E'`` dividing ``E`` the ``E'``-expert rows are the ``E``-expert rows merged again.
    """
    E0 = share_LE.shape[-1]
    cum = torch.cat([torch.zeros_like(share_LE[..., :1]), share_LE.cumsum(-1)], -1)  # [L, E0 + 1]
    pos = torch.arange(E + 1) * E0  # edges at pos / E reference experts
    j = torch.div(pos, E, rounding_mode="floor").clamp(max=E0 - 1)
    frac = (pos - j * E).to(share_LE.dtype) / E
    return (cum[..., j] + frac * share_LE[..., j]).diff(dim=-1)


def _resample_experts(share_E: torch.Tensor, E: int) -> torch.Tensor:
    """Resample one layer's expert shares (sum 1) from ``E0`` to ``E > E0`` experts.

    Values: the quantile function of the source shares (piecewise linear through the
    sorted values at ``(j + 0.5) / E0``) evaluated at ``(k + 0.5) / E``. Placement: new
    expert ``k`` takes the popularity rank of source expert ``floor(k * E0 / E)`` (ties
    broken by ``k``), so tiling 128 -> 256 keeps neighbouring ids similar and 128 -> 64
    keeps every other expert's rank order.
    """
    E0 = share_E.numel()
    sorted_desc = share_E.sort(descending=True, stable=True).values
    u_src = (torch.arange(E0, dtype=torch.float64) + 0.5) / E0
    u_new = ((torch.arange(E, dtype=torch.float64) + 0.5) / E).clamp(u_src[0], u_src[-1])
    idx = torch.searchsorted(u_src, u_new, right=True).clamp(1, E0 - 1)
    frac = (u_new - u_src[idx - 1]) / (u_src[idx] - u_src[idx - 1])
    values = sorted_desc[idx - 1] + frac * (sorted_desc[idx] - sorted_desc[idx - 1])
    src_rank = torch.empty(E0, dtype=torch.int64)
    src_rank[share_E.sort(descending=True, stable=True).indices] = torch.arange(E0)
    src_of_new = torch.div(torch.arange(E) * E0, E, rounding_mode="floor")
    key = src_rank[src_of_new] * E + torch.arange(E)
    new_rank = torch.empty(E, dtype=torch.int64)
    new_rank[key.argsort()] = torch.arange(E)
    out = values[new_rank]
    return out / out.sum()


@functools.lru_cache(maxsize=32)
def base_inclusion_LE(cfg: TraceConfig) -> torch.Tensor:
    """Target whole-trace inclusion probabilities float64 ``[L, E]`` (each row sums to K).

    For 48 x 128, top-8 this is the Qwen3-30B-A3B heat ``(heat + 0.5) / tokens``. Other
    shapes: layer ``l`` uses reference layer ``floor((l + 0.5) * 48 / L)`` (even spacing for
    fewer layers, repetition for more). Fewer experts (``E < 128``): the reference experts
    are merged into ``E`` groups (:func:`_merge_experts`) and the merged shares raised to
    ``(E / 128) ** 0.25`` (0.5 for 8 experts), so max/mean never rises as experts merge; more
    experts: resampled by quantiles (:func:`_resample_experts`). Shares are scaled to sum
    ``top_k`` and water-filled below ``min(0.95, ...)`` per expert; ``top_k == num_experts``
    gives all ones. The returned tensor is cached: do not modify it.
    """
    check_cfg(cfg)
    if cfg.top_k >= cfg.num_experts:
        return torch.ones(cfg.num_layers, cfg.num_experts, dtype=torch.float64)
    ref = qwen3_expert_heat()
    heat = ref.heat_LE.to(torch.float64) + _HEAT_FLOOR
    L0, E0 = heat.shape
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    src_l = torch.div(torch.arange(L) * 2 * L0 + L0, 2 * L, rounding_mode="floor")
    share = heat[src_l]
    share = share / share.sum(-1, keepdim=True)
    if E < E0:  # coarser experts: merge, then compress (never more skewed than the reference)
        share = _merge_experts(share, E) ** ((E / E0) ** _COARSE_EXPONENT)
        share = share / share.sum(-1, keepdim=True)
    elif E > E0:
        share = torch.stack([_resample_experts(row, E) for row in share])
    cap = _PI_CAP if K / E <= 0.9 else (1 + K / E) / 2
    return cap_inclusion(share * K, K, cap)


def _clipped_lognormal_mean(median: float, sigma: float, lo: float, hi: float) -> float:
    if sigma == 0.0:
        return min(max(median, lo), hi)
    mu = math.log(median)
    Phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = lambda x: (math.log(x) - mu) / sigma if x > 0 else -math.inf  # noqa: E731
    mid = math.exp(mu + sigma ** 2 / 2) * (Phi(z(hi) - sigma) - (Phi(z(lo) - sigma) if lo > 0 else 0.0))
    return lo * (Phi(z(lo)) if lo > 0 else 0.0) + mid + hi * (1 - Phi(z(hi)))


def _expected_lengths_A(cfg: TraceConfig) -> torch.Tensor:
    return torch.tensor([
        _clipped_lognormal_mean(cfg.prompt_len_median[a], cfg.prompt_len_sigma[a],
                                cfg.min_prompt_len, cfg.max_prompt_len)
        + _clipped_lognormal_mean(cfg.response_len_median[a], cfg.response_len_sigma[a],
                                  cfg.min_response_len, cfg.max_response_len)
        for a in range(cfg.num_tasks)], dtype=torch.float64)


@dataclass(frozen=True)
class _Model:
    log_base_LE: torch.Tensor    # float64, calibrated log weights
    log_mult_ALE: torch.Tensor   # float64, step-0 task multipliers (log)
    mix_A: torch.Tensor          # float64, normalised sample mixing weights
    eps_H: torch.Tensor          # float64, lognormal noise factors at the quadrature nodes
    g_H: torch.Tensor            # float64, quadrature weights


@functools.lru_cache(maxsize=32)
def _model(cfg: TraceConfig) -> _Model:
    """Task multipliers and the base calibrated so the task mixture hits the target.

    Fixed point in hazard space: with ``pi_mix = sum_a share_a E_eps[pi(b * m_a * eps)]``
    (token-weighted task shares, Rosen inclusion, quadrature over the sample noise), update
    ``b *= -log(1 - pi*) / -log(1 - pi_mix)`` until ``pi_mix == pi*`` (rel. 1e-6).
    """
    L, E, K, A = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tasks
    target = base_inclusion_LE(cfg)
    g = seeded_generator(cfg.seed, "tasks")
    z_ALE = torch.randn(A, L, E, generator=g, dtype=torch.float64)
    log_mult = cfg.task_spread * z_ALE
    n_hot = cfg.hot_experts_per_task
    if n_hot > 0:
        # Hot experts: Gumbel-top-k by target ** hot_bias, so hot sets lean to popular experts.
        u = torch.rand(A, L, E, generator=g, dtype=torch.float64).clamp_min(1e-300)
        keys = cfg.hot_bias * target.log() - torch.log(-torch.log(u))
        hot = torch.zeros(A, L, E, dtype=torch.bool)
        hot.scatter_(-1, keys.topk(n_hot, dim=-1).indices, True)
        log_strength = torch.tensor(cfg.hot_strength, dtype=torch.float64).log()
        log_mult = log_mult + hot * log_strength.view(A, 1, 1)
    mix = torch.tensor(cfg.task_weights, dtype=torch.float64)
    mix = mix / mix.sum()
    share = mix * _expected_lengths_A(cfg)
    share = (share / share.sum()).view(A, 1, 1)

    sigma = cfg.noise_sigma
    if sigma > 0:
        x_H, g_H = _hermite_nodes(_NOISE_NODES)
        eps_H = torch.exp(sigma * x_H - sigma ** 2 / 2)
    else:
        eps_H, g_H = torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)

    if K >= E:  # every token takes every expert: nothing to calibrate, weights are moot
        return _Model(torch.zeros(L, E, dtype=torch.float64), log_mult, mix, eps_H, g_H)
    h_target = -torch.log1p(-target)
    log_b = h_target.log()
    mult = log_mult.exp()
    for _ in range(500):
        pi_mix = (share * _inclusion((log_b.exp() * mult).view(A * L, E), K, eps_H, g_H)
                  .view(A, L, E)).sum(0)
        step = h_target.log() - (-torch.log1p(-pi_mix.clamp(max=1 - 1e-12))).log()
        log_b = log_b + step
        if step.abs().max() < 1e-7:
            break
    log_b = log_b - log_b.mean(-1, keepdim=True)  # scale is free: keep numbers moderate
    return _Model(log_b, log_mult, mix, eps_H, g_H)


@dataclass(frozen=True)
class StepState:
    log_w_ALE: torch.Tensor  # float64: log base + log task multiplier at this step
    mix_A: torch.Tensor      # float64: sample mixing weights at this step
    tau_AL: torch.Tensor     # float64: noise-averaged Rosen tau per task and layer


def _iter_drift(cfg: TraceConfig, num_steps: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """AR(1) drift ``(d_ALE, d_A)`` of steps ``0 .. num_steps-1`` (zero at step 0, unit
    stationary variance; step ``x`` draws its innovations from its own seeded stream)."""
    A, L, E = cfg.num_tasks, cfg.num_layers, cfg.num_experts
    rho = cfg.drift_correlation
    innov = math.sqrt(max(0.0, 1 - rho * rho))
    d_ALE = torch.zeros(A, L, E, dtype=torch.float64)
    d_A = torch.zeros(A, dtype=torch.float64)
    for x in range(num_steps):
        if x > 0:
            g = seeded_generator(cfg.seed, "drift", x)
            d_ALE = rho * d_ALE + innov * torch.randn(A, L, E, generator=g, dtype=torch.float64)
            d_A = rho * d_A + innov * torch.randn(A, generator=g, dtype=torch.float64)
        yield d_ALE, d_A


def _state(cfg: TraceConfig, d_ALE: torch.Tensor, d_A: torch.Tensor) -> StepState:
    m = _model(cfg)
    A, L, E = d_ALE.shape
    log_w = m.log_base_LE + m.log_mult_ALE + cfg.drift_sigma * d_ALE
    if cfg.skew != 1.0:  # w ** skew; skipped at 1 so the calibrated trace stays bit for bit
        log_w = cfg.skew * log_w
    mix = m.mix_A * torch.exp(cfg.mix_drift_sigma * d_A)
    tau = _solve_tau(log_w.exp().view(A * L, E), cfg.top_k, m.eps_H, m.g_H, tol=1e-10 * cfg.top_k)
    return StepState(log_w, mix / mix.sum(), tau.view(A, L))


def iter_step_states(cfg: TraceConfig, num_steps: int) -> Iterator[StepState]:
    """Model states of steps ``0 .. num_steps-1``."""
    for d_ALE, d_A in _iter_drift(cfg, num_steps):
        yield _state(cfg, d_ALE, d_A)


def step_state(cfg: TraceConfig, step: int) -> StepState:
    for d_ALE, d_A in _iter_drift(cfg, step + 1):
        pass
    return _state(cfg, d_ALE, d_A)


def task_inclusion_ALE(cfg: TraceConfig, step: int = 0) -> torch.Tensor:
    """Expected per-token inclusion probabilities float64 ``[A, L, E]`` of each task at ``step``.

    Averaged over the per-sample noise; each row sums to ``top_k``. Token-weighting these by
    task shares gives :func:`base_inclusion_LE` at step 0.
    """
    check_cfg(cfg)
    check_int("step", step, 0)
    m = _model(cfg)
    s = step_state(cfg, step)
    A, L, E = s.log_w_ALE.shape
    return _inclusion(s.log_w_ALE.exp().view(A * L, E), cfg.top_k, m.eps_H, m.g_H).view(A, L, E)


# --------------------------------------------------------------------------------------
# samples


def _lognormal_lengths(median_N: torch.Tensor, sigma_N: torch.Tensor, lo: int, hi: int,
                       g: torch.Generator) -> torch.Tensor:
    z = torch.randn(median_N.shape, generator=g, dtype=torch.float64)
    x = torch.exp(median_N.log() + sigma_N * z)
    return x.round().clamp(lo, hi).to(torch.int64)


def draw_samples(cfg: TraceConfig, mix_A: torch.Tensor, num: int, g: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``num`` samples (a multiple of group_size): task, prompt length, response length (int64 [N])."""
    G = cfg.group_size
    groups = num // G
    task_P = torch.multinomial(mix_A, groups, replacement=True, generator=g)
    pm = torch.tensor(cfg.prompt_len_median, dtype=torch.float64)[task_P]
    ps = torch.tensor(cfg.prompt_len_sigma, dtype=torch.float64)[task_P]
    prompt_P = _lognormal_lengths(pm, ps, cfg.min_prompt_len, cfg.max_prompt_len, g)
    task_N = task_P.repeat_interleave(G)
    rm = torch.tensor(cfg.response_len_median, dtype=torch.float64)[task_N]
    rs = torch.tensor(cfg.response_len_sigma, dtype=torch.float64)[task_N]
    response_N = _lognormal_lengths(rm, rs, cfg.min_response_len, cfg.max_response_len, g)
    return task_N, prompt_P.repeat_interleave(G), response_N


def sample_log_weights(cfg: TraceConfig, state: StepState, task_N: torch.Tensor,
                        g: torch.Generator) -> Iterator[torch.Tensor]:
    """Per-sample log weights float32 ``[chunk, L, E]``, in chunks of _SAMPLE_CHUNK samples.

    ``log w = log b + log m_task + group_noise * z_group + sample_noise * z_sample - s^2/2``
    (the ``-s^2/2`` keeps the noise factor's mean at 1). Group factors are drawn once per
    group, so chunks are aligned to whole groups.
    """
    L, E = cfg.num_layers, cfg.num_experts
    G = cfg.group_size
    log_w_ALE = state.log_w_ALE.to(torch.float32)
    sg, ss = cfg.group_noise, cfg.sample_noise
    shift = (sg * sg + ss * ss) / 2
    chunk = max(G, (_SAMPLE_CHUNK // G) * G)
    N = task_N.numel()
    for start in range(0, N, chunk):
        t = task_N[start:start + chunk]
        n = t.numel()
        if G == 1:
            # One normal with the combined sigma has the same law as group x sample factors.
            noise = torch.randn(n, L, E, generator=g).mul_(cfg.noise_sigma)
        else:
            noise = torch.randn(n, L, E, generator=g).mul_(ss)
            zg = torch.randn(n // G, L, E, generator=g).mul_(sg)
            noise.view(n // G, G, L, E).add_(zg.unsqueeze(1))
        noise.add_(log_w_ALE[t]).sub_(shift)
        yield noise.clamp_(min=_LOG_W_MIN)


def sample_inclusion(w_nLE: torch.Tensor, K: int, tau0_nL: torch.Tensor,
                      iters: int = _SAMPLE_NEWTON_ITERS) -> torch.Tensor:
    """Rosen inclusion ``1 - exp(-tau w)`` per sample and layer (float32, rows sum to ~K).

    Newton from the task-level tau; two steps leave |sum - K| < 1e-3 for the default model
    (measured), a third costs time for nothing the counts can show.
    """
    E = w_nLE.shape[-1]
    if K >= E:  # every expert in every token's top-k
        return torch.ones_like(w_nLE)
    lo = K / w_nLE.sum(-1)
    tau = torch.maximum(tau0_nL, lo)
    e = torch.empty_like(w_nLE)
    for _ in range(iters):
        torch.mul(w_nLE, tau.neg().unsqueeze_(-1), out=e).exp_()
        f = (E - K) - e.sum(-1)
        df = torch.linalg.vecdot(w_nLE, e)
        tau = torch.maximum(tau - f / df, lo)
    torch.mul(w_nLE, tau.neg().unsqueeze_(-1), out=e).expm1_().neg_()
    return e
