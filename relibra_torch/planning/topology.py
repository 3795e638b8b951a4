"""Cluster topology for expert parallelism.

Legend: E experts, G = N * g GPUs (EP ranks, node-major), El = E / G native experts per
GPU, R replica slots per GPU, J = El + R slots per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_int

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """``num_nodes`` x ``gpus_per_node`` EP ranks hosting ``num_experts`` experts.

    Ranks are node-major: GPU ``r`` lives on node ``r // gpus_per_node``. Each GPU natively
    hosts ``experts_per_gpu = E / G`` experts (their parameters and optimizer state) and has
    ``replica_slots`` extra expert buffers filled per micro-batch.
    """

    num_nodes: int
    gpus_per_node: int
    num_experts: int
    replica_slots: int = 0

    def __post_init__(self) -> None:
        check_int("num_nodes", self.num_nodes, 1)
        check_int("gpus_per_node", self.gpus_per_node, 1)
        check_int("num_experts", self.num_experts, 1)
        check_int("replica_slots", self.replica_slots, 0)
        if self.num_experts % self.num_gpus:
            raise ValueError(
                f"num_experts={self.num_experts} is not divisible by the EP world size "
                f"num_nodes*gpus_per_node={self.num_gpus}; choose a world size that divides "
                f"the expert count"
            )

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def experts_per_gpu(self) -> int:
        return self.num_experts // self.num_gpus

    @property
    def slots_per_gpu(self) -> int:
        return self.experts_per_gpu + self.replica_slots

    @property
    def experts_per_node(self) -> int:
        return self.experts_per_gpu * self.gpus_per_node

    def node_of_gpu(self) -> torch.Tensor:
        """``[G]`` int64: the node of every GPU."""
        return torch.arange(self.num_gpus) // self.gpus_per_node

    def static_placement(self, num_layers: int) -> torch.Tensor:
        """``[L, E]`` int64: contiguous placement, expert ``e`` at native slot ``e``."""
        return torch.arange(self.num_experts).expand(num_layers, -1).clone()

    def moves_per_gpu(self, previous_placement_LE: torch.Tensor, placement_LE: torch.Tensor) -> torch.Tensor:
        """int64 ``[4, L, G]``: per layer, the experts each GPU sends and receives when the
        placement (int64 ``[L, E]`` native slots) changes from ``previous_placement_LE``: across
        nodes (send, receive), then to another GPU of its node (send, receive). An expert that
        keeps its GPU moves nothing. The cost model's migration and the planners' move prices
        read the same counts."""
        El, g = self.experts_per_gpu, self.gpus_per_node
        old_LE, new_LE = previous_placement_LE // El, placement_LE // El
        moved = old_LE != new_LE
        cross = moved & (old_LE // g != new_LE // g)
        intra = moved & ~cross
        out = torch.zeros(4, old_LE.shape[0], self.num_gpus, dtype=torch.int64)
        for k, (gpu_LE, mask) in enumerate(((old_LE, cross), (new_LE, cross), (old_LE, intra), (new_LE, intra))):
            out[k].scatter_add_(1, gpu_LE, mask.to(torch.int64))
        return out
