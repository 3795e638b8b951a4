"""Rollout tools: record the routing a rollout used, and explore routing paths.

* :class:`RoutingRecorder` records every MoE layer's expert ids during generation (KV-cache
  decoding included) and writes ``relibra.routing/1`` replay files (:mod:`.recorder`);
* exploration routing (:class:`ExplorationConfig`, :class:`ExplorationPolicy`,
  :func:`explore_topk`) picks ESRL-style paths for rollouts (:mod:`.explore`).

This package sits above the MoE layer (the recorder reads its layers, and torchtitan's when
installed); :mod:`relibra_torch.replay` below it is the pure data layer it writes to.

See docs/rollout.md.
"""

from .explore import (
    ExplorationConfig,
    ExplorationPolicy,
    exploration_sigma,
    explore_topk,
    resolve_pool,
    routing_entropy,
)
from .recorder import MoELayerRef, RoutingRecorder, find_moe_layers, layout_for_batch

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
]
