"""Move expert rows between placements: reordering, and logical <-> physical conversion.

Legend: E logical experts, G EP ranks, El = E / G native experts per rank, X row payload.

A placement maps every logical expert to a physical native slot ``p`` in ``[0, E)``; rank
``p // El`` stores it at local row ``p % El``. Moving from one placement to another is one
all-to-all of rows (weights, gradients, optimizer state alike). The logical (checkpoint)
order is the identity placement, so the same primitive converts between the physical
layout and a logically ordered, evenly sharded one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_to_all_rows

__all__ = ["move_expert_rows", "native_experts"]


def native_experts(placement_E: torch.Tensor, experts_per_gpu: int, rank: int) -> torch.Tensor:
    """int64 ``[El]``: the logical expert stored at each local row of ``rank``."""
    inverse_E = torch.empty_like(placement_E)
    inverse_E[placement_E] = torch.arange(placement_E.numel())
    return inverse_E[rank * experts_per_gpu : (rank + 1) * experts_per_gpu].clone()


def move_expert_rows(local_ElX: torch.Tensor, old_placement_E: torch.Tensor,
                     new_placement_E: torch.Tensor, rank: int,
                     group: dist.ProcessGroup | None) -> torch.Tensor:
    """Rows of ``local_ElX`` (stored under ``old_placement_E``) rearranged for ``new_placement_E``.

    Args:
        local_ElX: ``[El, ...]`` this rank's rows in the old physical order.
        old_placement_E / new_placement_E: int64 ``[E]`` permutations (CPU).
        rank: this rank in ``group``.
        group: EP process group, ``None`` for one rank (``El = E``).

    Returns:
        ``[El, ...]`` this rank's rows under the new placement (a new tensor). Every rank of
        the group must call it with the same placements. Not differentiable.
    """
    El = local_ElX.shape[0]
    E = old_placement_E.numel()
    G = E // El
    src_E, dst_E = old_placement_E // El, new_placement_E // El
    # Send in (destination rank, destination row) order, which is the new physical slot.
    mine = (src_E == rank).nonzero().flatten()
    send_e = mine[new_placement_E[mine].argsort()]
    # Receive source-major; inside a source, in the order that source sent (new slot).
    theirs = (dst_E == rank).nonzero().flatten()
    recv_e = theirs[(src_E[theirs] * E + new_placement_E[theirs]).argsort()]
    send_sizes = torch.bincount(dst_E[send_e], minlength=G).tolist()
    recv_sizes = torch.bincount(src_E[recv_e], minlength=G).tolist()
    device = local_ElX.device
    send = local_ElX.index_select(0, (old_placement_E[send_e] % El).to(device))
    recv = all_to_all_rows(send, send_sizes, recv_sizes, group)
    out = torch.empty_like(local_ElX)
    out[(new_placement_E[recv_e] % El).to(device)] = recv
    return out
