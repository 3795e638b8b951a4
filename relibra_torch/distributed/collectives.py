"""Row all-to-all over an expert-parallel process group, with and without autograd.

Legend: R rows (tokens or experts), X flattened row payload, G ranks of the group.

:func:`all_to_all_packed` sends several row tensors of any dtypes (a token's hidden vector,
its gates, its slots) in one exchange, as DeepEP's dispatch sends a token with its top-k
indices and weights: one collective's latency instead of one per tensor.

Every size list comes from the caller (a plan both sides agree on), so no call here
exchanges counts first. ``group=None`` means a single rank: the exchange is the identity.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["all_to_all_rows", "all_to_all_autograd", "all_to_all_packed", "group_size"]


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


def _pack_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """uint8 ``[R, sum of each part's bytes per row]``: the parts' rows side by side."""
    R = parts[0].shape[0]
    return torch.cat([_row_bytes(p, R) for p in parts], dim=1)


def _row_bytes(p: torch.Tensor, R: int) -> torch.Tensor:
    width = p.element_size() * math.prod(p.shape[1:])
    if p.numel() == 0:  # an empty tensor may carry any strides; a byte view needs stride 1
        return torch.empty((R, width), dtype=torch.uint8, device=p.device)
    return p.contiguous().reshape(-1).view(torch.uint8).view(R, width)


def _unpack_rows(b_RB: torch.Tensor, like: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack_rows` for parts of the given ``(dtype, row shape)``."""
    R, out, start = b_RB.shape[0], [], 0
    for dtype, row_shape in like:
        t = torch.empty((R, *row_shape), dtype=dtype, device=b_RB.device)  # a base tensor, not a view
        width = t.element_size() * math.prod(row_shape)
        if t.numel():  # copy the bytes in: a column slice's offset need not suit the dtype's size
            t.view(-1).view(torch.uint8).view(R, width).copy_(b_RB[:, start:start + width])
        out.append(t)
        start += width
    return out


class _PackedAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, send_sizes, recv_sizes, group, on_collective, *parts):
        ctx.sizes = (list(send_sizes), list(recv_sizes))
        ctx.group, ctx.on_collective = group, on_collective
        ctx.like = [(p.dtype, tuple(p.shape[1:])) for p in parts]
        ctx.device = parts[0].device
        if on_collective is not None:
            on_collective()
        out = _unpack_rows(all_to_all_rows(_pack_rows(parts), send_sizes, recv_sizes, group), ctx.like)
        for o, p in zip(out, parts):
            if not p.is_floating_point():
                ctx.mark_non_differentiable(o)
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        send_sizes, recv_sizes = ctx.sizes
        need = [i for i, n in enumerate(ctx.needs_input_grad[4:]) if n]
        result = [None] * len(grads)
        if need:
            if ctx.on_collective is not None:
                ctx.on_collective()
            like = [ctx.like[i] for i in need]
            R = int(sum(recv_sizes))
            g = [grads[i].to(dt) if grads[i] is not None else torch.zeros((R, *row), dtype=dt, device=ctx.device)
                 for i, (dt, row) in zip(need, like)]
            # The gradient of a row exchange is the reverse exchange: every part's at once.
            back = _unpack_rows(all_to_all_rows(_pack_rows(g), recv_sizes, send_sizes, ctx.group), like)
            for i, t in zip(need, back):
                result[i] = t
        return (None, None, None, None, *result)


def all_to_all_packed(parts: Sequence[torch.Tensor], send_sizes: Sequence[int], recv_sizes: Sequence[int],
                      group: dist.ProcessGroup | None,
                      on_collective: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """:func:`all_to_all_autograd` of several row tensors in one exchange.

    Args:
        parts: tensors ``[R, ...]`` of any dtypes with the same rows ``R = sum(send_sizes)``
            (e.g. ``x_RD`` bf16, ``gates_RK`` fp32, ``slots_RK`` int64); their bytes travel
            side by side in one uint8 exchange.
    Returns:
        the parts' received rows ``[sum(recv_sizes), ...]``, same dtypes. Floating parts are
        differentiable: their gradients go back together in one reverse exchange (issued
        only when some part needs a gradient; ``on_collective`` is called for each exchange).
    """
    rows = {p.shape[0] for p in parts}
    if rows != {int(sum(send_sizes))}:
        raise ValueError(f"all_to_all_packed: every part needs sum(send_sizes) = {int(sum(send_sizes))} rows, "
                         f"got {sorted(rows) or 'no parts'}")
    if group is None:
        all_to_all_rows(parts[0], send_sizes, recv_sizes, None)  # checks the sizes
        return list(parts)
    return list(_PackedAllToAll.apply(send_sizes, recv_sizes, group, on_collective, *parts))
