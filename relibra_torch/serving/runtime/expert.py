"""The expert rank's loop: take whatever is ready from both phases, run it as one grouped GEMM.

:class:`ExpertServer` owns one expert rank's weights (its ``El`` experts of every layer) and
serves the mailboxes of :mod:`.transport`. It only reads the attention ranks' flags and
writes its own: no collective, no posted receive, so a prefill never blocks a decode's
exchange and a silent attention rank cannot wedge it.

Each loop iteration is a **check** followed by at most one **tile**:

* the check polls every mailbox; a new request (``READY`` above the last one handled) is
  validated (layer, rows against the capacity, expert counts) and refused with an error
  code if malformed, else its tiles are appended to its phase's tile table (built by
  :func:`relibra_torch.ops.persistent_gemm.tile_table` from the request's per-expert row
  counts, weight ``layer * El + e``); a source that stopped mid-step (its last request was
  for a layer before the last, and nothing came for ``source_timeout_s``) gets its mailbox
  closed with an error, and the loop goes on with the others;
* the tile is claimed by the rule of the persistent kernel with one program: decode first
  whenever the decode table has tiles (:func:`.share.decode_programs`), else prefill. A
  request whose last tile is done gets ``DONE``.

So the tables of the grouped GEMM grow while it runs, and a decode request waits for at
most the tile in flight plus one check, whatever prefill is queued. Executors: ``"tiles"``
computes a tile (``tile_m`` rows of one expert, all columns) with
:func:`relibra_torch.moe.engine.expert_ffn` on the shared buffers (CPU, any device);
``"triton"`` runs everything accepted at a check as two launches of the persistent
two-phase kernel (gate/up fused, then down) over both tables (CUDA, or CPU under
``TRITON_INTERPRET=1``).

Legend: L layers, El experts per expert rank, G = L * El stacked weights, D, F dims, R rows
of the receive buffer, M mailboxes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from ...checks import check_choice, check_int, check_number
from ...moe import EXPERT_PARAMS, moe_layers
from ...moe.engine import expert_ffn, local_tensor
from ...ops import persistent_gemm as pg
from .mesh import DECODE, PHASES, PREFILL, ServingMesh
from .share import decode_programs
from .transport import (CLOSED, DONE, DONE_TILES, ERRCODE, ERROR, FINISHED, LAYER, READY, ROWS, STAT_CHECKS,
                        STAT_REQUESTS, STAT_STOP, STAT_TILES, Backoff, ExpertBuffers)

__all__ = ["ExpertWeights", "ExpertServer", "EXECUTORS"]

EXECUTORS = ("tiles", "triton")


@dataclass
class ExpertWeights:
    """One expert rank's experts of every MoE layer, stacked layer-major (weight ``l * El + e``).

    ``w1_GFD``, ``w3_GFD``: ``[L * El, F, D]``; ``w2_GDF``: ``[L * El, D, F]`` (the layer's
    torchtitan layout).
    """

    w1_GFD: torch.Tensor
    w2_GDF: torch.Tensor
    w3_GFD: torch.Tensor

    @classmethod
    def from_model(cls, model: nn.Module, mesh: ServingMesh, expert_rank: int) -> "ExpertWeights":
        """Copy expert rank ``expert_rank``'s experts out of every MoE layer of ``model``."""
        layers = [m for _, m in moe_layers(model)]
        if len(layers) != mesh.num_layers:
            raise ValueError(f"model has {len(layers)} MoE layers; the mesh says num_layers = {mesh.num_layers}")
        El = mesh.experts_per_rank
        lo = check_int("expert_rank", expert_rank, 0, mesh.expert_ranks - 1) * El
        stacked = []
        for name in EXPERT_PARAMS:
            ws = [local_tensor(getattr(m, name)).detach()[lo:lo + El] for m in layers]
            stacked.append(torch.cat(ws).clone())
        return cls(*stacked)


