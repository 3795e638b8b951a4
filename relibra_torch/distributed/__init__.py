"""Autograd-aware collectives for expert parallelism.

* :mod:`.collectives` -- row all-to-all with sizes from the plan (and its autograd form);
* :mod:`.replicas` -- filling replica slots from the owners, gradients sent home (kept or
  re-fetched in backward), replica-memory measurement;
* :mod:`.migration` -- moving expert rows between placements (reordering, checkpoints);
* :mod:`.mesh` -- the EP group of a ``DeviceMesh``.

The host-side schedule (``LayerPlan``, ``RankSchedule``, ...) moved to
:mod:`relibra_torch.moe.schedule`; its names are still importable from here.
"""

from .collectives import all_to_all_autograd, all_to_all_rows
from .mesh import EPGroup, ep_group_from_mesh
from .migration import move_expert_rows, native_experts
from .replicas import (FillSpec, ReplicaMemory, fetch_replica_weights, refetch_replica_ffn,
                       return_replica_grads)

_MOVED_TO_MOE_SCHEDULE = ("LayerPlan", "RankSchedule", "assign_slots", "build_rank_schedule", "check_layer_plan",
                          "check_placement", "group_permutation", "layer_plans", "native_layer_plan")

__all__ = [
    "EPGroup", "FillSpec", "ReplicaMemory", "all_to_all_autograd", "all_to_all_rows", "ep_group_from_mesh",
    "fetch_replica_weights", "move_expert_rows", "native_experts", "refetch_replica_ffn",
    "return_replica_grads", *_MOVED_TO_MOE_SCHEDULE,
]


def __getattr__(name: str):
    # Compatibility: resolved lazily so that this package never imports the layer package.
    if name in _MOVED_TO_MOE_SCHEDULE:
        from ..moe import schedule
        return getattr(schedule, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
