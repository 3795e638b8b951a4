"""The planner's greedy rounds as torch ran them before they moved to numpy
(verbatim): references that tests/test_rounds_numpy.py compares the numpy rounds (and
``balance.align_slots``) against, bit for bit."""

from __future__ import annotations

import torch

_BIG = torch.iinfo(torch.int64).max

def copies(w_BK: torch.Tensor, own_BgK: torch.Tensor, fixed_Bg: torch.Tensor, free: int,
            min_tokens: int, home_K: torch.Tensor | None = None, cap: int = 0, marginal: bool = False) -> torch.Tensor:
    """``step_set._copies`` as it ran in torch (``marginal``, the margin rule, added since)."""
    B, g, K = own_BgK.shape
    rows = torch.arange(B)
    own_BgK = own_BgK.clone()
    n_BK = own_BgK.sum(1).clamp(min=1)
    out = torch.full((B, g, max(free, 0)), -1, dtype=torch.int64)
    used = torch.zeros(B, g, dtype=torch.int64)
    sends_Bg = torch.zeros(B, g, dtype=torch.int64)
    wf = w_BK.to(torch.float64)
    for _ in range(g * free):
        load_Bg = (own_BgK * (wf / n_BK).unsqueeze(1)).sum(-1) + fixed_Bg.to(torch.float64)
        room_Bg = used < free
        # an item can gain an instance where a GPU with room lacks it, and its share pays
        addable_BK = ((~own_BgK) & room_Bg.unsqueeze(-1)).any(1) & (
            w_BK >= min_tokens * (n_BK + 1) * (n_BK if marginal else 1))
        if cap > 0:  # ... and its home GPU sends fewer than cap copies
            addable_BK &= sends_Bg[:, home_K] < cap
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
        if cap > 0:
            sends_Bg[r, home_K[kk]] += 1
    return out


