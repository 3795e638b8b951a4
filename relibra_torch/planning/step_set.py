"""relibra's step-long replica set over every free slot of a node, with per-micro-batch quotas.

A candidate of balancing's residency-aware choice (:func:`relibra_torch.planning.balance.replicate_step`,
which keeps per layer the cheapest of its plans at their step price). Per (layer, node):

* **which copies, all step**: while a GPU of the node has a free replica slot, the node's
  native expert with the most step tokens per instance gets one more instance, on the GPU
  with the least projected step load (each expert's step tokens shared evenly by its
  instances) that has a free slot and does not hold it, as long as the new instance's
  share of the step's tokens, ``w / (n + 1)``, is at least ``min_tokens`` (a fill's worth of
  tokens: each copy keeps its slot all step, so it is filled once and its gradient goes home
  once, ``planning.residency``).
* **how many tokens each instance takes, per micro-batch**: what replay knows and a
  step-long placement from step totals does not. Start from an even split of the
  micro-batch's tokens over the expert's instances, then repeatedly move tokens from the
  node's busiest GPU to the least loaded GPU holding another instance of one of its
  experts, half the gap at most, the expert that moves the most first. Every instance
  keeps its slot whatever its quota, so quotas change nothing in the fills.

Traffic replicas (``prefilled``, their slots first) keep their quotas; their experts are
other nodes' and never among a node's natives, so the two never mix. Integer arithmetic
on counts, plus one float64 ratio per round: the same loads give the same plan everywhere.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, G GPUs, g GPUs per
node, El native experts per GPU, R replica slots per GPU, J = El + R, r0 prefilled slots
per GPU, K = g * El native experts of a node, B rows (L * N, or M * L * N).
"""

from __future__ import annotations

import torch

from .topology import Topology

__all__ = ["step_long_set"]

_BIG = torch.iinfo(torch.int64).max


