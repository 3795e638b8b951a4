"""Seeded synthetic RL routing traces, calibrated on real expert-load statistics.

A trace is a stream of RL samples (prompt + response) of several task types (math, code,
science, chat). Each task has its own hot experts per layer; each sample varies around its
task; task mix and hot experts drift slowly from optimizer step to step. Two generators
share that model:

* :func:`generate_routing`: per-token top-k expert ids ``[T, L, K]`` (routing replay), by
  default with fast systematic sampling from each sample's inclusion probabilities
  (``method="systematic"``, seconds per 1M tokens); ``method="gumbel"`` draws exactly from
  the per-sample Plackett-Luce distribution with the Gumbel-top-k trick (minutes per 1M).
* :func:`generate_loads` / :func:`generate_load_trace`: per (step, micro-batch, layer,
  source rank, expert) token counts ``[X, M, L, S, E]`` for samples packed into ranks and
  micro-batches, without materialising token ids (a documented fast approximation).

Calibration: the mixture over tasks of the expected per-expert inclusion probability equals
the Qwen3-30B-A3B whole-trace heat of ``../shared/data`` (resampled for other shapes), so the
whole-trace per-layer max/mean of generated data matches the real model's. See
``docs/traces.md`` for the model, its equations and measured figures.

Legend: T tokens, L layers, K top-k, E experts, N samples, A tasks, Q quadrature nodes,
X steps, M micro-batches, S source ranks, B packed bins (one rank's micro-batch of a step),
R rows (any flattened leading dims).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ..replay.baseline import _check_int, uniform_max_over_mean  # re-exported: the one implementation
from .data_refs import qwen3_expert_heat

__all__ = [
    "TraceConfig",
    "SyntheticRouting",
    "SyntheticLoads",
    "generate_routing",
    "generate_loads",
    "generate_load_trace",
    "base_inclusion_LE",
    "task_inclusion_ALE",
    "uniform_max_over_mean",
    "max_over_mean",
]

# Tokens per chunk of the Gumbel-top-k keys are sized from this element budget (16 MiB of
# float32 keys). It depends on the config only, never on the machine, so the random stream
# and hence the output are the same everywhere.
_KEY_CHUNK_ELEMS = 1 << 22
# Samples per chunk when per-sample weights are materialised ([chunk, L, E] float32).
_SAMPLE_CHUNK = 256
# Samples drawn per block while packing micro-batches (a multiple of group_size is used).
_DRAW_BLOCK = 4096
# Rows (bin x layer) per block of the count draw: bounds the float64 temporaries.
_COUNT_ROWS = 8192
# Newton steps for the per-sample inclusion solve, started from the task-level solution.
_SAMPLE_NEWTON_ITERS = 2
# Gauss-Hermite nodes for averaging over the lognormal per-sample noise in calibration.
_NOISE_NODES = 12
# Heat pseudo-count: experts with no token in the 75,773-token reference stay possible but rare.
_HEAT_FLOOR = 0.5
# Largest per-token inclusion probability the base popularity may ask for (needs < 1: an
# expert in every token's top-k has infinite Plackett-Luce weight).
_PI_CAP = 0.95
_LOG_W_MIN = -60.0
# Buckets of the per-(sample, layer) lookup that finds a systematic draw's interval.
_LUT_BUCKETS = 2048


# --------------------------------------------------------------------------------------
# configuration


def _fail(name: str, value, allowed: str, exc=ValueError):
    raise exc(f"TraceConfig.{name}={value!r} is invalid; allowed: {allowed}")


@dataclass(frozen=True)
class TraceConfig:
    """Configuration of the synthetic RL trace model (all fields validated).

    Shape: ``num_layers`` MoE layers of ``num_experts`` experts, ``top_k`` per token.

    Tasks: ``tasks`` names the task types; every per-task tuple below has one entry per
    task. ``task_weights`` are the sample mixing weights (normalised internally).

    Lengths (tokens): prompt and response lengths are lognormal with the given median and
    log-space sigma, rounded and clipped to ``[min_*, max_*]``; a sample is prompt + response.

    Experts: per task and layer, ``hot_experts_per_task`` experts (drawn with probability
    proportional to ``base_inclusion ** hot_bias``) get their weight multiplied by
    ``hot_strength[task]``; in addition every (task, layer, expert) weight is multiplied by
    ``exp(task_spread * z)``, ``z ~ N(0, 1)``, a smooth task affinity. The base is then
    calibrated so that the task mixture reproduces the reference heat.

    Samples: each sample's weights get a lognormal factor (mean 1) per (layer, expert):
    ``group_noise`` is shared by the ``group_size`` responses of one prompt (GRPO groups;
    they also share task and prompt length), ``sample_noise`` is per response.

    Drift across optimizer steps: log expert multipliers and log task weights follow
    stationary AR(1) processes started at 0 in step 0, with stationary sigma
    ``drift_sigma`` / ``mix_drift_sigma`` and step-to-step correlation ``drift_correlation``.

    ``seed`` fixes everything; outputs are bit-identical for equal configs and arguments.
    """

    num_layers: int = 48
    num_experts: int = 128
    top_k: int = 8
    tasks: tuple[str, ...] = ("math", "code", "science", "chat")
    task_weights: tuple[float, ...] = (0.3, 0.3, 0.2, 0.2)
    prompt_len_median: tuple[float, ...] = (160.0, 320.0, 240.0, 128.0)
    prompt_len_sigma: tuple[float, ...] = (0.5, 0.6, 0.5, 0.7)
    response_len_median: tuple[float, ...] = (1400.0, 1100.0, 700.0, 350.0)
    response_len_sigma: tuple[float, ...] = (0.8, 0.8, 0.7, 0.9)
    min_prompt_len: int = 16
    max_prompt_len: int = 2048
    min_response_len: int = 8
    max_response_len: int = 8192
    hot_experts_per_task: int = 8
    hot_strength: tuple[float, ...] = (4.0, 4.0, 3.0, 2.5)
    hot_bias: float = 0.5
    task_spread: float = 0.6
    sample_noise: float = 0.4
    group_size: int = 1
    group_noise: float = 0.3
    drift_sigma: float = 0.3
    drift_correlation: float = 0.9
    mix_drift_sigma: float = 0.2
    seed: int = 0

    def __post_init__(self) -> None:
        def as_int(name: str, lo: int, hi: int | None = None) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                _fail(name, v, "an int", TypeError)
            if v < lo or (hi is not None and v > hi):
                _fail(name, v, f"an int in [{lo}, {hi if hi is not None else 'inf'}]")
            return v

        def as_float(name: str, lo: float, hi: float, lo_open: bool = False) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                _fail(name, v, "a real number", TypeError)
            ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
            if not ok:
                _fail(name, v, f"a finite number in {'(' if lo_open else '['}{lo}, {hi}]")
            object.__setattr__(self, name, float(v))
            return float(v)

        as_int("num_layers", 1)
        E = as_int("num_experts", 2, 32767)  # ids are stored as int16
        as_int("top_k", 1, E - 1)
        as_int("hot_experts_per_task", 0, E)
        as_int("group_size", 1)
        as_int("seed", 0, (1 << 63) - 1)
        for lo_name, hi_name in (("min_prompt_len", "max_prompt_len"),
                                 ("min_response_len", "max_response_len")):
            lo = as_int(lo_name, 0)
            as_int(hi_name, max(lo, 1))
        if self.min_prompt_len + self.min_response_len < 1:
            _fail("min_response_len", self.min_response_len,
                  "min_prompt_len + min_response_len >= 1 (a sample has at least one token)")

        tasks = self.tasks
        if isinstance(tasks, str) or not isinstance(tasks, (tuple, list)):
            _fail("tasks", tasks, "a tuple of task names", TypeError)
        tasks = tuple(tasks)
        if not tasks or any(not isinstance(t, str) or not t for t in tasks) or len(set(tasks)) != len(tasks):
            _fail("tasks", tasks, "a non-empty tuple of distinct non-empty strings")
        object.__setattr__(self, "tasks", tasks)

        per_task = {
            "task_weights": (0.0, math.inf, True),
            "prompt_len_median": (1.0, 1e7, False),
            "prompt_len_sigma": (0.0, 5.0, False),
            "response_len_median": (1.0, 1e7, False),
            "response_len_sigma": (0.0, 5.0, False),
            "hot_strength": (1.0, 1e4, False),
        }
        for name, (lo, hi, lo_open) in per_task.items():
            v = getattr(self, name)
            if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)):
                _fail(name, v, f"a tuple with one number per task ({len(tasks)})", TypeError)
            v = tuple(v)
            if len(v) != len(tasks):
                _fail(name, v, f"a tuple with one number per task ({len(tasks)}: {tasks})")
            for x in v:
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    _fail(name, v, "real numbers", TypeError)
                if not (math.isfinite(x) and (x > lo if lo_open else x >= lo) and x <= hi):
                    _fail(name, v, f"entries in {'(' if lo_open else '['}{lo}, {hi}]")
            object.__setattr__(self, name, tuple(float(x) for x in v))

        as_float("hot_bias", 0.0, 4.0)
        as_float("task_spread", 0.0, 3.0)
        as_float("sample_noise", 0.0, 3.0)
        as_float("group_noise", 0.0, 3.0)
        as_float("drift_sigma", 0.0, 3.0)
        as_float("drift_correlation", 0.0, 1.0)
        as_float("mix_drift_sigma", 0.0, 3.0)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def noise_sigma(self) -> float:
        """Log-space sigma of a sample's total noise factor (group and sample parts)."""
        return math.sqrt(self.group_noise ** 2 + self.sample_noise ** 2)




