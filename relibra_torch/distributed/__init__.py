"""Autograd-aware collectives for expert parallelism.

* :mod:`.collectives` -- row all-to-all with sizes from the plan (and its autograd form);
* :mod:`.schedule` -- :class:`LayerPlan` (one layer, one micro-batch) and the per-rank
  :class:`RankSchedule` derived from it on the host;
* :mod:`.replicas` -- filling replica slots from the owners, gradients sent home,
  replica-memory measurement;
* :mod:`.migration` -- moving expert rows between placements (reordering, checkpoints);
* :mod:`.mesh` -- the EP group of a ``DeviceMesh``.
"""

from .collectives import all_to_all_autograd, all_to_all_rows
from .mesh import EPGroup, ep_group_from_mesh
from .migration import move_expert_rows, native_experts
from .replicas import FillSpec, ReplicaMemory, fetch_replica_weights, fill_replicas, return_replica_grads
from .schedule import (LayerPlan, RankSchedule, assign_slots, build_rank_schedule, check_layer_plan,
                       check_placement, group_permutation, layer_plans, native_layer_plan)

__all__ = [
    "EPGroup", "FillSpec", "LayerPlan", "RankSchedule", "ReplicaMemory", "all_to_all_autograd",
    "all_to_all_rows", "assign_slots", "build_rank_schedule", "check_layer_plan", "check_placement",
    "ep_group_from_mesh", "fetch_replica_weights", "fill_replicas", "group_permutation", "layer_plans",
    "move_expert_rows", "native_experts", "native_layer_plan", "return_replica_grads",
]
