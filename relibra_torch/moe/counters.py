"""What a layer sends, counted as it runs: the layer side of the transfer-count interface.

The simulator's side is ``relibra_torch.sim.transfer_counts`` (the same keys, predicted from
the plan); ``relibra_torch.testing.run_plan_transfers`` runs a plan on gloo ranks and
gathers these. Per micro-batch, layer and GPU (this GPU), forward + backward of that
micro-batch:

=========================== ====== =========================================================
key                         unit   what
=========================== ====== =========================================================
``cross_node_rows``         rows   token rows this GPU sends to GPUs of other nodes in the
                                   forward dispatch (combine and backward mirror it and are
                                   not counted again)
``intra_node_rows``         rows   rows to other GPUs of its own node (not to itself)
``fill_bytes_cross``        bytes  replica weight bytes this GPU receives from owners on
                                   other nodes (forward fills; with ``refetch_replicas`` the
                                   backward's second fetch too)
``fill_bytes_intra``        bytes  the same from owners on its own node
``grad_return_bytes_cross`` bytes  replica gradient bytes this GPU sends home to owners on
                                   other nodes
``grad_return_bytes_intra`` bytes  the same to owners on its own node
``collectives``             calls  collectives this GPU issues for this layer in forward and
                                   backward of that micro-batch (plan check, count gather,
                                   dispatch, fills, combine, their backwards, gradient returns)
=========================== ====== =========================================================

Step level (``ReplayBalancer``): ``step_collectives``, the collectives of ``plan_step``
(count gathers, pair all-reduce, plan agreement, failure flag, migration).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["COUNT_KEYS", "STEP_KEYS", "TransferCounts", "stack_counts"]

#: Per (micro-batch, layer, GPU) keys, in this order.
COUNT_KEYS = ("cross_node_rows", "intra_node_rows", "fill_bytes_cross", "fill_bytes_intra",
              "grad_return_bytes_cross", "grad_return_bytes_intra", "collectives")
#: Per-step keys (``[G]``).
STEP_KEYS = ("step_collectives",)


class TransferCounts:
    """One layer's counts on this GPU, per micro-batch index (``-1``: a plan without one)."""

    def __init__(self) -> None:
        self.by_micro_batch: dict[int, dict[str, int]] = {}

    def reset(self) -> None:
        self.by_micro_batch = {}

    def counter(self, micro_batch: int | None) -> Callable[[str, int], None]:
        """``count(key, n)`` adding ``n`` to ``key`` of ``micro_batch`` (captured now, so a
        backward that runs later counts under its own micro-batch)."""
        rec = self.by_micro_batch.setdefault(-1 if micro_batch is None else micro_batch,
                                             dict.fromkeys(COUNT_KEYS, 0))

        def count(key: str, n: int = 1) -> None:
            rec[key] += int(n)
        return count

    def as_tensors(self, num_micro_batches: int) -> dict[str, torch.Tensor]:
        """int64 ``[M]`` per key (micro-batches never run count zero)."""
        out = {k: torch.zeros(num_micro_batches, dtype=torch.int64) for k in COUNT_KEYS}
        for m, rec in self.by_micro_batch.items():
            if 0 <= m < num_micro_batches:
                for k in COUNT_KEYS:
                    out[k][m] = rec[k]
        return out


def stack_counts(layers: Sequence, num_micro_batches: int) -> dict[str, torch.Tensor]:
    """int64 ``[M, L]`` per key: this GPU's counts of every layer (``EngineHost`` objects)."""
    per = [layer.engine.transfer_counts.as_tensors(num_micro_batches) for layer in layers]
    return {k: torch.stack([p[k] for p in per], 1) if per else torch.zeros(num_micro_batches, 0, dtype=torch.int64)
            for k in COUNT_KEYS}


def count_dispatch(sched, gpus_per_node: int, rank: int, count) -> None:
    """Token rows ``rank`` sends in the forward dispatch (flat), to other nodes / its own node."""
    g, r = gpus_per_node, rank
    count("cross_node_rows", sum(n for q, n in enumerate(sched.send_sizes) if q // g != r // g))
    count("intra_node_rows", sum(n for q, n in enumerate(sched.send_sizes) if q // g == r // g and q != r))


def refetch_counter(sched, gpus_per_node: int, rank: int, count):
    """``count(what, tensors)`` for re-fetching replicas: bytes by the owners' node."""
    g, r = gpus_per_node, rank
    cross = [int(sched.owner_GJ[r, j]) // g != r // g for j in sched.fill_slots]

    def counted(what: str, tensors) -> None:
        count("collectives", 1)
        prefix = "fill_bytes" if what == "fetch" else "grad_return_bytes"
        for i, is_cross in enumerate(cross):
            count(f"{prefix}_{'cross' if is_cross else 'intra'}", sum(t[i].numel() * t.element_size() for t in tensors))
    return counted
