"""Replica buffers kept over a step: filled once per residency, gradients home once.

A *residency* (``relibra_torch.planning.residency``) is a run of consecutive micro-batches
in which a slot holds the same expert owned by another GPU. Its weights arrive in the
forward of its first micro-batch with tokens (``fill_mb``) and stay on the replica's GPU;
every micro-batch with tokens computes with them and adds its weight gradient to a buffer
on that GPU; the backward of its last micro-batch with tokens (``return_mb``) sends the sum
home, inside the layer's autograd graph, so the owner's ``.grad`` is complete when the last
``backward()`` returns. Backward must run per micro-batch in forward order (micro-batch 0
forward and backward, then 1, ...), as gradient accumulation does.

Every rank of the EP group keeps the same bookkeeping for *all* GPUs' slots (``held``,
``pending``, the micro-batches run forward and backward), updated by the same rules from
the same plan and the same sequence of calls, so all ranks agree on which collectives run
without exchanging anything; only the buffers themselves are per rank.

What can go wrong, and what happens:

* forward without backward (evaluation, ``torch.no_grad``): nothing accumulates; under
  ``no_grad`` a residency's buffers are freed after its last micro-batch with tokens; with
  autograd on they are freed when the residency ends (next plan);
* the step ends early, or backward runs out of order (e.g. one backward over the summed
  losses of several micro-batches): a gradient that would not reach its owner raises
  ``RuntimeError`` on every rank at the next plan install or in the backward that would
  send it, naming the layer's residencies; never a silent loss of gradient;
* activation recomputation: a forward run again reuses the kept buffers (fetched again,
  on every rank alike, if ``no_grad`` freed them).

Two-hop replicas (``planning.two_hop``, ``sched.hub_GJ``): a residency with a hub on its
node fills from the hub's kept buffer (NVLink) and in the backward of its return
micro-batch reduces its gradient into the hub's accumulator, so the hub sends the sum home
once: in the micro-batch's first-hop exchange when the hub was filled earlier (returns
later), else in an exchange after the first-hop fills (before the returns). A
second-hop fill whose hub holds nothing (a re-fetch after ``no_grad`` freed the hub)
comes from the owner instead, and its gradient then goes to the owner too.

Legend: G GPUs, J slots per GPU, El native experts per GPU, Fr fills this rank computes.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..distributed.replicas import (FillSpec, ReplicaMemory, exchange_replica_rows, fetch_replica_weights,
                                    return_replica_grads)
from .schedule import RankSchedule, fill_exchange

__all__ = ["ResidentReplicas"]


class _Entry:
    """This rank's buffers of one residency in slot ``j``."""

    __slots__ = ("fill_mb", "bufs", "acc")

    def __init__(self, fill_mb: int, bufs: list[torch.Tensor]):
        self.fill_mb = fill_mb
        self.bufs: list[torch.Tensor] | None = bufs
        self.acc: list[torch.Tensor] | None = None


