"""Replica residencies: when a replica slot's weights move in and its gradients go home.

The one definition of a *residency*, used by ``evaluate``, the cost model
(``relibra_torch.sim``), the traffic planner and the layer (``moe.schedule.layer_plans``):

    a maximal run of consecutive micro-batches of a step in which a slot holds the same
    expert, owned by another GPU (a *fill* slot).

Within a step the weights do not change, so a residency is filled **once**, at its first
micro-batch with tokens (never if it has none), its weight gradient accumulates on the
replica's GPU over the micro-batches with tokens, and goes home **once**, in the backward
of its last micro-batch with tokens. Micro-batches of the residency between those keep the
buffer alive whether they have tokens or not. A slot holding an expert its GPU owns is no
fill (it computes with the local parameter). A step boundary ends every residency.

With ``refetch_replicas=True`` the layer keeps no buffer: every micro-batch with tokens
fetches the weights twice (forward, and again in backward to recompute the replica rows)
and returns its gradient once. :meth:`Residencies.fetches` and :meth:`Residencies.returns`
give both schedules.

Legend: M micro-batches, L layers, G GPUs, J slots per GPU, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .two_hop import two_hop_hubs

__all__ = ["Residencies", "residencies", "residency_masks", "residency_masks_numpy", "residency_micro_batches",
           "step_residency_micro_batches"]


def residency_masks(slot_expert_MLGJ: torch.Tensor, fill_MLGJ: torch.Tensor,
                    tokens_MLGJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fill_start, grad_return, held)`` bool ``[M, ...]`` masks of the residencies.

    Args:
        slot_expert_MLGJ: int ``[M, ...]`` expert in each slot per micro-batch (``-1``: empty);
            any trailing shape, the first dimension is the step's micro-batches.
        fill_MLGJ: bool, same shape: the slot's expert is owned by another GPU.
        tokens_MLGJ: int, same shape: token-expert pairs the slot processes.

    Returns:
        ``fill_start``: the residency's weights arrive in this micro-batch's forward (its
        first micro-batch with tokens); ``grad_return``: its gradient goes home in this
        micro-batch's backward (its last with tokens); ``held``: the buffer is alive in this
        micro-batch (from ``fill_start`` to ``grad_return``, inclusive).
    """
    M = slot_expert_MLGJ.shape[0]
    if M == 0:
        empty = torch.zeros_like(fill_MLGJ, dtype=torch.bool)
        return empty, empty.clone(), empty.clone()
    # in numpy (booleans, integer comparisons and running maxima: the same masks): some 30
    # small torch ops per call were much of the planner's time on small steps
    shape, device = slot_expert_MLGJ.shape, slot_expert_MLGJ.device
    masks = residency_masks_numpy(*(t.cpu().numpy().reshape(M, -1) for t in (slot_expert_MLGJ, fill_MLGJ,
                                                                             tokens_MLGJ)))
    return tuple(torch.from_numpy(x.reshape(shape)).to(device) for x in masks)