def rebalance(item_BgJ: torch.Tensor, tok_BgJ: torch.Tensor, keep_BgJ: torch.Tensor, items: int,
               rounds: int) -> torch.Tensor:
    """``step_set._rebalance`` as it ran in torch."""
    B, g, J = item_BgJ.shape
    rows = torch.arange(B)
    tok = tok_BgJ.clone()
    # once: each item's slot on every GPU (-1: none), then each slot's peers on the other GPUs
    valid = item_BgJ >= 0
    flat = torch.where(valid, item_BgJ * g + torch.arange(g).view(1, g, 1), items * g)
    inst_BIg = torch.full((B, items * g + 1), -1, dtype=torch.int64).scatter_(
        1, flat.view(B, -1), torch.arange(J).expand(B, g, J).reshape(B, -1))[:, :-1].view(B, items, g)
    peer_BgJh = inst_BIg.gather(1, item_BgJ.clamp(min=0).view(B, g * J, 1).expand(B, g * J, g)).view(B, g, J, g)
    peer_BgJh = peer_BgJh.masked_fill(~valid.unsqueeze(-1) | torch.eye(g, dtype=torch.bool).view(1, g, 1, g), -1)
    for _ in range(rounds):
        load = tok.sum(-1)
        h = load.argmax(-1)
        peer_BJh = peer_BgJh[rows, h]                                            # [B, J, g]
        cand = load.unsqueeze(1).expand(B, J, g).masked_fill(peer_BJh < 0, _BIG)
        u_BJ = cand.argmin(-1)
        gap = load[rows, h].unsqueeze(1) - cand.gather(-1, u_BJ.unsqueeze(-1)).squeeze(-1)
        amount_BJ = torch.minimum(tok[rows, h] - keep_BgJ[rows, h], (gap // 2).clamp(min=0))
        amount_BJ = amount_BJ.masked_fill((peer_BJh < 0).all(-1), 0)
        j = amount_BJ.argmax(-1)
        amt = amount_BJ[rows, j]
        # moves under 1/256 of the busiest GPU's load (< 0.4% of its compute) are not worth a round
        amt = amt * (amt > load[rows, h] // 256)
        if not (amt > 0).any():
            break
        u = u_BJ[rows, j]
        ju = peer_BJh[rows, j, u].clamp(min=0)
        tok[rows, h, j] -= amt
        tok[rows, u, ju] += amt
    return tok


def rounds(load, target, used, giveable, give_remote, give_expert, rep_expert, rep_quota, need_K, El: int, R: int,
            min_tokens: int, min_cross_tokens: int) -> torch.Tensor:
    """``balance._rounds`` as it ran in torch."""
    B, g = load.shape
    rows = torch.arange(B)
    sent = torch.zeros(B, g, dtype=torch.int64)
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
        # a copy that closes the gap (all the giver's excess, or the receiver's deficit) first
        closes = movable >= torch.minimum(excess.clamp(min=0), room).unsqueeze(1)
        score = movable + torch.minimum(movable, give_remote[rows, h]) + closes * (2 * cand.amax(-1, keepdim=True) + 1)
        idx = score.masked_fill(~pays, -1).argmax(-1)
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
        sent[r, hh] += 1
        giveable[r, hh, ii] -= amt
        give_remote[r, hh, ii] = (give_remote[r, hh, ii] - amt).clamp(min=0)   # copies take remote first
        load[r, hh] -= amt
        load[r, uu] += amt
    return sent


def even_receive(remote_MLX: torch.Tensor, quota_MLX: torch.Tensor, e_MLX: torch.Tensor,
                  valid_MLX: torch.Tensor, topo: Topology) -> torch.Tensor:
    """``plan._even_receive`` as it ran in torch."""
    M, L, X = remote_MLX.shape
    G, J, g, N, E = topo.num_gpus, topo.slots_per_gpu, topo.gpus_per_node, topo.num_nodes, topo.num_experts
    if g < 2 or N < 2 or M * L == 0:
        return remote_MLX
    gpu_X = torch.arange(X) // J
    # slot of expert e on GPU q, -1 if none (column E collects empty slots and stays -1)
    inst_MLQ = torch.full((M, L, G * (E + 1)), -1, dtype=torch.int64)
    key_MLX = gpu_X * (E + 1) + torch.where(valid_MLX, e_MLX, E)
    inst_MLQ.scatter_(2, key_MLX, torch.arange(X).expand(M, L, X).contiguous())
    inst_MLQ.view(M, L, G, E + 1)[..., E] = -1
    node_gpus_N1g = (torch.arange(N).view(N, 1) * g + torch.arange(g)).view(N, 1, g)
    P = M * L * N
    rows_P = torch.arange(P)
    base_P = (torch.arange(M * L) * X).repeat_interleave(N)
    remote = remote_MLX.clone()
    for _ in range(g * J):
        recv_MLNg = torch.zeros(M, L, G, dtype=torch.int64).scatter_add_(
            2, gpu_X.expand(M, L, X), remote).view(M, L, N, g)
        hi_MLN = recv_MLNg.argmax(-1)                                    # busiest GPU (local index)
        xs_MLNJ = (torch.arange(N).view(N, 1) * g + hi_MLN.unsqueeze(-1)) * J + torch.arange(J)
        xs = xs_MLNJ.view(M, L, N * J)
        e_hi = torch.where(valid_MLX.gather(2, xs), e_MLX.gather(2, xs), E).view(M, L, N, J, 1)
        ys_MLNJg = inst_MLQ.gather(2, (node_gpus_N1g * (E + 1) + e_hi).reshape(M, L, -1)).view(M, L, N, J, g)
        ys = ys_MLNJg.clamp(min=0).view(M, L, -1)
        local_y = (quota_MLX.gather(2, ys) - remote.gather(2, ys)).view(M, L, N, J, g)
        gap_MLNg = (recv_MLNg.gather(3, hi_MLN.unsqueeze(-1)) - recv_MLNg) // 2
        t_MLNJg = torch.minimum(torch.minimum(remote.gather(2, xs).view(M, L, N, J, 1), local_y),
                                gap_MLNg.unsqueeze(3))
        t_PW = torch.where(ys_MLNJg >= 0, t_MLNJg, 0).clamp(min=0).view(P, J * g)
        best_P = t_PW.argmax(1)
        t_P = t_PW[rows_P, best_P]
        if not bool((t_P > 0).any()):
            break
        x_P = xs_MLNJ.reshape(P, J)[rows_P, best_P // g]
        y_P = ys_MLNJg.reshape(P, J * g)[rows_P, best_P].clamp(min=0)
        flat = remote.view(-1)
        flat.index_add_(0, base_P + x_P, -t_P)  # rows are disjoint (m, l, node) slot sets
        flat.index_add_(0, base_P + y_P, t_P)
    return remote


def align_slots(slot_expert_MLGJ: torch.Tensor, slot_tokens_MLGJ: torch.Tensor,
                first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``balance.align_slots`` as it ran in torch."""
    se, st = slot_expert_MLGJ.clone(), slot_tokens_MLGJ.clone()
    for m in range(1, se.shape[0] if first < se.shape[-1] else 0):
        prev, cur, tok = se[m - 1, ..., first:], se[m, ..., first:], st[m, ..., first:]
        match = (prev.unsqueeze(-1) == cur.unsqueeze(-2)) & (prev >= 0).unsqueeze(-1)   # [L, G, k, j]
        matched_j = match.any(-2)
        taken_k = match.any(-1)
        # a matched copy keeps its previous slot k; the others take the free slots in order
        own_k = match.to(torch.int64).argmax(-2)
        free_k = torch.sort(taken_k.to(torch.int64), dim=-1, stable=True).indices
        rank_j = (~matched_j).to(torch.int64).cumsum(-1) - 1
        dest = torch.where(matched_j, own_k, free_k.gather(-1, rank_j.clamp(min=0)))
        se[m, ..., first:] = torch.empty_like(cur).scatter_(-1, dest, cur)
        st[m, ..., first:] = torch.empty_like(tok).scatter_(-1, dest, tok)
    return se, st