class ResidentReplicas:
    """Kept replica buffers of one layer on one rank (see the module docstring).

    Args:
        topology: the layer's topology (``G`` GPUs, ``J`` slots, ``g`` GPUs per node).
        rank: this EP rank.
    """

    def __init__(self, topology, rank: int):
        G, J = topology.num_gpus, topology.slots_per_gpu
        self.G, self.J, self.g, self.rank = G, J, topology.gpus_per_node, rank
        # host bookkeeping (explicitly on the CPU: models are often built under a meta device)
        self.held_GJ = torch.full((G, J), -1, dtype=torch.int64, device="cpu")  # fill_mb held
        self.return_GJ = torch.full_like(self.held_GJ, -1)                      # its return_mb
        self.pending_GJ = torch.zeros(G, J, dtype=torch.bool, device="cpu")     # gradient not home
        self.via_GJ = torch.full_like(self.held_GJ, -1)                         # hub filled from
        self.entries: dict[int, _Entry] = {}
        self.last_mb: int | None = None
        self.forward_mbs: set[int] = set()
        self.backward_mbs: set[int] = set()

    # ---------------------------------------------------------------- plan changes

    def begin(self, sched: RankSchedule | None, what: str) -> None:
        """A plan is installed (``sched``; ``None``: no plan, or a placement change): keep the
        residencies that continue into it, end the others (raising if their gradient never
        went home). Installing micro-batch ``m <=`` the last installed one starts a new step."""
        m = None if sched is None else sched.micro_batch
        new_step = m is None or self.last_mb is None or m <= self.last_mb
        if new_step:
            keep = torch.zeros_like(self.pending_GJ)
        else:
            keep = (self.held_GJ >= 0) & (self.held_GJ == sched.fill_mb_GJ) & (sched.return_mb_GJ >= m)
        self._end(~keep, what)
        if new_step:
            self.forward_mbs, self.backward_mbs = set(), set()
        self.last_mb = m

    def _end(self, drop_GJ: torch.Tensor, what: str) -> None:
        lost = drop_GJ & self.pending_GJ
        if lost.any():
            slots = [tuple(x) for x in lost.nonzero().tolist()]
            raise RuntimeError(
                f"{what}: the weight gradients of replica residencies in (GPU, slot) {slots} were "
                f"never sent to their owners: their last micro-batch with tokens (micro-batch "
                f"{sorted(set(self.return_GJ[lost].tolist()))}) did not run its backward. Run every "
                f"micro-batch of a planned step, forward then backward, in order, before the "
                f"optimizer step (or use refetch_replicas=True, which returns gradients in every "
                f"micro-batch's backward)")
        drop_GJ = drop_GJ & (self.held_GJ >= 0)
        self.held_GJ[drop_GJ] = -1
        self.return_GJ[drop_GJ] = -1
        self.via_GJ[drop_GJ] = -1
        for j in drop_GJ[self.rank].nonzero().flatten().tolist():
            self.entries.pop(j, None)

    def returns_at(self, sched: RankSchedule) -> bool:
        """Whether a held residency sends its gradient home in ``sched``'s micro-batch."""
        m = sched.micro_batch
        return m is not None and bool(((self.held_GJ >= 0) & (self.return_GJ == m)).any())

    @property
    def held_bytes(self) -> int:
        """Bytes of this rank's kept weight and gradient buffers (views of one fetched block
        count their own rows)."""
        return sum(sum(t.numel() * t.element_size() for t in (e.bufs or []) + (e.acc or []))
                   for e in self.entries.values())

    # ---------------------------------------------------------------- forward

    def buffers(self, x_pass: torch.Tensor, weights: Sequence[torch.Tensor], sched: RankSchedule,
                group, memory: ReplicaMemory | None, count: Callable[[str, int], None]
                ) -> tuple[torch.Tensor, list[list[torch.Tensor]]]:
        """Weights of this rank's active fill slots (``sched.fill_slots`` order), fetched where
        a residency starts (or ``no_grad`` freed its buffers), kept otherwise.

        Returns ``(x_pass, per-slot [w1, w2, w3])``. ``x_pass`` routes the backward through
        this node, so that on every rank the gradients go home before the dispatch's backward.
        Every rank of the group calls this when any rank has an active fill slot.
        """
        m = 0 if sched.micro_batch is None else sched.micro_batch
        need_GJ = sched.active_GJ & (self.held_GJ != sched.fill_mb_GJ)
        track = torch.is_grad_enabled() and any(w.requires_grad for w in weights)
        call = (self, sched, need_GJ, m, track, group, memory, count)
        out = _UseResidents.apply(call, x_pass, *weights)
        bufs = [list(out[1 + 3 * i: 4 + 3 * i]) for i in range(len(sched.fill_slots))]
        if not torch.is_grad_enabled():
            # no backward will come: free what no later micro-batch of the step uses
            self._end((self.held_GJ >= 0) & (self.return_GJ <= m) & ~self.pending_GJ, "no_grad forward")
        return out[0], bufs

    def _fetch(self, need_GJ, sched: RankSchedule, weights, group, memory, count) -> None:
        J = self.J
        hub_GJ = sched.hub_GJ if sched.hub_GJ is not None else torch.full_like(need_GJ, -1, dtype=torch.int64)
        hub_flat = hub_GJ.clamp(min=0).flatten()
        # a second hop needs its hub's buffer: held for the same residency, or a first hop now
        direct_now = (need_GJ & (hub_GJ < 0)).flatten()[hub_flat].view_as(need_GJ)
        held_ok = ((self.held_GJ >= 0) & (self.held_GJ == sched.fill_mb_GJ)).flatten()[hub_flat].view_as(need_GJ)
        hop2_GJ = need_GJ & (hub_GJ >= 0) & (held_ok | direct_now)
        via_GJ = torch.where(hop2_GJ, hub_GJ, -1)
        src_GJ = torch.where(hop2_GJ, hub_GJ.div(J, rounding_mode="floor"), sched.owner_GJ)
        # copies of a hub filled now wait for it (an exchange after the first hops); copies
        # of a hub filled earlier ride in the first-hop exchange
        after_GJ = hop2_GJ & direct_now & ~held_ok
        for mask_GJ in (need_GJ & ~after_GJ, after_GJ):
            if mask_GJ.any():
                self._fill(mask_GJ, src_GJ, via_GJ, sched, weights, group, memory, count)

    def _fill(self, mask_GJ, src_GJ, via_GJ, sched, weights, group, memory, count) -> None:
        """One weight exchange: the slots in ``mask_GJ`` from their owners or hubs (``via_GJ``)."""
        r = self.rank
        if not (via_GJ[mask_GJ] >= 0).any():   # owners only: rows straight from the native weights
            send_idx, send_sizes, recv_sizes, recv_slots = fill_exchange(
                mask_GJ, sched.slot_expert_GJ, sched.owner_GJ, sched.local_E, r)
            bufs = fetch_replica_weights(weights, FillSpec(send_idx.to(weights[0].device), send_sizes,
                                                           recv_sizes, group), memory)
            inn = [(int(sched.owner_GJ[r, j]), j) for j in recv_slots.tolist()]
        else:
            out, inn, send_sizes, recv_sizes = self._routes(mask_GJ, src_GJ, fill=True)
            rows = []
            for k, w in enumerate(weights):
                parts = [self.entries[int(via_GJ[q, j]) % self.J].bufs[k] if via_GJ[q, j] >= 0
                         else w.detach()[int(sched.local_E[sched.slot_expert_GJ[q, j]])] for q, j in out]
                rows.append(torch.stack(parts) if parts else w.new_empty(0, *w.shape[1:]))
            bufs = exchange_replica_rows(rows, send_sizes, recv_sizes, group, memory)
        count("collectives", 1)
        for i, (_, j) in enumerate(inn):
            self.entries[j] = _Entry(int(sched.fill_mb_GJ[r, j]), [b[i] for b in bufs])
            nbytes = sum(b[i].numel() * b.element_size() for b in bufs)
            hop2 = bool(via_GJ[r, j] >= 0)
            count("fill_bytes_intra" if hop2 else self._key("fill_bytes", int(sched.owner_GJ[r, j])), nbytes)
        self.held_GJ[mask_GJ] = sched.fill_mb_GJ[mask_GJ]
        self.return_GJ[mask_GJ] = sched.return_mb_GJ[mask_GJ]
        self.via_GJ[mask_GJ] = via_GJ[mask_GJ]

    def _routes(self, mask_GJ, peer_GJ, fill: bool):
        """``(send, recv, send_sizes, recv_sizes)`` of one exchange over the slots in ``mask_GJ``
        (the same on every rank): ``peer_GJ`` is each slot's source (``fill``) or destination
        GPU. ``send``/``recv`` list this rank's rows as ``(peer or slot GPU, slot)``, grouped by
        the rank they go to / come from and, between two ranks, by slot."""
        items = [(q, j, int(peer_GJ[q, j])) for q, j in mask_GJ.nonzero().tolist()]
        r = self.rank
        if fill:   # the peer sends weights to the slot's GPU
            send = [(q, j) for q, j, p in items if p == r]
            recv = sorted((p, j) for q, j, p in items if q == r)
        else:      # the slot's GPU sends gradients to the peer
            send = sorted((p, j) for q, j, p in items if q == r)
            recv = [(q, j) for q, j, p in items if p == r]
        sizes = [[sum(1 for x, _ in lst if x == p) for p in range(self.G)] for lst in (send, recv)]
        return send, recv, sizes[0], sizes[1]

    def _key(self, prefix: str, owner: int) -> str:
        return f"{prefix}_cross" if owner // self.g != self.rank // self.g else f"{prefix}_intra"

    # ---------------------------------------------------------------- backward

    def _backward(self, sched: RankSchedule, m: int, grads, weights_meta, group, memory, count,
                  device) -> list[torch.Tensor | None]:
        """Accumulate micro-batch ``m``'s replica gradients; send home the residencies whose
        last micro-batch with tokens is ``m``. Returns the owners' native gradients."""
        self.backward_mbs.add(m)
        # accumulate in the owner's gradient dtype, never below fp32 (fp32 main grads stay fp32)
        dtypes = [torch.promote_types(dt, torch.float32) for dt, _ in weights_meta]
        for i, j in enumerate(sched.fill_slots):
            entry = self.entries.get(j)
            if entry is None or entry.bufs is None:
                raise RuntimeError(f"replica slot {j} has no residency in micro-batch {m}'s backward: "
                                   f"its gradient was already sent home (backward out of micro-batch "
                                   f"order); run backward per micro-batch, in forward order")
            if entry.acc is None:
                entry.acc = [torch.zeros(b.shape, dtype=dt, device=b.device) for b, dt in zip(entry.bufs, dtypes)]
                if memory is not None:
                    for a in entry.acc:
                        memory.track(a)
            for a, gpart in zip(entry.acc, grads[3 * i: 3 * i + 3]):
                if gpart is not None:
                    a.add_(gpart)
        self.pending_GJ |= sched.active_GJ
        ret_GJ = (self.held_GJ >= 0) & (self.return_GJ == m)
        if not ret_GJ.any():
            return [None] * len(weights_meta)
        early = sorted(self.forward_mbs - self.backward_mbs)
        first = int(self.held_GJ[ret_GJ].min())
        if any(first <= q <= m for q in early):
            raise RuntimeError(f"micro-batch {m}'s backward would send replica gradients home before the "
                               f"backward of micro-batches {early}: run backward per micro-batch, in "
                               f"forward order (or use refetch_replicas=True)")
        via = self.via_GJ
        hop2_GJ = ret_GJ & (via >= 0)
        hub_idx = via.clamp(min=0).flatten()
        if (hop2_GJ & (self.held_GJ.flatten()[hub_idx].view_as(via) < 0)).any():
            raise RuntimeError(f"micro-batch {m}'s backward: a two-hop replica's hub was released before "
                               f"its copies' gradients reached it; run backward per micro-batch, in forward order")
        # copies whose hub returns now reduce into it first (an exchange before the returns);
        # copies of a hub that returns later ride in the return exchange
        before_GJ = hop2_GJ & ret_GJ.flatten()[hub_idx].view_as(via)
        native = [None] * len(weights_meta)
        for mask_GJ in (before_GJ, ret_GJ & ~before_GJ):
            if mask_GJ.any():
                got = self._reduce(mask_GJ, sched, weights_meta, dtypes, group, count, device)
                native = [g if n is None else n + g for n, g in zip(native, got)] if got is not None else native
        return native

    def _reduce(self, mask_GJ, sched, weights_meta, dtypes, group, count, device):
        """One gradient exchange: the slots in ``mask_GJ`` to their owners (returned: the native
        gradients, ``None`` if this exchange has no owner rows) or into their hubs."""
        r, via, J = self.rank, self.via_GJ, self.J
        shapes = [shape for _, shape in weights_meta]
        if not (via[mask_GJ] >= 0).any():   # owners only
            send_idx, send_sizes, recv_sizes, recv_slots = fill_exchange(
                mask_GJ, sched.slot_expert_GJ, sched.owner_GJ, sched.local_E, r)
            send = [(int(sched.owner_GJ[r, j]), j) for j in recv_slots.tolist()]
        else:
            dst_GJ = torch.where(via >= 0, via.div(J, rounding_mode="floor"), sched.owner_GJ)
            send, recv, send_sizes, recv_sizes = self._routes(mask_GJ, dst_GJ, fill=False)
        for _, j in send:
            nbytes = sum(a.numel() * a.element_size() for a in self.entries[j].acc)
            count("grad_return_bytes_intra" if via[r, j] >= 0
                  else self._key("grad_return_bytes", int(sched.owner_GJ[r, j])), nbytes)
        rows = [torch.stack([self.entries[j].acc[k] for _, j in send]) if send else
                torch.zeros(0, *shape[1:], dtype=dtypes[k], device=device) for k, shape in enumerate(shapes)]
        if not (via[mask_GJ] >= 0).any():
            native = return_replica_grads(rows, FillSpec(send_idx.to(device), send_sizes, recv_sizes, group), shapes)
        else:
            got = exchange_replica_rows(rows, send_sizes, recv_sizes, group)
            native, idx, own = None, [], []
            for i, (q, j) in enumerate(recv):
                if via[q, j] >= 0:   # into the hub's accumulator
                    hub = self.entries[int(via[q, j]) % J]
                    if hub.acc is None:
                        hub.acc = [torch.zeros(b.shape, dtype=dt, device=b.device) for b, dt in zip(hub.bufs, dtypes)]
                    for a, part in zip(hub.acc, got):
                        a.add_(part[i])
                else:
                    idx.append(int(sched.local_E[sched.slot_expert_GJ[q, j]]))
                    own.append(i)
            if own:
                sel = torch.tensor(own, device=device)
                at = torch.tensor(idx, device=device)
                native = [part.new_zeros(shape).index_add_(0, at, part.index_select(0, sel))
                          for part, shape in zip(got, shapes)]
        count("collectives", 1)
        self.pending_GJ[mask_GJ] = False
        self._end(mask_GJ, "gradient return")
        return native


class _UseResidents(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, x_pass, *weights):
        state, sched, need_GJ, m, track, group, memory, count = call
        if need_GJ.any():
            state._fetch(need_GJ, sched, weights, group, memory, count)
        if track:
            state.forward_mbs.add(m)
        out = []
        for j in sched.fill_slots:
            out.extend(b.view_as(b) for b in state.entries[j].bufs)
        ctx.call = call
        ctx.weights_meta = [(w.dtype, w.shape) for w in weights]
        ctx.device = x_pass.device
        return (x_pass.view_as(x_pass), *out)

    @staticmethod
    def backward(ctx, grad_x, *grad_bufs):
        state, sched, _, m, track, group, memory, count = ctx.call
        nw = len(ctx.weights_meta)
        if not track:
            return (None, grad_x, *([None] * nw))
        native = state._backward(sched, m, grad_bufs, ctx.weights_meta, group, memory, count, ctx.device)
        if not any(ctx.needs_input_grad[2:]):
            native = [None] * nw
        return (None, grad_x, *native)
