"""Fill replica slots with their owners' expert weights; send replica gradients home.

Legend: El native experts per GPU, Fs fills this rank serves (weight rows it sends), Fr
fills it receives, G ranks of the EP group.

A fill copies an owner's expert weights into another GPU's slot. The copy is a plain
buffer, never a parameter: its gradient goes back to the owner, which sums it into the
parameter's gradient (``index_add``, so an expert replicated to several GPUs gets all
contributions). Kept replicas (filled once per residency, gradients home once) are
``relibra_torch.moe.residents``; here are the exchanges and the re-fetching variant that
keeps nothing between forward and backward. Any plan is executed, across nodes too.

:class:`ReplicaMemory` measures how many replica-buffer bytes (weights and accumulated
gradients) are alive on this GPU: its finalizers run when the buffers are freed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .collectives import all_to_all_rows

__all__ = ["FillSpec", "ReplicaMemory", "exchange_replica_rows", "fetch_replica_weights",
           "refetch_replica_ffn", "return_replica_grads"]


@dataclass(frozen=True)
class FillSpec:
    """Who sends which native rows where (from :class:`RankSchedule`).

    Attributes:
        send_idx: int64 ``[Fs]`` local native rows this rank sends, in send order.
        send_sizes / recv_sizes: ``[G]`` weight rows sent to / received from every rank.
        group: EP process group (``None``: single rank, no fills possible).
    """

    send_idx: torch.Tensor
    send_sizes: list[int]
    recv_sizes: list[int]
    group: dist.ProcessGroup | None


class ReplicaMemory:
    """Live and peak bytes of replica buffers on this GPU; share one across layers.

    ``live_bytes`` rises when a fill allocates buffers and falls when they are freed;
    ``peak_bytes`` is the maximum since construction or :meth:`reset_peak`.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0

    def track(self, tensor: torch.Tensor) -> None:
        """Count the bytes of ``tensor``'s storage until the storage is freed.

        The storage, not the tensor object, is followed: views of it saved for backward
        keep it alive until the backward that used them has run.
        """
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._release, nbytes)

    def _release(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def reset_peak(self) -> None:
        """Start a new peak measurement from the bytes alive now."""
        self.peak_bytes = self.live_bytes


def _flat_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(t.shape[0], t[0].numel() if t.shape[0] else int(torch.Size(t.shape[1:]).numel()))
                      for t in tensors], dim=1)


