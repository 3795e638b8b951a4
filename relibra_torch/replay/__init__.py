"""Routing replay: file formats, validation, converters, token counts.

* ``relibra.routing/1`` files hold the rollout's expert ids per token and layer
  (:class:`RoutingReplay`, :func:`save_routing`, :func:`load_routing`,
  :func:`validate_routing`);
* ``relibra.loads/1`` files hold already-batched counts ``[steps, M, L, S, E]``
  (:func:`save_loads`, :func:`load_loads`, :func:`validate_loads`);
* converters from verl and slime/SGLang layouts (:func:`from_verl`, :func:`from_per_sample`);
* token counts for an assignment of samples to (source rank, micro-batch)
  (:meth:`RoutingReplay.counts`, :func:`batch_samples`, :func:`counts_for_tokens`);
* the rollout side: :class:`RoutingRecorder` records every MoE layer's expert ids during
  generation (KV-cache decoding included) and writes replay files; exploration routing
  (:class:`ExplorationConfig`, :func:`explore_topk`) picks ESRL-style paths for rollouts.

See docs/replay.md.
"""

from .baseline import uniform_max_over_mean
from .explore import (
    ExplorationConfig,
    ExplorationPolicy,
    exploration_sigma,
    explore_topk,
    resolve_pool,
    routing_entropy,
)
from .convert import from_per_sample, from_sglang, from_slime, from_verl
from .loads import LOADS_FORMAT, LoadsFile, load_loads, save_loads, tokens_from_loads, validate_loads
from .recorder import MoELayerRef, RoutingRecorder, find_moe_layers, layout_for_batch
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
    "ExplorationConfig",
    "ExplorationPolicy",
    "MoELayerRef",
    "RoutingRecorder",
    "exploration_sigma",
    "explore_topk",
    "find_moe_layers",
    "layout_for_batch",
    "resolve_pool",
    "routing_entropy",
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
