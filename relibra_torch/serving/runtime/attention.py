"""The attention rank's side: route, write into the expert ranks' mailboxes, read, combine.

:func:`split_attention` turns a model whose MoE layers are
:class:`~relibra_torch.moe.ReplayBalancedMoE` (the tiny LM of ``examples/tiny_lm.py``) into
its attention half: every MoE layer is replaced by a :class:`RemoteMoE` that keeps the
router (and the shared experts, if any) and drops the routed experts' weights; embeddings,
attention, norms, the LM head and the KV cache stay as they are, so the model's own forward
runs unchanged. Per MoE layer, :class:`RemoteMoE`:

1. routes its tokens with the layer's router (``ReplayBalancedMoE.route``);
2. sorts the (token, k) rows by expert (``ops.permute``); experts are contiguous per expert
   rank, so each expert rank's rows are one slice;
3. :meth:`ExpertClient.exchange` writes each slice and its per-expert counts into the
   expert rank's mailbox for (phase, this rank) and raises ``READY`` (all expert ranks
   first), then waits for each ``DONE`` and reads the output rows back;
4. combines them with its gates (``ops.unpermute``, fp32, the layer's own combine).

Legend: T tokens, K top-k, D dim, E experts, X expert ranks, R = T * K sorted rows.
"""

from __future__ import annotations

import torch
from torch import nn

from ... import ops
from ...checks import check_number
from ...moe import EXPERT_PARAMS, moe_layers
from .mesh import PHASES, ServingMesh
from .transport import (CLOSED, DONE, DONE_TILES, ERRCODE, ERROR, ERRORS, FINISHED, LAYER, READY, ROWS, STAT_TILES,
                        Backoff, Transport, TransportTimeout, wait_until)

__all__ = ["ExpertClient", "ExpertRefused", "RemoteMoE", "split_attention"]


class ExpertRefused(ValueError):
    """An expert rank refused a request (malformed, or the mailbox was closed)."""