def _split_rows(flat_RX: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    sizes = [int(torch.Size(s[1:]).numel()) for s in shapes]
    parts = flat_RX.split(sizes, dim=1)
    return [p.reshape(flat_RX.shape[0], *s[1:]) for p, s in zip(parts, shapes)]


def fetch_replica_weights(weights: Sequence[torch.Tensor], spec: FillSpec,
                          memory: ReplicaMemory | None = None) -> list[torch.Tensor]:
    """Send this rank's served rows and receive its fills (not differentiable).

    Args:
        weights: local native weights, each ``[El, ...]``, one dtype.
        spec: the fill exchange.
        memory: optional tracker the received buffers are counted in (until freed).

    Returns:
        one buffer ``[Fr, ...]`` per weight, rows in receive order (owner, slot): views into
        one received block (no copy; the expert GEMMs take strided weights).
    """
    shapes = [w.shape for w in weights]
    send = _flat_rows([w.detach().index_select(0, spec.send_idx) for w in weights])
    recv = all_to_all_rows(send, spec.send_sizes, spec.recv_sizes, spec.group)
    if memory is not None:
        memory.track(recv)
    return _split_rows(recv, shapes)


def exchange_replica_rows(rows: Sequence[torch.Tensor], send_sizes: list[int], recv_sizes: list[int],
                          group, memory: ReplicaMemory | None = None) -> list[torch.Tensor]:
    """Send per-expert rows (kept weights or accumulated gradients) to other ranks and receive
    theirs: the second hop of two-hop replicas (``planning.two_hop``), hub to copies for
    weights and copies to hub for gradients (not differentiable).

    Args:
        rows: one tensor ``[Fs, ...]`` per weight (``Fs`` rows sent, by destination rank),
            one dtype.
        send_sizes / recv_sizes: ``[G]`` rows sent to / received from every rank.
        memory: optional tracker the received block is counted in (until freed).

    Returns:
        one tensor ``[Fr, ...]`` per weight, rows by source rank: views of one received block.
    """
    shapes = [r.shape for r in rows]
    recv = all_to_all_rows(_flat_rows([r.detach() for r in rows]).contiguous(), send_sizes, recv_sizes, group)
    if memory is not None:
        memory.track(recv)
    return _split_rows(recv, shapes)


def return_replica_grads(grads: Sequence[torch.Tensor], spec: FillSpec,
                         local_shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    """Send fill gradients to their owners; return each owner's summed native gradients.

    Args:
        grads: gradients of the received buffers, each ``[Fr, ...]``.
        spec: the same exchange the fill used (run in reverse).
        local_shapes: ``[El, ...]`` shapes of the native weights.

    Returns:
        ``[El, ...]`` gradients (zero for rows nobody replicated), one per weight.
    """
    send = _flat_rows(grads)
    recv = all_to_all_rows(send.contiguous(), spec.recv_sizes, spec.send_sizes, spec.group)
    out = []
    for part, shape in zip(_split_rows(recv, local_shapes), local_shapes):
        out.append(part.new_zeros(shape).index_add_(0, spec.send_idx.to(part.device), part))
    return out


class _RefetchReplicaFFN(torch.autograd.Function):
    """Replica-slot experts that keep no replica weights between forward and backward.

    Forward fetches the fill weights, computes, and frees them. Backward fetches them again,
    recomputes the replica rows' forward (activation-checkpoint style) and sends the weight
    gradients home. Costs one more weight transfer and one more forward of the replica rows
    per micro-batch; saves the buffers' memory (and their activations) between passes.
    """

    @staticmethod
    def forward(ctx, ffn, x_RD, offsets_G, spec, memory, count, *weights):
        bufs = fetch_replica_weights(weights, spec, memory)
        if count is not None:
            count("fetch", bufs)
        with torch.no_grad():
            y_RD = ffn(x_RD, *bufs, offsets_G)
        ctx.save_for_backward(x_RD, offsets_G, *weights)
        ctx.ffn, ctx.spec, ctx.memory, ctx.count = ffn, spec, memory, count
        return y_RD

    @staticmethod
    def backward(ctx, grad_y_RD):
        x_RD, offsets_G, *weights = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        need_w = any(ctx.needs_input_grad[6:])
        bufs = fetch_replica_weights(weights, ctx.spec, ctx.memory)
        if ctx.count is not None:
            ctx.count("fetch", bufs)
        with torch.enable_grad():
            xd = x_RD.detach().requires_grad_(need_x)
            bd = [b.detach().requires_grad_(need_w) for b in bufs]
            y = ctx.ffn(xd, *bd, offsets_G)
            inputs = ([xd] if need_x else []) + (bd if need_w else [])
            grads = torch.autograd.grad(y, inputs, grad_y_RD, allow_unused=True) if inputs else []
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]
        grad_x = grads.pop(0) if need_x else None
        grad_w = [None] * len(weights)
        if need_w:
            # returned in fp32 or wider, like kept replicas' gradients (the owner's main grads)
            grads = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in grads]
            if ctx.count is not None:
                ctx.count("return", grads)
            grad_w = return_replica_grads(grads, ctx.spec, [w.shape for w in weights])
        return (None, grad_x, None, None, None, None, *grad_w)


def refetch_replica_ffn(ffn, x_RD: torch.Tensor, offsets_G: torch.Tensor, spec: FillSpec,
                        memory: ReplicaMemory | None, weights: Sequence[torch.Tensor],
                        count=None) -> torch.Tensor:
    """``ffn(x_RD, *fill buffers, offsets_G)`` with the fill buffers fetched again in backward.

    Args:
        ffn: the grouped expert function ``(x_RD, *weights_G, offsets_G) -> y_RD``.
        x_RD: rows of the filled slots, grouped; offsets_G: int32 cumulative group ends.
        weights: the layer's native expert weights (the owners' rows are sent from them).
        count: optional ``count(what, tensors)`` called for each exchange, ``what`` being
            ``"fetch"`` (the received weight buffers) or ``"return"`` (the gradients sent).
    Every rank of the group must call this when any rank receives a fill. Gradients go home
    in fp32 (or the weights' dtype if wider).
    """
    return _RefetchReplicaFFN.apply(ffn, x_RD, offsets_G, spec, memory, count, *weights)
