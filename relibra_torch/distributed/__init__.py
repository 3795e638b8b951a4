"""Autograd-aware collectives for expert parallelism.

* :mod:`.collectives` -- row all-to-all with sizes from the plan (and its autograd form);
* :mod:`.replicas` -- filling replica slots from the owners, gradients sent home (kept or
  re-fetched in backward), replica-memory measurement;
* :mod:`.migration` -- moving expert rows between placements (reordering, checkpoints);
* :mod:`.mesh` -- the EP group of a ``DeviceMesh``.

The host-side schedule (``LayerPlan``, ``RankSchedule``, ...) is in
:mod:`relibra_torch.moe.schedule`: this package sits below the layer and never imports it.
"""

from .collectives import all_to_all_autograd, all_to_all_rows
from .mesh import EPGroup, ep_group_from_mesh
from .migration import move_expert_rows, native_experts
from .replicas import (FillSpec, ReplicaMemory, fetch_replica_weights, refetch_replica_ffn,
                       return_replica_grads)

__all__ = [
    "EPGroup", "FillSpec", "ReplicaMemory", "all_to_all_autograd", "all_to_all_rows", "ep_group_from_mesh",
    "fetch_replica_weights", "move_expert_rows", "native_experts", "refetch_replica_ffn",
    "return_replica_grads",
]
