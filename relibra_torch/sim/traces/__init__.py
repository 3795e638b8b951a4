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
the Qwen3-30B-A3B whole-trace heat of ``../shared/data`` (merged into coarser experts and
compressed for fewer experts, resampled for more), so the whole-trace per-layer max/mean of
generated data matches the real model's. See
``docs/traces.md`` for the model, its equations and measured figures.

The package splits by job: :mod:`.config` (:class:`TraceConfig`), :mod:`.model` (the
statistical model: calibrated popularity, drift, per-sample weights), :mod:`.tokens` (the
token-level generator) and :mod:`.loads` (the count generator). Every public name is
importable from ``relibra_torch.sim.traces``.

Legend: T tokens, L layers, K top-k, E experts, N samples, A tasks, H Gauss-Hermite nodes,
X steps, M micro-batches, S source ranks, B packed bins (one rank's micro-batch of a step),
R rows (any flattened leading dims).
"""

from __future__ import annotations

from ...replay.baseline import uniform_max_over_mean  # re-exported: the one implementation
from .config import TraceConfig
from .loads import SyntheticLoads, generate_load_trace, generate_loads, max_over_mean
from .model import base_inclusion_LE, task_inclusion_ALE
from .tokens import SyntheticRouting, generate_routing

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
