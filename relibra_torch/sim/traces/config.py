"""Configuration of the synthetic RL trace model (:class:`TraceConfig`).

See :mod:`relibra_torch.sim.traces` for the model and docs/traces.md for its equations.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...checks import check_int, check_number, describe

__all__ = ["TraceConfig", "check_cfg", "DEFAULT_HOT_EXPERTS"]

# Hot experts per task and layer when ``hot_experts_per_task`` is not given: this many, but
# at most ``num_experts`` (see :class:`TraceConfig`).
DEFAULT_HOT_EXPERTS = 8


def _fail(name: str, value, allowed: str, exc=ValueError):
    if exc is TypeError:
        raise TypeError(f"TraceConfig.{name} is {describe(value)}; allowed: {allowed}")
    raise exc(f"TraceConfig.{name} = {value!r}; allowed: {allowed}")


@dataclass(frozen=True)
class TraceConfig:
    """Configuration of the synthetic RL trace model (all fields validated).

    Shape: ``num_layers`` MoE layers of ``num_experts`` experts, ``top_k`` per token
    (``1 <= top_k <= num_experts``; ``top_k == num_experts``: every token takes every expert,
    so every count equals the tokens and the other expert fields have no effect).

    Tasks: ``tasks`` names the task types; every per-task tuple below has one entry per
    task. ``task_weights`` are the sample mixing weights (normalised internally).

    Lengths (tokens): prompt and response lengths are lognormal with the given median and
    log-space sigma, rounded and clipped to ``[min_*, max_*]``; a sample is prompt + response.

    Experts: per task and layer, ``hot_experts_per_task`` experts (drawn with probability
    proportional to ``base_inclusion ** hot_bias``) get their weight multiplied by
    ``hot_strength[task]``; in addition every (task, layer, expert) weight is multiplied by
    ``exp(task_spread * z)``, ``z ~ N(0, 1)``, a smooth task affinity. The base is then
    calibrated so that the task mixture reproduces the reference heat.
    ``hot_experts_per_task=None`` (the default) means ``min(8, num_experts)``
    (:data:`DEFAULT_HOT_EXPERTS`): 8 for every model with 8 or more experts, as always, and
    every expert of a smaller model. A hot set of all ``E`` experts multiplies a task's
    weights by one constant, which changes nothing (inclusion only depends on weight
    ratios), so with ``E <= 8`` tasks differ only through ``task_spread``, as they already
    did for 8-expert models. An explicit value must lie in ``[0, num_experts]``.

    Samples: each sample's weights get a lognormal factor (mean 1) per (layer, expert):
    ``group_noise`` is shared by the ``group_size`` responses of one prompt (GRPO groups;
    they also share task and prompt length), ``sample_noise`` is per response.

    Drift across optimizer steps: log expert multipliers and log task weights follow
    stationary AR(1) processes started at 0 in step 0, with stationary sigma
    ``drift_sigma`` / ``mix_drift_sigma`` and step-to-step correlation ``drift_correlation``.

    Skew: ``skew`` is the exponent on the step's expert weights (base x task multiplier x
    drift, before the per-sample noise): ``w ** skew``. ``1`` is the calibrated trace (bit for
    bit), ``0`` makes every expert equally likely up to sample noise, values above 1 sharpen
    the hot experts. docs/traces.md lists the static imbalance each value gives.

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
    hot_experts_per_task: int | None = None
    hot_strength: tuple[float, ...] = (4.0, 4.0, 3.0, 2.5)
    hot_bias: float = 0.5
    task_spread: float = 0.6
    sample_noise: float = 0.4
    group_size: int = 1
    group_noise: float = 0.3
    drift_sigma: float = 0.3
    drift_correlation: float = 0.9
    mix_drift_sigma: float = 0.2
    skew: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        def as_int(name: str, lo: int, hi: int | None = None) -> int:
            return check_int(f"TraceConfig.{name}", getattr(self, name), lo, hi)

        def as_float(name: str, lo: float, hi: float) -> float:
            v = check_number(f"TraceConfig.{name}", getattr(self, name), lo, maximum=hi)
            object.__setattr__(self, name, v)
            return v

        as_int("num_layers", 1)
        E = as_int("num_experts", 2, 32767)  # ids are stored as int16
        as_int("top_k", 1, E)
        if self.hot_experts_per_task is None:
            object.__setattr__(self, "hot_experts_per_task", min(DEFAULT_HOT_EXPERTS, E))
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
        as_float("skew", 0.0, 4.0)

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def noise_sigma(self) -> float:
        """Log-space sigma of a sample's total noise factor (group and sample parts)."""
        return math.sqrt(self.group_noise ** 2 + self.sample_noise ** 2)




def check_cfg(cfg) -> None:
    """``TypeError`` unless ``cfg`` is a :class:`TraceConfig` (the generators' first argument)."""
    if not isinstance(cfg, TraceConfig):
        raise TypeError(f"cfg is {type(cfg).__name__}; allowed: a TraceConfig")