class ExpertServer:
    """The loop of one expert rank (see the module docstring).

    Args:
        mesh: the serving mesh.
        buffers: this expert rank's buffers (from a :class:`~.transport.Transport`).
        weights: its :class:`ExpertWeights`.
        tile_m: rows per tile (the tile footprint's ``M_t``).
        executor: ``"tiles"`` or ``"triton"``.
        source_timeout_s: how long a source may stay silent in the middle of a step.
        backoff: the idle sleep schedule.
        min_tile_s: emulated tile time: a tile takes at least this long (CPU demos of tile
            granularity; 0 = as fast as it computes).
        programs: persistent programs of the ``"triton"`` executor (default: SM count on
            CUDA, 2 elsewhere).
    """

    def __init__(self, mesh: ServingMesh, buffers: ExpertBuffers, weights: ExpertWeights, *, tile_m: int = 16,
                 executor: str = "tiles", source_timeout_s: float = 30.0, backoff: Backoff = Backoff(),
                 min_tile_s: float = 0.0, programs: int | None = None):
        self.mesh, self.buf, self.w = mesh, buffers, weights
        self.tile_m = check_int("tile_m", tile_m)
        self.executor = check_choice("executor", executor, EXECUTORS)
        self.source_timeout_s = check_number("source_timeout_s", source_timeout_s, 0.0, strict=True)
        self.min_tile_s = check_number("min_tile_s", min_tile_s, 0.0)
        self.backoff = backoff
        G = mesh.num_layers * mesh.experts_per_rank
        if tuple(weights.w1_GFD.shape) != (G, mesh.hidden_dim, mesh.dim):
            raise ValueError(f"w1_GFD has shape {tuple(weights.w1_GFD.shape)}; the mesh needs "
                             f"[{G}, {mesh.hidden_dim}, {mesh.dim}] (L * El, F, D)")
        M = mesh.mailboxes
        self.handled = [0] * M  # last sequence number taken (accepted or refused) per mailbox
        self.left = [0] * M  # tiles left of the mailbox's current request
        self.open_since: list[float | None] = [None] * M  # mid-step since (its last DONE)
        self.closed = [False] * M
        self.tables: tuple[deque, deque] = (deque(), deque())  # (mailbox, weight, row0, row1) per tile
        self.errors: list[str] = []
        if programs is None:
            on_cuda = buffers.x_RD.is_cuda
            programs = torch.cuda.get_device_properties(buffers.x_RD.device).multi_processor_count if on_cuda else 2
        self.programs = check_int("programs", programs)

    # ------------------------------------------------------------------ check

    def _refuse(self, m: int, seq: int, code: int) -> None:
        self.buf.set_flag(m, ERRCODE, code)
        self.buf.set_flag(m, ERROR, seq)

    def check(self) -> int:
        """Poll every mailbox once; accept or refuse new requests, close timed-out sources.

        Returns the number of requests accepted.
        """
        b, mesh = self.buf, self.mesh
        b.stats_W[STAT_CHECKS] += 1
        accepted = 0
        now = time.monotonic()
        for m in range(mesh.mailboxes):
            seq = b.flag(m, READY)
            if seq == self.handled[m]:
                since = self.open_since[m]
                if since is not None and not self.closed[m] and now - since > self.source_timeout_s:
                    self._close(m, f"stopped mid-step: no request for the next layer {now - since:.2f} s after "
                                   f"layer {b.flag(m, LAYER)} was done")
                continue
            if self.closed[m]:
                self.handled[m] = seq
                self._refuse(m, seq, 5)
                continue
            code = self._validate(m, seq)
            self.handled[m] = seq
            if code:
                self._refuse(m, seq, code)
                continue
            self._accept(m, seq)
            accepted += 1
        return accepted

    def _validate(self, m: int, seq: int) -> int:
        b, mesh = self.buf, self.mesh
        phase, _ = mesh.phase_of(m)
        layer, rows = b.flag(m, LAYER), b.flag(m, ROWS)
        counts = b.counts_ME[m]
        if seq != self.handled[m] + 1:
            return 6
        if not 0 <= layer < mesh.num_layers:
            return 1
        if not 0 <= rows <= mesh.capacity(phase):
            return 2
        if bool((counts < 0).any()):
            return 3
        if int(counts.sum()) != rows:
            return 4
        return 0

    def _accept(self, m: int, seq: int) -> None:
        b, mesh = self.buf, self.mesh
        phase, _ = mesh.phase_of(m)
        El = mesh.experts_per_rank
        layer = b.flag(m, LAYER)
        tab = pg.tile_table(b.counts_ME[m].clone(), tile_m=self.tile_m, n_cols=1, tile_n=1,
                            row_base=mesh.row_base(m), weight_E=layer * El + torch.arange(El))
        self.tables[phase].extend((m, g, r0, r1) for g, r0, r1, _ in tab.tolist())
        self.left[m] = tab.shape[0]
        self.open_since[m] = None
        b.stats_W[STAT_REQUESTS] += 1
        if not tab.shape[0]:
            self._done(m)

    def _done(self, m: int) -> None:
        for phase in (0, 1):  # before DONE: visible when the attention rank sees it
            self.buf.set_flag(m, DONE_TILES + phase, int(self.buf.stats_W[STAT_TILES + phase]))
        self.buf.set_flag(m, DONE, self.handled[m])
        last = self.buf.flag(m, LAYER) == self.mesh.num_layers - 1
        self.open_since[m] = None if last else time.monotonic()

    def _close(self, m: int, why: str) -> None:
        phase, source = self.mesh.phase_of(m)
        msg = f"expert server: source ({PHASES[phase]}, {source}) {why}; its mailbox is closed, the others go on"
        self.errors.append(msg)
        self.closed[m] = True
        self.open_since[m] = None
        self.buf.set_flag(m, CLOSED, 1)

    # ------------------------------------------------------------------ tiles

    def _first_phase(self) -> int:
        dec, pre = len(self.tables[DECODE]), len(self.tables[PREFILL])
        return DECODE if decode_programs(1, dec, pre) else PREFILL

    def run_tile(self) -> bool:
        """Claim and compute one tile (decode first); False when both tables are empty."""
        if not (self.tables[DECODE] or self.tables[PREFILL]):
            return False
        if self.executor == "triton":
            self._run_triton()
            return True
        phase = self._first_phase()
        m, g, r0, r1 = self.tables[phase].popleft()
        t0 = time.perf_counter()
        w = self.w
        offsets = torch.tensor([r1 - r0], dtype=torch.int32, device=self.buf.x_RD.device)
        self.buf.y_RD[r0:r1] = expert_ffn(self.buf.x_RD[r0:r1], w.w1_GFD[g:g + 1], w.w2_GDF[g:g + 1],
                                          w.w3_GFD[g:g + 1], offsets)
        if self.min_tile_s:
            rest = self.min_tile_s - (time.perf_counter() - t0)
            if rest > 0:
                time.sleep(rest)
        self.buf.stats_W[STAT_TILES + phase] += 1
        self.left[m] -= 1
        if self.left[m] == 0:
            self._done(m)
        return True

    def _run_triton(self) -> None:
        """Everything accepted so far as two persistent two-phase launches (gate/up, down)."""
        x, y, w = self.buf.x_RD, self.buf.y_RD, self.w
        F, D, tm = self.mesh.hidden_dim, self.mesh.dim, self.tile_m
        tiles = [list(self.tables[p]) for p in (DECODE, PREFILL)]
        for t in self.tables:
            t.clear()
        tn, tk = (16, 16) if pg.tk.INTERPRET else (128, 64)
        tm_k = 1 << (max(16, tm) - 1).bit_length()  # tl.dot needs >= 16, a power of two

        def table(entries, n_cols):
            rows = [(g, r0, r1, nb) for _, g, r0, r1 in entries for nb in range(-(-n_cols // tn))]
            return torch.tensor(rows, dtype=torch.int32, device=x.device).reshape(-1, 4)

        h = torch.zeros(x.shape[0], F, dtype=x.dtype, device=x.device)
        share = decode_programs(self.programs, len(tiles[0]), len(tiles[1]))
        kw = dict(tile_m=tm_k, tile_n=tn, tile_k=tk, programs=self.programs, decode_programs=share)
        pg.two_phase_grouped_mm(x, w.w1_GFD.transpose(1, 2), table(tiles[0], F), table(tiles[1], F),
                                w3_GKN=w.w3_GFD.transpose(1, 2), y_RN=h, **kw)
        pg.two_phase_grouped_mm(h, w.w2_GDF.transpose(1, 2), table(tiles[0], D), table(tiles[1], D), y_RN=y, **kw)
        for phase in (DECODE, PREFILL):
            self.buf.stats_W[STAT_TILES + phase] += len(tiles[phase])
            for m, *_ in tiles[phase]:
                self.left[m] -= 1
                if self.left[m] == 0:
                    self._done(m)

    # ------------------------------------------------------------------ loop

    def finished(self) -> bool:
        """True when every source said it is finished (or was closed) and no tile is left."""
        b = self.buf
        if self.tables[DECODE] or self.tables[PREFILL]:
            return False
        if int(b.stats_W[STAT_STOP]):
            return True
        return all(self.closed[m] or b.flag(m, FINISHED) for m in range(self.mesh.mailboxes))

    def serve(self, max_seconds: float | None = None) -> dict:
        """Run checks and tiles until :meth:`finished` (or ``max_seconds``); return the counters."""
        t0 = time.monotonic()
        delay = self.backoff.initial_s
        while True:
            self.check()
            if self.run_tile():
                delay = self.backoff.initial_s
                continue
            if self.finished() or (max_seconds is not None and time.monotonic() - t0 > max_seconds):
                break
            time.sleep(delay)
            delay = min(2 * delay, self.backoff.max_s)
        s = self.buf.stats_W
        return {"tiles": [int(s[STAT_TILES + DECODE]), int(s[STAT_TILES + PREFILL])],
                "checks": int(s[STAT_CHECKS]), "requests": int(s[STAT_REQUESTS]), "errors": list(self.errors)}
