"""Attention-initiated transport: one interface, a CPU shared-memory backend (CUDA: ``symm``).

Per expert rank the transport holds, visible to every rank of the mesh:

* ``x_RD`` / ``y_RD``: the receive and output buffers, one row range per mailbox
  (:meth:`ServingMesh.row_base`); attention ranks write ``x`` and read ``y``;
* ``counts_ME``: int64 rows per local expert of each mailbox's current request (the rows are
  sorted by local expert);
* ``flags_MW``: int64 flag words per mailbox (``READY`` .. ``FINISHED`` below);
* ``stats_W``: int64 event counters of the expert rank (tiles done per phase, checks, ...).

The protocol of one request (mailbox m, sequence number ``seq`` = 1, 2, ...): the attention
rank writes the rows, ``counts``, ``LAYER`` and ``ROWS``, then raises ``READY = seq``; the
expert rank computes and raises ``DONE = seq`` (or ``ERROR = seq`` with ``ERRCODE``); the
attention rank reads the rows of ``y``. Sequence numbers only grow, so no flag is ever
reset and a stale flag is never mistaken for a new one. The expert rank only reads flags
and writes its own (``DONE``, ``ERROR``, ``CLOSED``): it posts no receive and issues no
collective. On CPU, writes are plain stores to shared memory, ordered as issued (x86-TSO:
the data is visible before the flag that follows it).

Every wait backs off (sleeps from ``Backoff.initial_s`` doubling to ``max_s``): nothing spins
on the 2-core test machines, and every wait has a timeout with an error naming what it
waited for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ...checks import check_number
from .mesh import ServingMesh

__all__ = ["READY", "DONE", "LAYER", "ROWS", "ERROR", "ERRCODE", "CLOSED", "FINISHED", "DONE_TILES", "FLAG_WORDS",
           "STAT_TILES", "STAT_CHECKS", "STAT_REQUESTS", "STAT_STOP", "STAT_WORDS", "ERRORS",
           "Backoff", "ExpertBuffers", "Transport", "ShmTransport", "TransportTimeout", "wait_until"]

READY, DONE, LAYER, ROWS, ERROR, ERRCODE, CLOSED, FINISHED = range(8)
# the expert rank's tiles done per phase (words 8, 9) when it raised DONE: what a request
# waited for, counted where it happened (the attention rank may see DONE late)
DONE_TILES = 8
FLAG_WORDS = 10
# stats: tiles done per phase (words 0, 1), checks (polls of the mailboxes), requests
# accepted, and a stop word the driver raises when the expert loop should end.
STAT_TILES, STAT_CHECKS, STAT_REQUESTS, STAT_STOP = 0, 2, 3, 4
STAT_WORDS = 8
#: ERRCODE values: what the expert rank refused, for the attention rank's message.
ERRORS = {1: "layer out of range", 2: "rows over the mailbox capacity", 3: "negative expert counts",
          4: "expert counts do not sum to the rows", 5: "mailbox closed after its source timed out",
          6: "sequence number skipped (READY must be the last request + 1)"}


class TransportTimeout(TimeoutError):
    """A wait of the transport ran out of time; the message names the mailbox and the wait."""


@dataclass(frozen=True)
class Backoff:
    """Sleep schedule of every wait: ``initial_s`` doubling up to ``max_s`` (never a busy spin)."""

    initial_s: float = 20e-6
    max_s: float = 2e-3

    def __post_init__(self) -> None:
        check_number("initial_s", self.initial_s, 0.0, strict=True)
        check_number("max_s", self.max_s, self.initial_s)


def wait_until(pred: Callable[[], bool], timeout_s: float, what: Callable[[], str],
               backoff: Backoff = Backoff()) -> float:
    """Poll ``pred`` with backoff; return the seconds waited or raise :class:`TransportTimeout`."""
    t0 = time.monotonic()
    delay = backoff.initial_s
    while not pred():
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise TransportTimeout(f"{what()}: nothing after {waited:.2f} s (timeout {timeout_s:g} s)")
        time.sleep(delay)
        delay = min(2 * delay, backoff.max_s)
    return time.monotonic() - t0


@dataclass
class ExpertBuffers:
    """The buffers of one expert rank as seen by the caller (local tensors or peer views)."""

    x_RD: torch.Tensor
    y_RD: torch.Tensor
    counts_ME: torch.Tensor
    flags_MW: torch.Tensor
    stats_W: torch.Tensor

    def flag(self, mailbox: int, word: int) -> int:
        return int(self.flags_MW[mailbox, word])

    def set_flag(self, mailbox: int, word: int, value: int) -> None:
        self.flags_MW[mailbox, word] = value


class Transport:
    """Buffers of every expert rank of a :class:`ServingMesh`; backends allocate them."""

    mesh: ServingMesh

    def expert(self, expert_rank: int) -> ExpertBuffers:
        """The buffers of expert rank ``expert_rank`` (index among the expert ranks)."""
        raise NotImplementedError


def allocate(mesh: ServingMesh, dtype: torch.dtype, alloc: Callable[..., torch.Tensor]) -> ExpertBuffers:
    """One expert rank's buffers from ``alloc(shape, dtype)`` (zeroed by the caller's allocator)."""
    R, D, M, El = mesh.rows, mesh.dim, mesh.mailboxes, mesh.experts_per_rank
    return ExpertBuffers(alloc((R, D), dtype), alloc((R, D), dtype), alloc((M, El), torch.int64),
                         alloc((M, FLAG_WORDS), torch.int64), alloc((STAT_WORDS,), torch.int64))


class ShmTransport(Transport):
    """CPU backend: shared-memory tensors, created once by the parent and handed to the
    ranks it spawns (``torch.multiprocessing`` shares their storage instead of copying it).

    Args:
        mesh: the serving mesh.
        dtype: of the row buffers (the model's dtype).
    """

    def __init__(self, mesh: ServingMesh, dtype: torch.dtype = torch.float32):
        self.mesh = mesh
        self.buffers = [allocate(mesh, dtype, lambda shape, dt: torch.zeros(shape, dtype=dt).share_memory_())
                        for _ in range(mesh.expert_ranks)]

    def expert(self, expert_rank: int) -> ExpertBuffers:
        return self.buffers[expert_rank]
