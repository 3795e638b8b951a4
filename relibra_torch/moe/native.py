"""The layer's native path: every expert on its owner, exchange sizes counted at run time.

This is what an EP layer without a plan does (torchtitan's, and static placement's): the
ranks exchange their per-expert counts, copy them to the host once, and derive the exchange
sizes from them. relibra's layer takes it for every layer its plan keeps without copies for
the whole step (``schedule_batch.rank_schedules``; ``ExpertEngine.set_plan(plan, device,
NATIVE)``): such a layer's plan is fully determined by the counts and the placement, so it
needs no host schedule built ahead, and it costs what static's layer costs.

:func:`build_rank_schedule` of :func:`native_layer_plan` gives the same schedule, but checks
and builds every field per call (about 0.2 ms per layer on the host, on the critical path of
every forward). Almost all of it depends on the placement alone, so :class:`NativeSchedules`
keeps those fields per placement and per forward only reads the gathered counts (a few
tensor ops). ``tests/test_moe_native.py`` checks equality field for field.

Legend: G GPUs (S source ranks = G), J slots per GPU (El native + R replica), X = G * J,
E experts, El native experts per GPU.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..planning.pair_slots import slot_quota_runs
from ..planning.topology import Topology
from .schedule import RankSchedule

__all__ = ["NATIVE", "NativeSchedules", "gather_counts", "routed_counts"]


class _Native:
    """The type of :data:`NATIVE`."""

    def __repr__(self) -> str:
        return "NATIVE"


#: In place of a layer's schedule (``ExpertEngine.set_plan(plan, device, NATIVE)``): the plan
#: keeps every expert on its owner, and the layer counts its exchange at run time.
NATIVE = _Native()


def routed_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ``[E + 1]`` on ``ids_TK``'s device: this rank's token-expert pairs per expert
    and, last, its count of ids outside ``[-1, E)``. Pads (``-1``) are not counted."""
    E = num_experts
    flat = ids_TK.reshape(-1)
    key = torch.where((flat < -1) | (flat >= E), E + 1, flat + 1)
    return torch.bincount(key, minlength=E + 2)[1:].to(torch.int64)


def gather_counts(ids_TK: torch.Tensor, num_experts: int, group, size: int) -> torch.Tensor:
    """int64 CPU ``[S, E + 1]``: every rank's :func:`routed_counts`, with one all-gather on
    ``ids_TK``'s device and one copy to the host (``group`` ``None``: this rank's row only)."""
    row = routed_counts(ids_TK, num_experts)
    if group is None:
        return row.unsqueeze(0).cpu()
    gathered = [torch.empty_like(row) for _ in range(size)]
    dist.all_gather(gathered, row, group=group)
    return torch.stack(gathered).cpu()


class NativeSchedules:
    """One rank's native schedules, the placement-only fields kept per placement.

    Args:
        topology: the layer's topology; rank: this EP rank.
    """

    def __init__(self, topology: Topology, rank: int):
        self.topology, self.rank = topology, rank
        self._key: tuple | None = None
        self._base: RankSchedule | None = None
        self._mine_El: torch.Tensor | None = None  # logical expert of each native slot of this rank
        self._native_GEl: torch.Tensor | None = None

    def _template(self, placement_E: torch.Tensor, device: torch.device) -> RankSchedule:
        """The fields that depend on the placement only (counts zero), on ``device``."""
        if (self._key is not None and self._key[1] == device
                and (placement_E is self._key[0] or torch.equal(placement_E, self._key[0]))):
            return self._base
        topo, r = self.topology, self.rank
        G, J, El, E = topo.num_gpus, topo.slots_per_gpu, topo.experts_per_gpu, topo.num_experts
        native_E = torch.empty_like(placement_E)
        native_E[placement_E] = torch.arange(E)
        se_GJ = torch.full((G, J), -1, dtype=torch.int64)
        se_GJ[:, :El] = native_E.view(G, El)
        owner_GJ = torch.where(se_GJ >= 0, torch.arange(G).view(G, 1), -1)
        order_X, _ = slot_quota_runs(se_GJ.reshape(-1), torch.zeros(1, G * J, dtype=torch.int64))
        group_J = torch.cat([torch.arange(El), torch.zeros(J - El, dtype=torch.int64)])
        none_GJ = torch.full((G, J), -1, dtype=torch.int64)
        self._base = RankSchedule(
            rank=r, send_sizes=[0] * G, recv_sizes=[0] * G, expected_counts_E=torch.zeros(E, dtype=torch.int64),
            slot_order_X=order_X.to(device), slot_cum_end_X=torch.zeros(G * J, dtype=torch.int64, device=device),
            chunk_group_C=group_J.expand(G, J).reshape(G * J).to(device),
            chunk_count_C=torch.zeros(G * J, dtype=torch.int64, device=device), own_counts=[0] * El,
            fill_counts=[], slot_tokens_J=torch.zeros(J, dtype=torch.int64), any_fill=False,
            fill_send_idx=torch.zeros(0, dtype=torch.int64, device=device), fill_send_sizes=[0] * G,
            fill_recv_sizes=[0] * G, fill_slots=[], fill_experts=[],
            own_offsets=torch.zeros(El, dtype=torch.int32, device=device),
            fill_offsets=torch.zeros(0, dtype=torch.int32, device=device), slot_expert_GJ=se_GJ,
            owner_GJ=owner_GJ, active_GJ=torch.zeros(G, J, dtype=torch.bool), fill_mb_GJ=none_GJ,
            return_mb_GJ=none_GJ.clone(), local_E=placement_E % El, hub_GJ=none_GJ.clone(),
            device=torch.device(device))
        self._native_GEl = native_E.view(G, El)
        self._mine_El = self._native_GEl[r]
        self._key = (placement_E.clone(), device)
        return self._base

    def schedule(self, placement_E: torch.Tensor, counts_SE: torch.Tensor,
                 device: torch.device | str = "cpu") -> RankSchedule:
        """This rank's schedule of the native plan for ``counts_SE`` (int64 CPU ``[S, E]``:
        every rank's pairs per expert), its index tensors on ``device``: equal to
        ``build_rank_schedule(topology, placement_E, native_layer_plan(...), rank)``."""
        device = torch.device(device)
        base = self._template(placement_E, device)
        G, J, El = self.topology.num_gpus, self.topology.slots_per_gpu, self.topology.experts_per_gpu
        counts_SE = counts_SE.to(torch.int64)
        mine_E = counts_SE[self.rank]
        recv_SJ = torch.zeros(G, J, dtype=torch.int64)
        recv_SJ[:, :El] = counts_SE[:, self._mine_El]
        slot_tokens_J = recv_SJ.sum(0)
        own_El = slot_tokens_J[:El]
        # in (expert, slot) order every expert has one slot: the empty slots first, then by expert
        cum_end_X = torch.cat([torch.zeros(G * J - mine_E.numel(), dtype=torch.int64), mine_E.cumsum(0)])
        return dataclasses.replace(
            base, send_sizes=mine_E[self._native_GEl].sum(1).tolist(), recv_sizes=recv_SJ.sum(1).tolist(),
            expected_counts_E=mine_E.clone(), slot_cum_end_X=cum_end_X.to(device),
            chunk_count_C=recv_SJ.reshape(G * J).to(device), own_counts=own_El.tolist(),
            slot_tokens_J=slot_tokens_J, own_offsets=own_El.cumsum(0).to(torch.int32).to(device))