class ExpertClient:
    """One attention rank's mailboxes on every expert rank.

    Args:
        mesh, transport: the serving mesh and its transport (as seen from this rank).
        phase: 0 (decode) or 1 (prefill); source: this rank's index among that phase's ranks.
        timeout_s: how long to wait for an expert rank's ``DONE``.

    ``events`` records, per request, the expert rank's tiles done per phase when ``READY``
    was raised (read just before and just after raising it; the later where a tile ended in
    between) and when ``DONE`` was seen (``(expert_rank, layer, tiles_at_ready,
    tiles_at_done)``): what the no-cross-phase-blocking test counts.
    """

    def __init__(self, mesh: ServingMesh, transport: Transport, phase: int, source: int, *,
                 timeout_s: float = 60.0, backoff: Backoff = Backoff()):
        self.mesh, self.transport = mesh, transport
        self.phase, self.source = phase, source
        self.mailbox = mesh.mailbox(phase, source)
        self.base = mesh.row_base(self.mailbox)
        self.timeout_s = check_number("timeout_s", timeout_s, 0.0, strict=True)
        self.backoff = backoff
        self.seq = [0] * mesh.expert_ranks
        self.events: list[tuple[int, int, list[int], list[int]]] = []

    def _tiles(self, r: int) -> list[int]:
        s = self.transport.expert(r).stats_W
        return [int(s[STAT_TILES]), int(s[STAT_TILES + 1])]

    def send(self, r: int, layer: int, x_RD: torch.Tensor, counts_E: torch.Tensor) -> None:
        """Write one request (rows sorted by local expert, counts ``[El]``) and raise READY."""
        mesh, m = self.mesh, self.mailbox
        n = x_RD.shape[0]
        cap = mesh.capacity(self.phase)
        if n > cap:
            raise ValueError(f"{PHASES[self.phase]} rank {self.source} routes {n} rows to expert rank {r} in "
                             f"layer {layer}; allowed: the mailbox capacity {PHASES[self.phase]}_capacity = {cap} "
                             f"(raise it in ServingMesh, or send fewer tokens per step)")
        b = self.transport.expert(r)
        b.x_RD[self.base:self.base + n] = x_RD
        b.counts_ME[m] = counts_E
        b.set_flag(m, LAYER, layer)
        b.set_flag(m, ROWS, n)
        self.seq[r] += 1
        before = self._tiles(r)
        b.set_flag(m, READY, self.seq[r])  # last: the data above is visible before it
        after = self._tiles(r)
        # the counts when READY was raised: exact where no tile ended while it was written,
        # else the later counts (a tile ended between the reads: the earlier ones would charge
        # that tile to the wait)
        self.events.append((r, layer, before if before == after else after, []))

    def receive(self, r: int, n: int) -> torch.Tensor:
        """Wait for the DONE of the last request to expert rank ``r``; its ``n`` output rows."""
        b, m, seq = self.transport.expert(r), self.mailbox, self.seq[r]

        def answered() -> bool:
            return b.flag(m, DONE) == seq or b.flag(m, ERROR) == seq or bool(b.flag(m, CLOSED))

        try:
            wait_until(answered, self.timeout_s,
                       lambda: f"{PHASES[self.phase]} rank {self.source}: waiting for expert rank {r}'s DONE of "
                               f"request {seq} (layer {b.flag(m, LAYER)})", self.backoff)
        except TransportTimeout as e:
            raise TransportTimeout(f"{e}; is expert rank {r} alive and serving?") from None
        if b.flag(m, DONE) != seq:
            code = b.flag(m, ERRCODE) if b.flag(m, ERROR) == seq else 5
            raise ExpertRefused(f"expert rank {r} refused {PHASES[self.phase]} rank {self.source}'s request {seq}: "
                                f"{ERRORS.get(code, f'error code {code}')}")
        for ev in reversed(self.events):
            if ev[0] == r and not ev[3]:  # the expert rank's tile counts when it raised DONE
                ev[3].extend([b.flag(m, DONE_TILES), b.flag(m, DONE_TILES + 1)])
                break
        return b.y_RD[self.base:self.base + n].clone()

    def exchange(self, layer: int, x_sorted_RD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert over all ``E`` experts -> their expert outputs, same order."""
        mesh = self.mesh
        El = mesh.experts_per_rank
        ends = offsets_E.to(torch.int64).tolist()
        y_RD = torch.zeros_like(x_sorted_RD)
        sent = []
        for r in range(mesh.expert_ranks):
            a = ends[r * El - 1] if r else 0
            z = ends[(r + 1) * El - 1]
            if z == a:
                continue
            counts = torch.tensor(ends[r * El:(r + 1) * El]) - torch.tensor(([a] + ends[r * El:(r + 1) * El - 1]))
            self.send(r, layer, x_sorted_RD[a:z], counts)
            sent.append((r, a, z))
        for r, a, z in sent:
            y_RD[a:z] = self.receive(r, z - a)
        return y_RD

    def finish(self) -> None:
        """Tell every expert rank this source sends nothing more."""
        for r in range(self.mesh.expert_ranks):
            self.transport.expert(r).set_flag(self.mailbox, FINISHED, 1)


class RemoteMoE(nn.Module):
    """A :class:`~relibra_torch.moe.ReplayBalancedMoE` whose routed experts run on expert ranks.

    Holds the layer's router and shared experts (its routed-expert weights are emptied);
    ``forward(x, routed_experts=None)`` is the layer's: ``[..., D] -> [..., D]`` (replayed
    ids are checked by the layer's router; pads are refused).
    """

    def __init__(self, moe: nn.Module, layer: int, client: ExpertClient):
        super().__init__()
        self.moe, self.layer, self.client = moe, layer, client
        for name in EXPERT_PARAMS:  # the attention rank holds no routed expert
            setattr(moe, name, nn.Parameter(torch.empty(0, dtype=getattr(moe, name).dtype), requires_grad=False))

    def forward(self, x: torch.Tensor, routed_experts: torch.Tensor | None = None) -> torch.Tensor:
        moe = self.moe
        x_TD = x.reshape(-1, moe.dim)
        routed_TK = None if routed_experts is None else routed_experts.reshape(-1, moe.top_k)
        ids_TK, gates_TK = moe.route(x_TD, routed_TK)  # replayed ids are range-checked there
        if routed_TK is not None and bool((ids_TK < 0).any()):
            raise ValueError("routed_experts has -1 pads; allowed: ids in [0, num_experts) (a served token "
                             "goes to its top-k experts)")
        x_sorted_RD, row_of_TK, offsets_E = ops.permute(ids_TK, x_TD, moe.num_experts)
        y_sorted_RD = self.client.exchange(self.layer, x_sorted_RD, offsets_E)
        out_TD = ops.unpermute(y_sorted_RD, row_of_TK, gates_TK)
        if moe.shared_experts is not None:
            out_TD = out_TD + moe.shared_experts(x_TD)
        return out_TD.view(x.shape)


def split_attention(model: nn.Module, client: ExpertClient) -> nn.Module:
    """Make ``model`` (in place) the attention half: each MoE layer becomes a :class:`RemoteMoE`."""
    layers = moe_layers(model)
    if len(layers) != client.mesh.num_layers:
        raise ValueError(f"model has {len(layers)} MoE layers; the mesh says num_layers = {client.mesh.num_layers}")
    for layer, (name, moe) in enumerate(layers):
        if moe.num_experts != client.mesh.num_experts:
            raise ValueError(f"MoE layer {name} has {moe.num_experts} experts; the mesh says {client.mesh.num_experts}")
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, RemoteMoE(moe, layer, client))
    return model