def _copies(w_BK: torch.Tensor, pre_Bg: torch.Tensor, g: int, El: int, free: int, min_tokens: int) -> torch.Tensor:
    """int64 ``[B, g, free]`` local expert (``0..K-1``, ``-1`` none) of each free slot."""
    B, K = w_BK.shape
    rows = torch.arange(B)
    own_BgK = (torch.arange(K) // El == torch.arange(g).view(g, 1)).expand(B, g, K).clone()
    n_BK = torch.ones(B, K, dtype=torch.int64)
    out = torch.full((B, g, max(free, 0)), -1, dtype=torch.int64)
    used = torch.zeros(B, g, dtype=torch.int64)
    wf = w_BK.to(torch.float64)
    for _ in range(g * free):
        load_Bg = (own_BgK * (wf / n_BK).unsqueeze(1)).sum(-1) + pre_Bg.to(torch.float64)
        room_Bg = used < free
        # an expert can gain an instance where a GPU with room lacks it, and its share pays
        addable_BK = ((~own_BgK) & room_Bg.unsqueeze(-1)).any(1) & (w_BK >= min_tokens * (n_BK + 1))
        if not addable_BK.any():
            break
        k = (wf / n_BK).masked_fill(~addable_BK, -1.0).argmax(-1)
        active = addable_BK[rows, k]
        can_Bg = room_Bg & ~own_BgK[rows, :, k]
        u = load_Bg.masked_fill(~can_Bg, float("inf")).argmin(-1)
        r, uu, kk = rows[active], u[active], k[active]
        out[r, uu, used[r, uu]] = kk
        own_BgK[r, uu, kk] = True
        n_BK[r, kk] += 1
        used[r, uu] += 1
    return out


def _rebalance(se_BgJ: torch.Tensor, tok_BgJ: torch.Tensor, movable_BgJ: torch.Tensor, rounds: int) -> torch.Tensor:
    """Quotas ``tok_BgJ`` with tokens moved between instances of one expert (same id in
    ``se_BgJ``, ``movable``) from the busiest GPU toward the least loaded (module docstring)."""
    B, g, J = se_BgJ.shape
    rows = torch.arange(B)
    tok = tok_BgJ.clone()
    for _ in range(rounds):
        load = tok.sum(-1)
        h = load.argmax(-1)
        se_h, mv_h = se_BgJ[rows, h], movable_BgJ[rows, h]                      # [B, J]
        # GPUs holding each of h's experts (another instance): [B, J(h's slot), g]
        holds = ((se_BgJ.unsqueeze(1) == se_h.view(B, J, 1, 1)) & movable_BgJ.unsqueeze(1)).any(-1)
        holds &= (torch.arange(g).view(1, 1, g) != h.view(B, 1, 1)) & mv_h.unsqueeze(-1)
        cand = load.unsqueeze(1).expand(B, J, g).masked_fill(~holds, _BIG)
        u_BJ = cand.argmin(-1)
        gap = load[rows, h].unsqueeze(1) - cand.gather(-1, u_BJ.unsqueeze(-1)).squeeze(-1)
        amount_BJ = torch.minimum(tok[rows, h], (gap // 2).clamp(min=0)).masked_fill(~holds.any(-1), 0)
        j = amount_BJ.argmax(-1)
        amt = amount_BJ[rows, j]
        if not (amt > 0).any():
            break
        u = u_BJ[rows, j]
        e = se_h[rows, j]
        ju = ((se_BgJ[rows, u] == e.unsqueeze(-1)) & movable_BgJ[rows, u]).to(torch.int64).argmax(-1)
        tok[rows, h, j] -= amt
        tok[rows, u, ju] += amt
    return tok


def step_long_set(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, min_tokens: int,
                  prefilled: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The step-long candidate of the module docstring.

    Args:
        loads_MLSE: int ``[M, L, S, E]``; placement_LE: int64 ``[L, E]`` native slot per expert.
        min_tokens: fewest step tokens a copy's share must reach (its one fill's worth).
        prefilled: ``(expert_MLGr, quota_MLGr)`` traffic replicas in the first ``r0`` replica
            slots, as :func:`relibra_torch.planning.balance.replicate` takes them.
    Returns:
        ``(slot_expert_MLGJ, slot_tokens_MLGJ)`` int64 ``[M, L, G, J]``; the copies keep
        their slots in every micro-batch.
    """
    M, L, S, E = loads_MLSE.shape
    N, g, El, R = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    G, J, K = topology.num_gpus, topology.slots_per_gpu, topology.gpus_per_node * topology.experts_per_gpu
    r0 = 0 if prefilled is None else prefilled[0].shape[-1]
    free = R - r0
    inverse_LE = torch.empty_like(placement_LE).scatter_(1, placement_LE, torch.arange(E).expand(L, E))
    native_LNK = inverse_LE.view(L, N, K)
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    pre_e = torch.full((M, L, G, r0), -1, dtype=torch.int64)
    pre_q = torch.zeros(M, L, G, r0, dtype=torch.int64)
    if r0:
        pre_e, pre_q = prefilled
        load_MLE = load_MLE - torch.zeros_like(load_MLE).scatter_add_(
            2, pre_e.clamp(min=0).reshape(M, L, -1), (pre_q * (pre_e >= 0)).reshape(M, L, -1))
    native_MLNK = load_MLE.gather(2, native_LNK.view(1, L, N * K).expand(M, L, N * K)).view(M, L, N, K)
    # the copies, from the step's totals (traffic replicas' step tokens sit on their GPUs)
    local_LNgf = _copies(native_MLNK.sum(0).view(L * N, K), pre_q.sum((0, 3)).view(L * N, g), g, El, free,
                         min_tokens).view(L, N, g, free)
    copy_e_LNgf = torch.where(local_LNgf >= 0, native_LNK.gather(2, local_LNgf.clamp(min=0).view(L, N, -1))
                              .view(L, N, g, free), -1)
    # per micro-batch: each expert's tokens split evenly over its instances, then rebalanced
    n_LNK = 1 + torch.zeros(L, N, K, dtype=torch.int64).scatter_add_(
        2, local_LNgf.clamp(min=0).view(L, N, -1), (local_LNgf >= 0).to(torch.int64).view(L, N, -1))
    share_MLNK = native_MLNK // n_LNK
    native_tok = native_MLNK - share_MLNK * (n_LNK - 1)                      # the native takes the rest
    copy_tok = torch.where(local_LNgf >= 0, share_MLNK.gather(3, local_LNgf.clamp(min=0).view(1, L, N, -1)
                                                               .expand(M, L, N, g * free)).view(M, L, N, g, free), 0)
    B = M * L * N
    se = torch.cat([native_LNK.view(1, L, N, g, El).expand(M, L, N, g, El), pre_e.view(M, L, N, g, r0),
                    copy_e_LNgf.expand(M, L, N, g, free)], -1).reshape(B, g, J)
    tok = torch.cat([native_tok.view(M, L, N, g, El), pre_q.view(M, L, N, g, r0), copy_tok], -1).reshape(B, g, J)
    movable = (torch.arange(J) < El) | (torch.arange(J) >= El + r0)
    movable = movable.view(1, 1, J) & (se >= 0)
    tok = _rebalance(se, tok, movable, 2 * g * J)
    return se.view(M, L, G, J).contiguous(), tok.view(M, L, G, J).contiguous()
