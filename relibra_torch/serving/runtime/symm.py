"""CUDA backend of the transport: PyTorch symmetric memory (guarded; imports without CUDA).

Every rank of the process group allocates the same symmetric buffer (one collective
``symm_mem.empty`` + ``rendezvous`` at start-up, never again) laid out as one expert rank's
:class:`~.transport.ExpertBuffers`; expert rank ``x``'s buffers, on any rank, are views of
the allocation of ``x``'s global rank (``get_buffer``), so an attention rank writes its rows
and flags straight into the expert rank's memory and reads the outputs back, and the expert
rank works on its own local memory. Flags are int64 words written by small device copies on
the writer's current stream after its data (stream order) and polled by the reader with a
device-to-host read.

Needs torch's ``torch.distributed._symmetric_memory`` with ``empty``, ``rendezvous`` and
``get_buffer`` (torch >= 2.6; the project's range is 2.11-2.13) and CUDA devices with peer
access (one node). Not run in this project's tests (no GPU in CI); ``available()`` says why
it cannot be used here.
"""

from __future__ import annotations

import torch

from .mesh import ServingMesh
from .transport import FLAG_WORDS, STAT_WORDS, ExpertBuffers, Transport

__all__ = ["SymmMemTransport", "available"]

_ALIGN = 256  # bytes: every buffer starts aligned (vector loads, TMA-friendly)


def available() -> tuple[bool, str]:
    """``(usable, reason)``: whether symmetric memory can back the transport in this process."""
    if not torch.cuda.is_available():
        return False, "no CUDA device (the symmetric-memory transport needs GPUs with peer access)"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        return False, f"torch {torch.__version__} has no torch.distributed._symmetric_memory ({e})"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
    if missing:
        return False, f"torch {torch.__version__}'s symmetric memory lacks {missing}"
    return True, "ok"


def layout(mesh: ServingMesh, dtype: torch.dtype) -> tuple[list[tuple[str, tuple, torch.dtype, int]], int]:
    """``[(name, shape, dtype, byte offset)]`` of one expert rank's buffers, and the total bytes."""
    R, D, M, El = mesh.rows, mesh.dim, mesh.mailboxes, mesh.experts_per_rank
    parts = [("flags_MW", (M, FLAG_WORDS), torch.int64), ("stats_W", (STAT_WORDS,), torch.int64),
             ("counts_ME", (M, El), torch.int64), ("x_RD", (R, D), dtype), ("y_RD", (R, D), dtype)]
    out, off = [], 0
    for name, shape, dt in parts:
        out.append((name, shape, dt, off))
        n = 1
        for s in shape:
            n *= s
        off += -(-n * dt.itemsize // _ALIGN) * _ALIGN
    return out, off


class SymmMemTransport(Transport):
    """Symmetric-memory buffers over a process group that holds every rank of ``mesh``.

    Args:
        mesh: the serving mesh (global rank = the mesh's rank numbering).
        dtype: of the row buffers.
        group: the process group (default: the world); collective at construction only.
        device: this rank's CUDA device (default: the current one).
    """

    def __init__(self, mesh: ServingMesh, dtype: torch.dtype = torch.bfloat16, group=None, device=None):
        ok, why = available()
        if not ok:
            raise RuntimeError(f"SymmMemTransport: {why}; use ShmTransport on CPU")
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = group if group is not None else dist.group.WORLD
        if dist.get_world_size(group) != mesh.world_size:
            raise ValueError(f"the process group has {dist.get_world_size(group)} ranks; the mesh needs "
                             f"{mesh.world_size} (prefill + decode + expert ranks)")
        self.mesh = mesh
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        parts, total = layout(mesh, dtype)
        self._local = symm_mem.empty(total, dtype=torch.uint8, device=device)
        self._local.zero_()
        self._handle = symm_mem.rendezvous(self._local, group)
        self._handle.barrier()  # every allocation zeroed before anyone writes into a peer's
        self.buffers = []
        for x in range(mesh.expert_ranks):
            peer = mesh.rank_of("expert", x)
            views = {}
            for name, shape, dt, off in parts:
                views[name] = self._handle.get_buffer(peer, list(shape), dt, off // dt.itemsize)
            self.buffers.append(ExpertBuffers(**views))

    def expert(self, expert_rank: int) -> ExpertBuffers:
        return self.buffers[expert_rank]