def _check_cfg(cfg) -> None:
    if not isinstance(cfg, TraceConfig):
        raise TypeError(f"cfg must be a TraceConfig, got {type(cfg).__name__}")


# --------------------------------------------------------------------------------------
# seeding


def _sub_seed(seed: int, *tags) -> int:
    # Independent, platform-stable streams per purpose (and per step), so that e.g. asking
    # for more steps never changes the earlier ones.
    digest = hashlib.blake2b(repr((seed,) + tags).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _generator(seed: int, *tags, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(_sub_seed(seed, *tags))
    return g


# --------------------------------------------------------------------------------------
# inclusion probabilities of Plackett-Luce top-k sampling


def _hermite_nodes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss-Hermite nodes/weights (Golub-Welsch) for E[f(Z)], Z ~ N(0, 1): float64 ``[Q]``."""
    k = torch.arange(1, n, dtype=torch.float64)
    J = torch.diag(torch.sqrt(k / 2), 1) + torch.diag(torch.sqrt(k / 2), -1)
    x, V = torch.linalg.eigh(J)
    w = V[0] ** 2  # sums to 1: weights of the physicists' rule divided by sqrt(pi)
    return x * math.sqrt(2.0), w / w.sum()


def _solve_tau(w_RE: torch.Tensor, K: int, eps_Q: torch.Tensor | None = None,
               g_Q: torch.Tensor | None = None, tau0_R: torch.Tensor | None = None,
               iters: int = 60, tol: float | None = None) -> torch.Tensor:
    """``tau_R`` with ``sum_e E_eps[1 - exp(-tau w_e eps)] = K`` (Newton, float64 or float32).

    ``1 - exp(-tau * w_e)`` is Rosen's approximation of the probability that expert ``e`` is
    among the top-k of a Plackett-Luce (successive sampling) draw with weights ``w``; it is
    accurate to about 1-2% for 128 experts, top-8 (measured in docs/traces.md). With
    ``eps_Q``/``g_Q`` the expectation over a multiplicative noise factor is a quadrature.
    The sum is concave increasing in tau and ``K / sum(w)`` lies below the root, so Newton
    clamped at that bound converges monotonically.
    """
    if eps_Q is not None:
        w_RE = w_RE.unsqueeze(-1) * eps_Q  # [R, E, Q]
        sw = (w_RE * g_Q).sum((-1, -2))
    else:
        sw = w_RE.sum(-1)
    lo_R = K / sw
    tau_R = lo_R if tau0_R is None else torch.maximum(tau0_R, lo_R)
    for _ in range(iters):
        t = tau_R.view(tau_R.shape + (1,) * (w_RE.dim() - tau_R.dim()))
        e = torch.exp(-t * w_RE)
        if eps_Q is not None:
            f = ((1 - e) * g_Q).sum((-1, -2)) - K
            df = (w_RE * e * g_Q).sum((-1, -2))
        else:
            f = (1 - e).sum(-1) - K
            df = (w_RE * e).sum(-1)
        tau_R = torch.maximum(tau_R - f / df, lo_R)
        if tol is not None and float(f.abs().max()) < tol:
            break
    return tau_R


def _inclusion(w_RE: torch.Tensor, K: int, eps_Q=None, g_Q=None,
               tau0_R: torch.Tensor | None = None) -> torch.Tensor:
    """Expected per-token inclusion probabilities ``[R, E]`` (sum K) of weights ``w_RE``."""
    tau_R = _solve_tau(w_RE, K, eps_Q, g_Q, tau0_R=tau0_R, tol=1e-10 * K)
    if eps_Q is None:
        return -torch.expm1(-tau_R.unsqueeze(-1) * w_RE)
    p = -torch.expm1(-tau_R[..., None, None] * w_RE.unsqueeze(-1) * eps_Q)
    return (p * g_Q).sum(-1)


def _cap_inclusion(pi_LE: torch.Tensor, K: int, cap: float) -> torch.Tensor:
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


def _resample_experts(share_E: torch.Tensor, E: int) -> torch.Tensor:
    """Resample one layer's expert shares (sum 1) from ``E0`` to ``E`` experts.

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
    fewer layers, repetition for more); experts are resampled by quantiles
    (:func:`_resample_experts`); shares are scaled to sum ``top_k`` and water-filled below
    ``min(0.95, ...)`` per expert. The returned tensor is cached: do not modify it.
    """
    _check_cfg(cfg)
    ref = qwen3_expert_heat()
    heat = ref.heat_LE.to(torch.float64) + _HEAT_FLOOR
    L0, E0 = heat.shape
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    src_l = torch.div(torch.arange(L) * 2 * L0 + L0, 2 * L, rounding_mode="floor")
    share = heat[src_l]
    share = share / share.sum(-1, keepdim=True)
    if E != E0:
        share = torch.stack([_resample_experts(row, E) for row in share])
    cap = _PI_CAP if K / E <= 0.9 else (1 + K / E) / 2
    return _cap_inclusion(share * K, K, cap)


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
    eps_Q: torch.Tensor          # float64, lognormal noise factors at the quadrature nodes
    g_Q: torch.Tensor            # float64, quadrature weights


@functools.lru_cache(maxsize=32)
def _model(cfg: TraceConfig) -> _Model:
    """Task multipliers and the base calibrated so the task mixture hits the target.

    Fixed point in hazard space: with ``pi_mix = sum_a share_a E_eps[pi(b * m_a * eps)]``
    (token-weighted task shares, Rosen inclusion, quadrature over the sample noise), update
    ``b *= -log(1 - pi*) / -log(1 - pi_mix)`` until ``pi_mix == pi*`` (rel. 1e-6).
    """
    L, E, K, A = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tasks
    target = base_inclusion_LE(cfg)
    g = _generator(cfg.seed, "tasks")
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
        x_Q, g_Q = _hermite_nodes(_NOISE_NODES)
        eps_Q = torch.exp(sigma * x_Q - sigma ** 2 / 2)
    else:
        eps_Q, g_Q = torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)

    h_target = -torch.log1p(-target)
    log_b = h_target.log()
    mult = log_mult.exp()
    for _ in range(500):
        pi_mix = (share * _inclusion((log_b.exp() * mult).view(A * L, E), K, eps_Q, g_Q)
                  .view(A, L, E)).sum(0)
        step = h_target.log() - (-torch.log1p(-pi_mix.clamp(max=1 - 1e-12))).log()
        log_b = log_b + step
        if step.abs().max() < 1e-7:
            break
    log_b = log_b - log_b.mean(-1, keepdim=True)  # scale is free: keep numbers moderate
    return _Model(log_b, log_mult, mix, eps_Q, g_Q)


@dataclass(frozen=True)
class _StepState:
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
            g = _generator(cfg.seed, "drift", x)
            d_ALE = rho * d_ALE + innov * torch.randn(A, L, E, generator=g, dtype=torch.float64)
            d_A = rho * d_A + innov * torch.randn(A, generator=g, dtype=torch.float64)
        yield d_ALE, d_A


def _state(cfg: TraceConfig, d_ALE: torch.Tensor, d_A: torch.Tensor) -> _StepState:
    m = _model(cfg)
    A, L, E = d_ALE.shape
    log_w = m.log_base_LE + m.log_mult_ALE + cfg.drift_sigma * d_ALE
    mix = m.mix_A * torch.exp(cfg.mix_drift_sigma * d_A)
    tau = _solve_tau(log_w.exp().view(A * L, E), cfg.top_k, m.eps_Q, m.g_Q, tol=1e-10 * cfg.top_k)
    return _StepState(log_w, mix / mix.sum(), tau.view(A, L))


def _iter_step_states(cfg: TraceConfig, num_steps: int) -> Iterator[_StepState]:
    """Model states of steps ``0 .. num_steps-1``."""
    for d_ALE, d_A in _iter_drift(cfg, num_steps):
        yield _state(cfg, d_ALE, d_A)


def _step_state(cfg: TraceConfig, step: int) -> _StepState:
    for d_ALE, d_A in _iter_drift(cfg, step + 1):
        pass
    return _state(cfg, d_ALE, d_A)


def task_inclusion_ALE(cfg: TraceConfig, step: int = 0) -> torch.Tensor:
    """Expected per-token inclusion probabilities float64 ``[A, L, E]`` of each task at ``step``.

    Averaged over the per-sample noise; each row sums to ``top_k``. Token-weighting these by
    task shares gives :func:`base_inclusion_LE` at step 0.
    """
    _check_cfg(cfg)
    _check_int("step", step, 0)
    m = _model(cfg)
    s = _step_state(cfg, step)
    A, L, E = s.log_w_ALE.shape
    return _inclusion(s.log_w_ALE.exp().view(A * L, E), cfg.top_k, m.eps_Q, m.g_Q).view(A, L, E)


# --------------------------------------------------------------------------------------
# samples


def _lognormal_lengths(median_N: torch.Tensor, sigma_N: torch.Tensor, lo: int, hi: int,
                       g: torch.Generator) -> torch.Tensor:
    z = torch.randn(median_N.shape, generator=g, dtype=torch.float64)
    x = torch.exp(median_N.log() + sigma_N * z)
    return x.round().clamp(lo, hi).to(torch.int64)


def _draw_samples(cfg: TraceConfig, mix_A: torch.Tensor, num: int, g: torch.Generator
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


def _sample_log_weights(cfg: TraceConfig, state: _StepState, task_N: torch.Tensor,
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
        from ..replay import RoutingReplay
        N = self.sample_task_N.numel()
        return RoutingReplay(self.routed_experts_TLK, self.sample_offsets_N1, self.num_experts,
                             model=model, sample_step=torch.full((N,), self.step, dtype=torch.int64),
                             sample_task=self.sample_task_N)

    def loads_LE(self) -> torch.Tensor:
        """int64 ``[L, E]``: tokens per (layer, expert) over the whole trace."""
        T, L, K = self.routed_experts_TLK.shape
        E = self.num_experts
        flat = self.routed_experts_TLK.to(torch.int64) + torch.arange(L).view(1, L, 1) * E
        return torch.bincount(flat.reshape(-1), minlength=L * E).view(L, E)


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
    pi_RE = _cap_inclusion(pi_RE.to(torch.float64), K, 1.0 - 1e-6)
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

    Returns ``lut_LQ`` (int64: the last interval starting at or before ``b / Q``) and
    ``next_LE`` (float32: each interval's end, 2.0 for the last), so the interval of ``u`` is
    ``lut[floor(u Q)]`` advanced while ``next <= u``.
    """
    L, E = starts_LE.shape
    Q = _LUT_BUCKETS
    first_bucket = torch.ceil(starts_LE * Q).long()  # start s <= b / Q  <=>  ceil(s Q) <= b
    hist = torch.zeros(L, Q + 1, dtype=torch.int64, device=starts_LE.device)
    hist.scatter_add_(1, first_bucket, torch.ones_like(first_bucket))
    lut_LQ = hist.cumsum_(1)[:, :Q].sub_(1)
    next_LE = torch.cat([starts_LE[:, 1:], torch.full((L, 1), 2.0, device=starts_LE.device)], 1)
    return lut_LQ, next_LE


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
    _check_cfg(cfg)
    _check_int("num_samples", num_samples, 1)
    _check_int("step", step, 0)
    if method not in _ROUTING_METHODS:
        raise ValueError(f"method={method!r} is invalid; allowed: {_ROUTING_METHODS}")
    device = torch.device("cpu" if device is None else device)
    L, E, K = cfg.num_layers, cfg.num_experts, cfg.top_k
    state = _step_state(cfg, step)
    g_samples = _generator(cfg.seed, "routing-samples", step)
    n_draw = -(-num_samples // cfg.group_size) * cfg.group_size
    drawn_task_N, prompt_N, response_N = _draw_samples(cfg, state.mix_A, n_draw, g_samples)
    task_N, prompt_N = drawn_task_N[:num_samples], prompt_N[:num_samples]
    length_N = prompt_N + response_N[:num_samples]
    offsets_N1 = torch.zeros(num_samples + 1, dtype=torch.int64)
    torch.cumsum(length_N, 0, out=offsets_N1[1:])
    T = int(offsets_N1[-1])
    out_TLK = torch.empty(T, L, K, dtype=torch.int16)

    g_noise = _generator(cfg.seed, "routing-noise", step)
    g_tables = _generator(cfg.seed, "routing-tables", step)
    g_tokens = _generator(cfg.seed, "routing-tokens", method, step, device=device)
    if method == "gumbel":
        chunk_tokens = max(1, _KEY_CHUNK_ELEMS // (L * E))
    else:
        chunk_tokens = max(1, _KEY_CHUNK_ELEMS // (L * K))
    tau_AL = state.tau_AL.to(torch.float32)
    lengths = length_N.tolist()
    offsets = offsets_N1.tolist()
    i = 0
    # Noise is drawn for whole groups (drawn_task_N); members past num_samples are unused.
    for log_w_nLE in _sample_log_weights(cfg, state, drawn_task_N, g_noise):
        n_here = min(log_w_nLE.shape[0], num_samples - i)
        if n_here <= 0:
            break
        log_w_nLE = log_w_nLE[:n_here]
        if method == "gumbel":
            inv_w_nLE = torch.exp(-log_w_nLE).to(device)
        else:
            pi_nLE = _sample_inclusion(log_w_nLE.exp(), K, tau_AL[task_N[i:i + n_here]])
            starts, table = _systematic_tables(pi_nLE.view(n_here * L, E), K, g_tables)
            starts = starts.to(torch.float32).view(n_here, L, E).to(device)
            table = table.to(torch.int16).view(n_here, L, E, K).to(device)
        for j in range(n_here):
            n, off = lengths[i], offsets[i]
            if method == "systematic":
                lut_LQ, next_LE = _interval_lut(starts[j])
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
                    interval_Lc = lut_LQ.gather(1, (u_Lc * _LUT_BUCKETS).long())
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


def _pack(lengths: list[int], budget: int, num_bins: int, start_bin: int,
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


def _bin_counts(p_RE: torch.Tensor, tokens_R: torch.Tensor, K: int,
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


def _sample_inclusion(w_nLE: torch.Tensor, K: int, tau0_nL: torch.Tensor,
                      iters: int = _SAMPLE_NEWTON_ITERS) -> torch.Tensor:
    """Rosen inclusion ``1 - exp(-tau w)`` per sample and layer (float32, rows sum to ~K).

    Newton from the task-level tau; two steps leave |sum - K| < 1e-3 for the default model
    (measured), a third costs time for nothing the counts can show.
    """
    E = w_nLE.shape[-1]
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
    _check_cfg(cfg)
    M = _check_int("num_micro_batches", num_micro_batches, 1)
    S = _check_int("num_ranks", num_ranks, 1)
    budget = _check_int("tokens_per_micro_batch_per_rank", tokens_per_micro_batch_per_rank, 1)
    X = _check_int("steps", steps, 1)
    L, E, K, A = cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.num_tasks
    G = cfg.group_size
    B = M * S
    block = max(G, (_DRAW_BLOCK // G) * G)

    loads = torch.empty(X, M, L, S, E, dtype=torch.int64)
    tokens_XMS = torch.zeros(X, M, S, dtype=torch.int64)
    task_tokens = torch.zeros(X, M, S, A, dtype=torch.int64)
    all_len, all_task, all_bin, mixes = [], [], [], []
    for x, state in enumerate(_iter_step_states(cfg, X)):
        mixes.append(state.mix_A)
        g_samples = _generator(cfg.seed, "loads-samples", x)
        tasks_parts, len_parts, bin_parts = [], [], []
        b, fill = 0, 0
        while b < B:
            task_N, prompt_N, response_N = _draw_samples(cfg, state.mix_A, block, g_samples)
            length_N = (prompt_N + response_N).clamp(max=budget)
            bins, b, fill = _pack(length_N.tolist(), budget, B, b, fill)
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
        g_noise = _generator(cfg.seed, "loads-noise", x)
        tau_AL = state.tau_AL.to(torch.float32)
        start = 0
        for log_w in _sample_log_weights(cfg, state, task_N, g_noise):
            n = log_w.shape[0]
            t = task_N[start:start + n]
            bins = bin_N[start:start + n]
            pi = _sample_inclusion(log_w.exp_(), K, tau_AL[t])
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
        g_counts = _generator(cfg.seed, "loads-counts", x)
        p_RE, tok_R = acc_BLE.view(B * L, E), tok_B.repeat_interleave(L)
        counts = torch.cat([_bin_counts(p_RE[r:r + _COUNT_ROWS], tok_R[r:r + _COUNT_ROWS], K, g_counts)
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


# --------------------------------------------------------------------------------------
# statistics


def max_over_mean(loads_E: torch.Tensor) -> torch.Tensor:
    """float64 ``[...]``: max over the last (expert) dim / mean over it, for ``[..., E]`` counts."""
    x = loads_E.to(torch.float64)
    return x.amax(-1) / x.mean(-1)
