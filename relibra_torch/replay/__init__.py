"""Routing replay: file formats, validation, converters, token counts.

* ``relibra.routing/1`` files hold the rollout's expert ids per token and layer
  (:class:`RoutingReplay`, :func:`save_routing`, :func:`load_routing`,
  :func:`validate_routing`);
* ``relibra.loads/1`` files hold already-batched counts ``[steps, M, L, S, E]``
  (:func:`save_loads`, :func:`load_loads`, :func:`validate_loads`);
* converters from verl and slime/SGLang layouts (:func:`from_verl`, :func:`from_per_sample`);
* token counts for an assignment of samples to (source rank, micro-batch)
  (:meth:`RoutingReplay.counts`, :func:`batch_samples`, :func:`counts_for_tokens`).

See docs/replay.md.
"""

from .baseline import uniform_max_over_mean
from .convert import from_per_sample, from_sglang, from_slime, from_verl
from .loads import LOADS_FORMAT, LoadsFile, load_loads, save_loads, tokens_from_loads, validate_loads
from .routing import (
    ROUTING_FORMAT,
    RoutingReplay,
    SampleAssignment,
    batch_samples,
    counts_for_tokens,
    load_routing,
    save_routing,
    validate_expert_ids,
    validate_routing,
)

__all__ = [
    "LOADS_FORMAT",
    "ROUTING_FORMAT",
    "LoadsFile",
    "RoutingReplay",
    "SampleAssignment",
    "batch_samples",
    "counts_for_tokens",
    "from_per_sample",
    "from_sglang",
    "from_slime",
    "from_verl",
    "load_loads",
    "load_routing",
    "save_loads",
    "save_routing",
    "tokens_from_loads",
    "uniform_max_over_mean",
    "validate_expert_ids",
    "validate_loads",
    "validate_routing",
]
