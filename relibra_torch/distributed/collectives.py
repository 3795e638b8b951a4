"""Row all-to-all over an expert-parallel process group, with and without autograd.

Legend: R rows (tokens or experts), X flattened row payload, G ranks of the group.

Every size list comes from the caller (a plan both sides agree on), so no call here
exchanges counts first. ``group=None`` means a single rank: the exchange is the identity.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "all_to_all_autograd", "group_size"]


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def all_to_all_rows(x_RX: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """Exchange rows: the first ``send_sizes[0]`` rows go to rank 0, the next to rank 1, ...

    Args:
        x_RX: ``[sum(send_sizes), ...]`` rows, grouped by destination rank.
        send_sizes: ``[G]`` rows sent to each rank.
        recv_sizes: ``[G]`` rows received from each rank (what the senders send here).
        group: the process group, or ``None`` for a single rank.

    Returns:
        ``[sum(recv_sizes), ...]`` rows grouped by source rank. Not differentiable; see
        :func:`all_to_all_autograd`.
    """
    if group is None:
        if list(send_sizes) != list(recv_sizes):
            raise ValueError(f"single-rank exchange needs send_sizes == recv_sizes, got "
                             f"{list(send_sizes)} and {list(recv_sizes)}")
        return x_RX
    out = x_RX.new_empty((int(sum(recv_sizes)), *x_RX.shape[1:]))
    dist.all_to_all_single(out, x_RX.contiguous(), output_split_sizes=list(recv_sizes),
                           input_split_sizes=list(send_sizes), group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RX, send_sizes, recv_sizes, group, on_collective):
        ctx.sizes = (list(send_sizes), list(recv_sizes))
        ctx.group = group
        ctx.on_collective = on_collective
        if on_collective is not None:
            on_collective()
        return all_to_all_rows(x_RX, send_sizes, recv_sizes, group)

    @staticmethod
    def backward(ctx, grad_RX):
        send_sizes, recv_sizes = ctx.sizes
        if ctx.on_collective is not None:
            ctx.on_collective()
        # The gradient of a row exchange is the reverse exchange.
        return all_to_all_rows(grad_RX.contiguous(), recv_sizes, send_sizes, ctx.group), None, None, None, None


def all_to_all_autograd(x_RX: torch.Tensor, send_sizes: Sequence[int], recv_sizes: Sequence[int],
                        group: dist.ProcessGroup | None,
                        on_collective: Callable[[], None] | None = None) -> torch.Tensor:
    """:func:`all_to_all_rows` whose backward sends the gradients back the same way.

    Every rank of ``group`` must call it (and, in backward, reach its backward) in the same
    order, as with any collective. ``on_collective`` (optional) is called once for each
    exchange issued, forward and backward (the layer's transfer counters).
    """
    if group is None:
        return all_to_all_rows(x_RX, send_sizes, recv_sizes, None)
    return _AllToAllRows.apply(x_RX, send_sizes, recv_sizes, group, on_collective)
