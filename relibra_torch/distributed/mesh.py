"""The expert-parallel group described by a ``DeviceMesh``.

A 2-D mesh is read as ``(node, gpu)`` (dims named ``("node", "gpu")`` by convention); a
1-D mesh is one node. Ranks of the EP group are node-major: EP rank ``n * g + i`` is GPU
``i`` of node ``n``, which is also the order of the expert shards (``Shard(0)`` on every
mesh dim splits the expert dim node-first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["EPGroup", "ep_group_from_mesh"]


@dataclass(frozen=True)
class EPGroup:
    """EP layout of this process: ``num_nodes x gpus_per_node`` ranks, this one ``rank``.

    ``group`` is ``None`` (and ``mesh`` too) on a single process without a mesh.
    """

    num_nodes: int
    gpus_per_node: int
    rank: int
    group: dist.ProcessGroup | None
    mesh: DeviceMesh | None

    @property
    def size(self) -> int:
        return self.num_nodes * self.gpus_per_node


def ep_group_from_mesh(mesh: DeviceMesh | None) -> EPGroup:
    """Read the EP layout of ``mesh`` (``None``: one process, no collectives)."""
    if mesh is None:
        return EPGroup(1, 1, 0, None, None)
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return EPGroup(1, mesh.size(), mesh.get_local_rank(), mesh.get_group(), mesh)
    if mesh.ndim != 2:
        raise ValueError(f"mesh must be 1-D (one node) or 2-D (node, gpu), got {mesh.ndim} dims "
                         f"{mesh.mesh_dim_names}; pass the EP sub-mesh")
    node, gpu = mesh.get_coordinate()
    flat = mesh._flatten()  # cached by the mesh: one process group however many layers
    group = flat.get_group()
    rank = node * mesh.size(1) + gpu
    if dist.get_rank(group) != rank:
        raise ValueError(f"flattened EP group rank {dist.get_rank(group)} is not the node-major "
                         f"rank {rank} of mesh coordinate {(node, gpu)}")
    return EPGroup(mesh.size(0), mesh.size(1), rank, group, mesh)
