"""Trace families that ``relibra simulate --trace NAME`` can run: name -> generator.

Every generator has :func:`.loads.generate_load_trace`'s signature ``(cfg, num_micro_batches,
num_ranks, tokens_per_micro_batch_per_rank, steps)`` and returns :class:`.loads.SyntheticLoads`;
its parameters are one documented preset per family (docs/traces.md). ``default`` *is*
``generate_load_trace``, so the default trace is bit-identical to the one before families.
A new family is one more entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from .collapsed import generate_collapsed_trace
from .loads import generate_load_trace
from .rank_mix import generate_rank_mix_trace

__all__ = ["FAMILIES", "DEFAULT_FAMILY"]

DEFAULT_FAMILY = "default"

FAMILIES = {
    "default": generate_load_trace,
    "rank-mix": generate_rank_mix_trace,
    "collapsed": generate_collapsed_trace,
}