def residency_masks_numpy(slot_expert_MX: np.ndarray, fill_MX: np.ndarray, tokens_MX: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`residency_masks` on numpy arrays ``[M, X]`` (``M >= 1``), each run found by
    running maxima rather than a loop over ``M``; returns new C-contiguous bool arrays."""
    fill = fill_MX.astype(bool, copy=False)
    active = fill & (tokens_MX > 0)
    same_prev = np.zeros_like(fill)
    same_prev[1:] = fill[1:] & fill[:-1] & (slot_expert_MX[1:] == slot_expert_MX[:-1])
    same_next = np.zeros_like(fill)
    same_next[:-1] = same_prev[1:]
    fill_start = _first_active(active, fill & ~same_prev)
    grad_return = _first_active(active[::-1], (fill & ~same_next)[::-1])[::-1].copy()
    started = _within(fill_start, same_prev)
    pending = _within(grad_return[::-1], same_next[::-1])[::-1]
    return fill_start, grad_return, started & pending & fill


def _first_active(act_MX: np.ndarray, starts_MX: np.ndarray) -> np.ndarray:
    """bool ``[M, X]``: ``act`` where it is the first ``act`` since the last ``starts`` (at or
    before it; ``starts`` is set at ``m = 0`` wherever ``act`` can be)."""
    count = act_MX.cumsum(0, dtype=np.int64)                   # active micro-batches up to m
    before = count - act_MX                                     # ... before m: non-decreasing, so
    at_start = np.maximum.accumulate(np.where(starts_MX, before, 0), axis=0)   # its value at the last start
    return act_MX & (count - at_start == 1)


def _within(event_MX: np.ndarray, same_prev_MX: np.ndarray) -> np.ndarray:
    """True from an ``event`` onwards while the residency continues (``same_prev``): where
    the last event at or before ``m`` is not before the last run start (``~same_prev``)."""
    M = event_MX.shape[0]
    m_M1 = np.arange(M).reshape(M, 1)
    run_start = np.maximum.accumulate(np.where(~same_prev_MX | (m_M1 == 0), m_M1, 0), axis=0)
    last_event = np.maximum.accumulate(np.where(event_MX, m_M1, -1), axis=0)
    return last_event >= run_start


@dataclass
class Residencies:
    """The replica schedule of a plan (bool ``[M, L, G, J]`` unless noted).

    Attributes:
        fill_MLGJ: the slot holds an expert owned by another GPU.
        cross_node_MLGJ: such a slot whose owner is on another node.
        active_MLGJ: a fill slot with tokens: the layer computes it with replica weights.
        fill_start_MLGJ: the residency's weights arrive in this micro-batch (kept buffers).
        grad_return_MLGJ: its gradient goes home in this micro-batch's backward.
        held_MLGJ: the weight and gradient buffers are alive in this micro-batch.
        owner_MLGJ: int64, the GPU that owns the slot's expert (``-1`` for empty slots).
        hub_MLGJ: int64, for kept buffers: the flat slot ``gpu * J + j`` of the hub a
            second-hop residency fills from and returns its gradient to over NVLink
            (``planning.two_hop``), at every micro-batch it is held; ``-1`` elsewhere.
    """

    fill_MLGJ: torch.Tensor
    cross_node_MLGJ: torch.Tensor
    active_MLGJ: torch.Tensor
    fill_start_MLGJ: torch.Tensor
    grad_return_MLGJ: torch.Tensor
    held_MLGJ: torch.Tensor
    owner_MLGJ: torch.Tensor
    hub_MLGJ: torch.Tensor | None = None

    def hubs(self, refetch: bool = False) -> torch.Tensor:
        """int64 ``[M, L, G, J]``: :attr:`hub_MLGJ`, all ``-1`` with ``refetch`` (re-fetched
        replicas keep no buffer to forward from) or when unset."""
        if refetch or self.hub_MLGJ is None:
            return torch.full_like(self.owner_MLGJ, -1)
        return self.hub_MLGJ

    def fetches(self, refetch: bool = False) -> torch.Tensor:
        """int64 ``[M, L, G, J]`` weight fetches of each slot in each micro-batch: 1 at a
        residency's start (kept buffers) or 2 in every active micro-batch (``refetch``:
        forward, then again in backward)."""
        if refetch:
            return 2 * self.active_MLGJ.to(torch.int64)
        return self.fill_start_MLGJ.to(torch.int64)

    def returns(self, refetch: bool = False) -> torch.Tensor:
        """int64 ``[M, L, G, J]`` gradient returns (once per residency, or once per active
        micro-batch with ``refetch``)."""
        return (self.active_MLGJ if refetch else self.grad_return_MLGJ).to(torch.int64)


def residencies(plan) -> Residencies:
    """The residencies of ``plan`` (a :class:`~relibra_torch.planning.StepPlan`).

    Tokens per slot are the plan's ``slot_tokens_MLGJ`` (what ``token_split`` sends there).
    """
    topo = plan.topology
    se = plan.slot_expert_MLGJ
    M, L, G, J = se.shape
    E, g = topo.num_experts, topo.gpus_per_node
    owner = plan.owner_gpu_LE().view(1, L, 1, E).expand(M, L, G, E).gather(3, se.clamp(min=0))
    owner = torch.where(se >= 0, owner, torch.full_like(owner, -1))
    gpu = torch.arange(G).view(1, 1, G, 1)
    fill = (se >= 0) & (owner != gpu)
    cross = fill & (owner // g != gpu // g)
    start, ret, held = residency_masks(se, fill, plan.slot_tokens_MLGJ)
    hub = two_hop_hubs(se, cross, held, start, ret, g)
    return Residencies(fill, cross, fill & (plan.slot_tokens_MLGJ > 0), start, ret, held, owner, hub)


def residency_micro_batches(plan, micro_batch: int, res: Residencies | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[L, G, J]`` ``(fill_mb, return_mb)`` of the residency each slot is in at
    ``micro_batch``: where its weights arrive and where its gradient goes home (``-1``: no
    residency with tokens). From :func:`residencies`; ``moe.schedule.layer_plans`` hands
    them to the layer. ``res``: ``residencies(plan)`` if already computed."""
    fill_mb_MLGJ, return_mb_MLGJ = step_residency_micro_batches(plan, res)
    return fill_mb_MLGJ[micro_batch], return_mb_MLGJ[micro_batch]


def step_residency_micro_batches(plan, res: Residencies | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[M, L, G, J]``: :func:`residency_micro_batches` of every micro-batch at once.

    A residency is a run of fill micro-batches linked by the same expert (module docstring);
    numbering the runs of each slot (a cumulative sum over ``M``) gives every micro-batch its
    run; per event (the fill, the gradient's return; a run has at most one of each) two
    scatters over the runs, the event's micro-batch and whether it happened, are gathered
    back to every micro-batch of the run."""
    res = residencies(plan) if res is None else res
    se_MLGJ, fill_MLGJ = plan.slot_expert_MLGJ, res.fill_MLGJ
    M = se_MLGJ.shape[0]
    link_MLGJ = torch.zeros_like(fill_MLGJ)  # m continues m - 1's residency (the same expert: the same fill)
    link_MLGJ[1:] = fill_MLGJ[1:] & (se_MLGJ[1:] == se_MLGJ[:-1])
    run_MLGJ = (~link_MLGJ).to(torch.int64).cumsum(0) - 1
    idx_MLGJ = torch.arange(M).view(M, 1, 1, 1).expand_as(run_MLGJ)

    def at_run(event_MLGJ: torch.Tensor) -> torch.Tensor:
        event = event_MLGJ.to(torch.int64)
        when = torch.zeros_like(run_MLGJ).scatter_add_(0, run_MLGJ, event * idx_MLGJ).gather(0, run_MLGJ)
        seen = torch.zeros_like(run_MLGJ).scatter_add_(0, run_MLGJ, event).gather(0, run_MLGJ)
        return torch.where(seen > 0, when, -1)  # a micro-batch outside a fill run is a run of its own, without events

    return at_run(res.fill_start_MLGJ), at_run(res.grad_return_MLGJ)
