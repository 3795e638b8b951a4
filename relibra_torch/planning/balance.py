"""relibra's balancing replication: per micro-batch, layer and node, move load from the
busiest GPU to the least-loaded GPU with a free replica slot (see
:mod:`relibra_torch.planning.relibra`, whose planner runs it after the traffic replicas).
The expert copied is the one that moves the most tokens, counting those from other nodes
twice, so that copies also carry inter-node receive away from the giver (on the trace
families of docs/results.md: 0.5-1.7% shorter steps than copying the largest expert).

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, G GPUs, g GPUs per
node, El native experts per GPU, R replica slots per GPU, J = El + R, B batched problems
(M * L * N).
"""

from __future__ import annotations

import torch

from .topology import Topology

__all__ = ["replicate"]


def replicate(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
              min_tokens: int = 0, prefilled: tuple[torch.Tensor, torch.Tensor] | None = None,
              min_cross_tokens: int = 0, keep_prefilled: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-micro-batch intra-node replication under a fixed placement.

    ``min_tokens``: a replica is made only if it takes at least this many tokens (see
    :attr:`ReLibraConfig.min_replica_tokens`). ``prefilled``: ``(expert_MLGr, quota_MLGr)``
    replicas already placed in the first ``r`` replica slots of every GPU (e.g. cross-node
    traffic replicas); their quotas come off their experts' owners and count as their
    GPU's load, and balancing uses the remaining ``R - r`` slots. A GPU overloaded by such a
    replica can give part of its quota to another GPU of the node like a native expert's
    (a second copy, filled from the owner's node: at least ``min_cross_tokens`` tokens).
    ``keep_prefilled``: tokens a prefilled replica with tokens keeps (two-hop replicas,
    ``planning.two_hop``: a copy fills from the node's first copy over NVLink only while
    that copy's residency, which needs tokens, covers it).

    Returns:
        ``(slot_expert_MLGJ, slot_tokens_MLGJ)`` int64 ``[M, L, G, J]``.
    """
    M, L, S, E = loads_MLSE.shape
    N, g, El, R = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    G, J = topology.num_gpus, topology.slots_per_gpu
    inverse_LE = torch.empty_like(placement_LE).scatter_(1, placement_LE, torch.arange(E).expand(L, E))
    native_LGl = inverse_LE.view(L, G, El)
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    r0 = 0 if prefilled is None else prefilled[0].shape[-1]
    if prefilled is not None and r0:
        pre_e, pre_q = prefilled
        load_MLE = load_MLE - torch.zeros_like(load_MLE).scatter_add_(
            2, pre_e.clamp(min=0).reshape(M, L, -1), (pre_q * (pre_e >= 0)).reshape(M, L, -1))
    native_idx = native_LGl.reshape(1, L, -1).expand(M, L, G * El)
    rem_MLGl = load_MLE.gather(2, native_idx).view(M, L, G, El)
    # The part of each native's remaining load that comes from other nodes' sources (its
    # owner node's own demand stays; traffic replicas elsewhere took their nodes' demand).
    owner_node_LE = placement_LE // El // g
    home_MLE = loads_MLSE.to(torch.int64).view(M, L, N, g, E).sum(3).gather(
        2, owner_node_LE.view(1, L, 1, E).expand(M, L, 1, E)).squeeze(2)
    remote_MLGl = (load_MLE - home_MLE).clamp(min=0).gather(2, native_idx).view(M, L, G, El)
    B = M * L * N
    rem = rem_MLGl.reshape(B, g, El).clone()
    experts = native_LGl.view(1, L, N, g, El).expand(M, L, N, g, El).reshape(B, g, El)
    rep_expert = torch.full((B, g, max(R, 1)), -1, dtype=torch.int64)
    rep_quota = torch.zeros(B, g, max(R, 1), dtype=torch.int64)
    used = torch.zeros(B, g, dtype=torch.int64)
    load = rem.sum(-1)
    if r0:
        rep_expert[..., :r0] = pre_e.reshape(B, g, r0)
        rep_quota[..., :r0] = pre_q.reshape(B, g, r0)
        used += r0
        load = load + rep_quota[..., :r0].sum(-1)
    target = (load.sum(-1) + g - 1) // g
    rows = torch.arange(B)
    # What a GPU can give away: its native experts' remaining load, then its prefilled
    # replicas' quotas (a copy of those is filled from another node).
    kept = rep_quota[..., :r0].clamp(max=int(keep_prefilled))             # stays on the first copy
    giveable = torch.cat([rem, rep_quota[..., :r0] - kept], -1)            # [B, g, El + r0]
    # ... and how much of it is remote (a cross-node copy's tokens are its node's own)
    give_remote = torch.cat([remote_MLGl.reshape(B, g, El), torch.zeros_like(rep_quota[..., :r0])], -1)
    give_expert = torch.cat([experts, rep_expert[..., :r0]], -1)
    need_K = torch.tensor([min_tokens] * El + [min_cross_tokens] * r0, dtype=torch.int64)
    for _ in range(g * R):
        h = load.argmax(-1)                       # busiest GPU (first on ties)
        excess = load[rows, h] - target
        # Among the busiest GPU's experts whose share would pay for its fill (at most the
        # least-loaded receiver's deficit, see below), the one that moves the most tokens,
        # counting those from other nodes twice: with the copy they can leave the giver's
        # inter-node receive too (token_split sends remote tokens to the instance whose GPU
        # receives less).
        open_ = (used < R) & (load < target.unsqueeze(1))
        room = (target - load.masked_fill(~open_, torch.iinfo(torch.int64).max).min(-1).values).clamp(min=0)
        cand = giveable[rows, h]
        movable = torch.minimum(cand, room.unsqueeze(1))
        pays = movable >= need_K
        idx = (movable + torch.minimum(movable, give_remote[rows, h])).masked_fill(~pays, -1).argmax(-1)
        expert_B = give_expert[rows, h, idx]
        holds = (rep_expert == expert_B.view(B, 1, 1)).any(-1)             # a GPU holds it already
        can_take = (used < R) & (load < target.unsqueeze(1)) & ~holds
        u = load.masked_fill(~can_take, torch.iinfo(torch.int64).max).argmin(-1)
        deficit = target - load[rows, u]
        # A receiver's last free slot takes all it can, even past the giver's excess (the
        # giver then becomes a receiver with its own free slots): per-GPU slots, not total
        # slots, are what run out first.
        last_slot = used[rows, u] == R - 1
        give = torch.where(last_slot, deficit, torch.minimum(excess, deficit))
        amount = torch.minimum(give, giveable[rows, h, idx])
        need = torch.where(idx >= El, min_cross_tokens, min_tokens)
        active = (excess > 0) & can_take.any(-1) & (amount > 0) & (amount >= need)
        if not active.any():
            break
        amount = amount * active
        r, hh, uu, ii = rows[active], h[active], u[active], idx[active]
        amt = amount[active]
        slot = used[r, uu]
        rep_expert[r, uu, slot] = give_expert[r, hh, ii]
        rep_quota[r, uu, slot] = amt
        used[r, uu] += 1
        giveable[r, hh, ii] -= amt
        give_remote[r, hh, ii] = (give_remote[r, hh, ii] - amt).clamp(min=0)   # copies take remote first
        load[r, hh] -= amt
        load[r, uu] += amt
    rem = giveable[..., :El]
    rep_quota[..., :r0] = giveable[..., El:] + kept
    slot_expert = torch.cat([experts, rep_expert[..., :R]], -1).view(M, L, G, J)
    slot_tokens = torch.cat([rem, rep_quota[..., :R]], -1).view(M, L, G, J)
    return slot_expert.contiguous(), slot_tokens.contiguous()
