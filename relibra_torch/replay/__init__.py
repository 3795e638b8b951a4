"""Routing replay, the data layer: file formats, validation, converters, token counts.

* ``relibra.routing/1`` files hold the rollout's expert ids per token and layer
  (:class:`RoutingReplay`, :func:`save_routing`, :func:`load_routing`,
  :func:`validate_routing`);
* ``relibra.loads/1`` files hold already-batched counts ``[steps, M, L, S, E]``
  (:func:`save_loads`, :func:`load_loads`, :func:`validate_loads`);
* converters from verl and slime/SGLang layouts (:func:`from_verl`, :func:`from_per_sample`);
* token counts (:mod:`.counts`, the one implementation of ids -> loads in the package, and
  expert-id checks), and for an assignment of samples to (source rank, micro-batch)
  (:meth:`RoutingReplay.counts`, :func:`batch_samples`, :func:`counts_for_tokens`);
* public format helpers for other readers of these files (:mod:`.fileio`).

This package is the bottom of the stack: it imports nothing from the layer, ops,
distributed, the simulator, the hook or the rollout tools. The rollout tools
(:class:`RoutingRecorder`, exploration routing) are in :mod:`relibra_torch.rollout`, above
this package, so ``import relibra_torch.replay`` never loads the layer, torchtitan or the
rollout package.

See docs/replay.md.
"""

from .baseline import uniform_max_over_mean
from .batching import SampleAssignment, batch_samples
from .convert import from_per_sample, from_sglang, from_slime, from_verl
from .counts import count_by_group, count_experts, count_micro_batches, validate_expert_ids
from .loads import LOADS_FORMAT, LoadsFile, load_loads, save_loads, tokens_from_loads, validate_loads
from .routing import (
    ROUTING_FORMAT,
    RoutingReplay,
    counts_for_tokens,
    load_routing,
    save_routing,
    validate_routing,
)

__all__ = [
    "LOADS_FORMAT",
    "ROUTING_FORMAT",
    "LoadsFile",
    "RoutingReplay",
    "SampleAssignment",
    "batch_samples",
    "count_by_group",
    "count_experts",
    "count_micro_batches",
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
