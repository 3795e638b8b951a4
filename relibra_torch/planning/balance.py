"""relibra's balancing replication: per micro-batch, layer and node, move load from the
busiest GPU to the least-loaded GPU with a free replica slot (see
:mod:`relibra_torch.planning.relibra`, whose planner runs it after the traffic replicas).
The expert copied is the one that moves the most tokens, counting those from other nodes
twice, so that copies also carry inter-node receive away from the giver (on the trace
families of docs/results.md: 0.5-1.7% shorter steps than copying the largest expert).

What a copy costs and saves, term by term of the cost model (``sim/cost.py``; per layer and
micro-batch). Copying expert e from the busiest GPU h to u with quota q:

* expert compute: h's load falls by q, so (h being the busiest GPU) the layer's compute
  falls by ``q * compute_s_per_token`` (forward + backward).
* all-to-all: the q tokens land on u instead of h. On one node, and under hierarchical
  dispatch (a token crosses to the node once and fans out over NVLink there), the node's
  inter-node traffic does not change and the NVLink rows only move between h and u
  (``+/- intra_node_s_per_token`` each): nothing to count. Under flat dispatch across nodes
  the copy takes h's remote tokens first (below), so each can also leave h's inter-node
  receive: up to ``cross_node_s_per_token`` more (``ReLibraConfig.saved_s_per_token``).
* fill: h sends the ``3 D F`` bf16 weights forward and u returns their fp32 gradients
  backward, over NVLink: ``replica_fill_s_per_expert`` per copy; a GPU's copies add on its
  link (a giver feeding three copies sends three), copies on different GPUs overlap.
* latency: the layer's first copy in a micro-batch adds the fill and the gradient return
  collectives (``ReLibraConfig.fill_latency_s``); further copies ride in them.

So each copy must take ``q >= replica_fill_s_per_expert / saved_s_per_token`` tokens
(``ReLibraConfig.min_replica_tokens_on``), and a layer's copies are then judged together
(``set_prices``): they stay only on nodes whose busiest GPU was above the layer's new
busiest (elsewhere they shorten nothing), and only if the drop of the layer's busiest GPU
load, times ``saved_s_per_token``, covers the busiest link's fills plus the latency (none
when a traffic replica of the micro-batch already issues those collectives).

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, G GPUs, g GPUs per
node, El native experts per GPU, R replica slots per GPU, J = El + R, B batched problems
(M * L * N).
"""

from __future__ import annotations

import numpy as np
import torch

from .residency import residency_masks_numpy
from .step_set import step_long_sets
from .topology import Topology

__all__ = ["align_slots", "cheapest_per_layer", "replicate", "replicate_node_rows", "replicate_step"]


def replicate(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
              min_tokens: int = 0, prefilled: tuple[torch.Tensor, torch.Tensor] | None = None,
              min_cross_tokens: int = 0, keep_prefilled: int = 0,
              set_prices: tuple[float, float, float] | None = None,
              free_empty: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
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
    that copy's residency, which needs tokens, covers it). ``set_prices``: ``(saved seconds
    per token moved, fill seconds per copy, latency seconds of a layer's first fill)``: judge
    each layer's copies together (module docstring); ``None`` or free fills: keep them all.
    ``free_empty``: a prefilled slot that holds nothing in a micro-batch is free for
    balancing there (the GPU's prefilled replicas move to its first slots; callers realign
    slots with :func:`align_slots` from slot ``El``), so traffic slots count per GPU: on a
    node where one GPU holds a hot remote expert, the others' slots can hold its copies.

    Returns:
        ``(slot_expert_MLGJ, slot_tokens_MLGJ)`` int64 ``[M, L, G, J]``.
    """
    M, L, S, E = loads_MLSE.shape
    N, g, El, R = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    G, J = topology.num_gpus, topology.slots_per_gpu
    # in numpy (integers only: the same values; _rounds and _sets_that_pay get torch views of
    # the same memory): some 60 small torch ops per call were much of its time on small steps
    place_LE = placement_LE.numpy()
    inverse_LE = np.empty_like(place_LE)
    inverse_LE[np.arange(L).reshape(L, 1), place_LE] = np.arange(E)
    native_LGl = inverse_LE.reshape(L, G, El)
    loads_MLSE = loads_MLSE.to(torch.int64)   # its sums in torch (the same integers; faster on large steps)
    load_MLE = loads_MLSE.sum(2).numpy()
    r0 = 0 if prefilled is None else prefilled[0].shape[-1]
    if prefilled is not None and r0:
        pre_e, pre_q = (t.numpy().astype(np.int64, copy=False) for t in prefilled)
        if free_empty:  # each GPU's prefilled replicas first, its empty prefilled slots after
            order = np.argsort((pre_e < 0).astype(np.int64), axis=-1, kind="stable")
            pre_e, pre_q = np.take_along_axis(pre_e, order, -1), np.take_along_axis(pre_q, order, -1)
        taken_MLE = np.zeros_like(load_MLE)
        np.add.at(taken_MLE, (np.arange(M).reshape(M, 1, 1), np.arange(L).reshape(1, L, 1),
                              np.maximum(pre_e, 0).reshape(M, L, -1)), (pre_q * (pre_e >= 0)).reshape(M, L, -1))
        load_MLE = load_MLE - taken_MLE
    l_L1 = np.arange(L).reshape(L, 1)
    rem_MLGl = load_MLE[:, l_L1, native_LGl.reshape(L, G * El)].reshape(M, L, G, El)
    # The part of each native's remaining load that comes from other nodes' sources (its
    # owner node's own demand stays; traffic replicas elsewhere took their nodes' demand).
    owner_node_LE = place_LE // El // g
    home_MLE = loads_MLSE.view(M, L, N, g, E).sum(3).numpy()[:, l_L1, owner_node_LE, np.arange(E)]
    remote_MLGl = np.maximum(load_MLE - home_MLE, 0)[:, l_L1, native_LGl.reshape(L, G * El)].reshape(M, L, G, El)
    B = M * L * N
    rem = rem_MLGl.reshape(B, g, El).copy()
    experts = np.broadcast_to(native_LGl.reshape(1, L, N, g, El), (M, L, N, g, El)).reshape(B, g, El)
    rep_expert = np.full((B, g, max(R, 1)), -1, dtype=np.int64)
    rep_quota = np.zeros((B, g, max(R, 1)), dtype=np.int64)
    used = np.zeros((B, g), dtype=np.int64)
    load = rem.sum(-1)
    if r0:
        rep_expert[..., :r0] = pre_e.reshape(B, g, r0)
        rep_quota[..., :r0] = pre_q.reshape(B, g, r0)
        used += (rep_expert[..., :r0] >= 0).sum(-1) if free_empty else r0
        load = load + rep_quota[..., :r0].sum(-1)
    target = (load.sum(-1) + g - 1) // g
    # What a GPU can give away: its native experts' remaining load, then its prefilled
    # replicas' quotas (a copy of those is filled from another node).
    kept = np.minimum(rep_quota[..., :r0], int(keep_prefilled))             # stays on the first copy
    giveable = np.concatenate([rem, rep_quota[..., :r0] - kept], -1)       # [B, g, El + r0]
    # ... and how much of it is remote (a cross-node copy's tokens are its node's own)
    give_remote = np.concatenate([remote_MLGl.reshape(B, g, El), np.zeros_like(rep_quota[..., :r0])], -1)
    give_expert = np.concatenate([experts, rep_expert[..., :r0]], -1)
    need_K = torch.tensor([min_tokens] * El + [min_cross_tokens] * r0, dtype=torch.int64)
    start = (rep_expert.copy(), rep_quota.copy(), giveable.copy(), load.copy(), used.copy())
    sent = _rounds(*map(torch.from_numpy, (load, target, used, giveable, give_remote, give_expert, rep_expert,
                                           rep_quota)), need_K, El, R, min_tokens, min_cross_tokens).numpy()
    if set_prices is not None and (set_prices[1] > 0 or set_prices[2] > 0):
        keep_B = _sets_that_pay(torch.from_numpy(start[3]), torch.from_numpy(load),
                                torch.from_numpy(np.maximum(sent, used - start[4])),
                                None if not r0 else torch.from_numpy((pre_q > 0).reshape(M, L, -1).any(-1)),
                                (M, L, N, g), *set_prices).numpy()
        drop = ~keep_B.reshape(B, 1, 1)
        rep_expert = np.where(drop, start[0], rep_expert)
        rep_quota = np.where(drop, start[1], rep_quota)
        giveable = np.where(drop, start[2], giveable)
    rem = giveable[..., :El]
    # prefilled replicas keep what they did not give (a free_empty slot may hold a copy)
    rep_quota[..., :r0] = np.where(start[0][..., :r0] >= 0, giveable[..., El:] + kept, rep_quota[..., :r0])
    slot_expert = np.concatenate([experts, rep_expert[..., :R]], -1).reshape(M, L, G, J)
    slot_tokens = np.concatenate([rem, rep_quota[..., :R]], -1).reshape(M, L, G, J)
    return torch.from_numpy(slot_expert), torch.from_numpy(slot_tokens)


def _rounds(load, target, used, giveable, give_remote, give_expert, rep_expert, rep_quota, need_K, El: int, R: int,
            min_tokens: int, min_cross_tokens: int) -> torch.Tensor:
    """:func:`replicate`'s greedy rounds on ``B`` independent (micro-batch, layer, node) rows,
    in place (module docstring): ``load [B, g]``, ``target [B]``, ``used [B, g]``, what each
    GPU can give ``giveable / give_remote / give_expert [B, g, K]`` (its natives, then its
    prefilled replicas), ``rep_expert / rep_quota [B, g, max(R, 1)]``, ``need_K``. Rows do not
    interact, so any subset of rows plans as in the whole batch. Returns ``sent [B, g]``:
    copies each GPU fills."""
    B, g = load.shape
    # in numpy, on the callers' tensors (shared memory): integers only (the same values), a
    # few hundred small ops whose per-call cost in torch was much of the planner's time
    load, used, giveable, give_remote, rep_expert, rep_quota = (
        t.numpy() for t in (load, used, giveable, give_remote, rep_expert, rep_quota))
    target, give_expert, need_K = target.numpy(), give_expert.numpy(), need_K.numpy()
    big = np.iinfo(np.int64).max
    rows = np.arange(B)
    sent = np.zeros((B, g), dtype=np.int64)
    for _ in range(g * R):
        h = load.argmax(-1)                       # busiest GPU (first on ties)
        excess = load[rows, h] - target
        # Among the busiest GPU's experts whose share would pay for its fill (at most the
        # least-loaded receiver's deficit, see below), the one that moves the most tokens,
        # counting those from other nodes twice: with the copy they can leave the giver's
        # inter-node receive too (token_split sends remote tokens to the instance whose GPU
        # receives less).
        below = (used < R) & (load < target[:, None])
        room = np.maximum(target - np.where(below, load, big).min(-1), 0)
        cand = giveable[rows, h]
        movable = np.minimum(cand, room[:, None])
        # an expert whose one copy closes the gap (moves all the giver's excess, or fills the
        # receiver) comes first: a copy that leaves the giver above the target for fewer remote
        # tokens priced higher (the remote ones are only the giver's inter-node receive)
        closes = movable >= np.minimum(np.maximum(excess, 0), room)[:, None]
        score = movable + np.minimum(movable, give_remote[rows, h]) + closes * (2 * cand.max(-1, keepdims=True) + 1)
        idx = np.where(movable >= need_K, score, -1).argmax(-1)
        expert_B = give_expert[rows, h, idx]
        holds = (rep_expert == expert_B[:, None, None]).any(-1)             # a GPU holds it already
        can_take = below & ~holds
        u = np.where(can_take, load, big).argmin(-1)
        deficit = target - load[rows, u]
        # A receiver's last free slot takes all it can, even past the giver's excess (the
        # giver then becomes a receiver with its own free slots): per-GPU slots, not total
        # slots, are what run out first.
        last_slot = used[rows, u] == R - 1
        give = np.where(last_slot, deficit, np.minimum(excess, deficit))
        amount = np.minimum(give, giveable[rows, h, idx])
        need = np.where(idx >= El, min_cross_tokens, min_tokens)
        active = (excess > 0) & can_take.any(-1) & (amount > 0) & (amount >= need)
        if not active.any():
            break
        r, hh, uu, ii = rows[active], h[active], u[active], idx[active]
        amt = amount[active]
        slot = used[r, uu]
        rep_expert[r, uu, slot] = give_expert[r, hh, ii]
        rep_quota[r, uu, slot] = amt
        used[r, uu] += 1
        sent[r, hh] += 1
        giveable[r, hh, ii] -= amt
        give_remote[r, hh, ii] = np.maximum(give_remote[r, hh, ii] - amt, 0)   # copies take remote first
        load[r, hh] -= amt
        load[r, uu] += amt
    return torch.from_numpy(sent)


def replicate_node_rows(load_MLE: torch.Tensor, home_MLE: torch.Tensor, natives_Lgl: torch.Tensor, R: int, r0: int,
                        min_tokens: int, min_cross_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`replicate`'s rows of one node per layer, with ``r0`` empty prefilled slots
    (traffic replicas that found nothing worth a fill), without ``set_prices``: the node's
    ``g`` GPUs hold ``natives_Lgl`` (int64 ``[L', g, El]``, in slot order), ``load_MLE`` and
    ``home_MLE`` (int64 ``[M, L', E]``) are each expert's load and the node's own demand for
    it. Exactly those rows of :func:`replicate`'s plan (rows do not interact), for a fraction
    of its cost. Returns ``(rep_expert_MLgR, load_MLg)``: each GPU's replica slots (``-1``
    empty) and its load after balancing."""
    M, Lx, E = load_MLE.shape
    _, g, El = natives_Lgl.shape
    B = M * Lx
    idx = natives_Lgl.reshape(1, Lx, g * El).expand(M, Lx, g * El)
    rem = load_MLE.gather(2, idx).view(B, g, El)
    remote = (load_MLE - home_MLE).clamp(min=0).gather(2, idx).view(B, g, El)
    empty = torch.zeros(B, g, r0, dtype=torch.int64)
    rep_expert = torch.full((B, g, max(R, 1)), -1, dtype=torch.int64)
    rep_quota = torch.zeros(B, g, max(R, 1), dtype=torch.int64)
    used = torch.full((B, g), r0, dtype=torch.int64)
    load = rem.sum(-1)
    target = (load.sum(-1) + g - 1) // g
    give_expert = torch.cat([natives_Lgl.unsqueeze(0).expand(M, Lx, g, El).reshape(B, g, El), empty - 1], -1)
    need_K = torch.tensor([min_tokens] * El + [min_cross_tokens] * r0, dtype=torch.int64)
    _rounds(load, target, used, torch.cat([rem, empty], -1), torch.cat([remote, empty], -1), give_expert, rep_expert,
            rep_quota, need_K, El, R, min_tokens, min_cross_tokens)
    return rep_expert[..., :R].view(M, Lx, g, R), load.view(M, Lx, g)


def _sets_that_pay(before_Bg, after_Bg, copies_Bg, pre_ML, shape, saved_s, fill_s, latency_s) -> torch.Tensor:
    """bool ``[B]``: the (micro-batch, layer, node) rows whose balancing copies stay (module
    docstring): their node's busiest GPU was above the layer's new busiest, and the layer's
    drop of its busiest GPU's load pays for the busiest link's fills plus the latency.
    ``copies_Bg``: copies each GPU sends or receives; ``pre_ML``: bool, a prefilled replica has
    tokens in that micro-batch and layer (its collectives are issued anyway), or ``None``."""
    M, L, N, g = shape
    before_MLN = before_Bg.view(M, L, N, g).amax(-1)
    after_ML = after_Bg.view(M, L, N * g).amax(-1)
    lowers_MLN = before_MLN > after_ML.unsqueeze(-1)
    fills_ML = (copies_Bg.view(M, L, N, g) * lowers_MLN.unsqueeze(-1)).flatten(2).amax(-1)
    latency_ML = torch.full((M, L), float(latency_s), dtype=torch.float64)
    if pre_ML is not None:
        latency_ML = latency_ML.masked_fill(pre_ML, 0.0)
    saved_ML = (before_MLN.amax(-1) - after_ML).to(torch.float64) * saved_s
    pays_ML = saved_ML >= fills_ML.to(torch.float64) * fill_s + latency_ML
    return (lowers_MLN & pays_ML.unsqueeze(-1)).reshape(-1)


def align_slots(slot_expert_MLGJ: torch.Tensor, slot_tokens_MLGJ: torch.Tensor,
                first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan with each GPU's slots ``first..J-1`` permuted per micro-batch so that a copy
    the GPU also held in the previous micro-batch sits in the same slot: its residency then
    continues (one fill for the run, ``planning.residency``) instead of ending. Loads and
    token counts per (GPU, expert) are unchanged. Returns new ``[M, L, G, J]`` tensors."""
    se, st = (t.clone(memory_format=torch.contiguous_format) for t in (slot_expert_MLGJ, slot_tokens_MLGJ))
    M, L, G, J = se.shape
    k = J - first
    if M < 2 or k <= 1:  # one slot (or none) to permute: nothing moves
        return se, st
    # in numpy on se and st (shared memory): integers only, one short step per micro-batch,
    # rows [X = L G, k] indexed directly (numpy's take/put_along_axis cost more than the step)
    se_n, st_n = se.numpy().reshape(M, L * G, J), st.numpy().reshape(M, L * G, J)
    rows = np.arange(L * G).reshape(-1, 1)
    for m in range(1, M):
        prev, cur, tok = se_n[m - 1, :, first:], se_n[m, :, first:], st_n[m, :, first:]
        match = (prev[..., :, None] == cur[..., None, :]) & (prev >= 0)[..., None]   # [X, k, j]
        matched_j = match.any(-2)
        taken_k = match.any(-1)
        # a matched copy keeps its previous slot k; the others take the free slots in order
        own_k = match.argmax(-2)
        free_k = np.argsort(taken_k, axis=-1, kind="stable")
        rank_j = np.cumsum(~matched_j, -1) - 1
        dest = np.where(matched_j, own_k, free_k[rows, np.maximum(rank_j, 0)])
        new_e, new_t = np.empty_like(cur), np.empty_like(tok)
        new_e[rows, dest] = cur
        new_t[rows, dest] = tok
        se_n[m, :, first:], st_n[m, :, first:] = new_e, new_t
    return se, st


def step_price_L(slot_expert_MLGJ, slot_tokens_MLGJ, owner_LE, saved_s, fill_s, latency_s) -> torch.Tensor:
    """float64 ``[L]``: the step's busiest-GPU load (``saved_s`` per token) plus its replica
    residencies, each charged ``fill_s`` on the busier of its owner's and its GPU's link in
    the micro-batch it starts, plus ``latency_s`` in every micro-batch where one starts."""
    M, L, G, J = slot_expert_MLGJ.shape
    # in numpy (integer counts, then the same float64 products and sums per element; the
    # sum over micro-batches stays torch's): a few dozen small torch ops per candidate
    se = slot_expert_MLGJ.numpy()
    owner = owner_LE.numpy()[np.arange(L).reshape(1, L, 1, 1), np.maximum(se, 0)]
    fill = (se >= 0) & (owner != np.arange(G).reshape(1, 1, G, 1))
    start = residency_masks_numpy(se.reshape(M, -1), fill.reshape(M, -1),
                                  slot_tokens_MLGJ.numpy().reshape(M, -1))[0].reshape(M, L, G, J)
    recv = start.sum(-1)
    ml_G = (np.arange(M * L) * G).reshape(M, L, 1, 1)
    sent = np.bincount((ml_G + owner)[start], minlength=M * L * G).reshape(M, L, G)
    busiest = slot_tokens_MLGJ.numpy().sum(-1).max(-1).astype(np.float64)
    return torch.from_numpy(busiest * saved_s + np.maximum(sent, recv).max(-1).astype(np.float64) * fill_s
                            + start.reshape(M, L, -1).any(-1).astype(np.float64) * latency_s).sum(0)


def replicate_step(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                   min_tokens: int, prefilled, min_cross_tokens: int, keep_prefilled: int,
                   set_prices: tuple[float, float, float], free_empty: bool = False, extra: list | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`replicate` aware of residencies, per layer the cheapest of its plans.

    Per micro-batch, copies must pay their own fill (``min_tokens``, ``set_prices``). But a
    copy that the next micro-batches repeat on the same GPU is filled once for the run
    (``planning.residency``), as EPLB's step-long copies are: so a second plan lets copies
    take ``min_tokens / M`` tokens (their fill shared by the step's M micro-batches), both
    plans' copies keep their slots across micro-batches (:func:`align_slots`), and each layer
    keeps the plan whose step price (:func:`step_price_L`: busiest GPU load, residency fills
    on the busiest link, latency) is lowest. In the second plan a second copy of a traffic
    replica shares its fill too (``min_cross_tokens / M``: with ``two_hop`` it fills from the
    node's first copy over NVLink, once per residency). More plans are step-long: one
    balanced on the step's totals (without traffic replicas), and those over every free slot
    of each node with quotas per micro-batch, without and with a cap on the copies one GPU
    fills (:func:`relibra_torch.planning.step_set.step_long_sets`). The capped sets are not
    weighed here: this step price leaves out the all-to-all and the second hops, and on a
    collapsed router it preferred a capped set that the exact price puts 2% higher. Where
    one prices below the plan kept here in some layer, one more plan is appended to
    ``extra`` (a list, when given) for the caller to weigh at the exact price
    (``planning.plain``): per layer the capped set of lowest step price where it is below
    the plan kept, else the plan kept.
    Arguments as :func:`replicate` (``free_empty``: its plans ``a`` and ``b``)."""
    M = loads_MLSE.shape[0]
    first = topology.experts_per_gpu + (0 if prefilled is None or free_empty else prefilled[0].shape[-1])
    a = align_slots(*replicate(loads_MLSE, topology, placement_LE, min_tokens, prefilled, min_cross_tokens,
                               keep_prefilled, set_prices, free_empty), first)
    saved_s, fill_s, latency_s = set_prices
    if M < 2 or (fill_s <= 0 and latency_s <= 0) or min_tokens <= 0 or min_tokens == torch.iinfo(torch.int64).max:
        return a
    if int(loads_MLSE.sum((0, 2)).max()) < min_tokens:  # no expert has a fill's worth in the whole step
        return a
    b = align_slots(*replicate(loads_MLSE, topology, placement_LE, -(-min_tokens // M), prefilled,
                               -(-min_cross_tokens // M), keep_prefilled, None, free_empty), first)
    plans = [a, b]
    if prefilled is None:  # a step-long set: balanced on the step's totals, same copies all step
        c = replicate(loads_MLSE.sum(0, keepdim=True), topology, placement_LE, min_tokens, None, min_cross_tokens)
        plans.append(_spread(c[0].expand(M, *c[0].shape[1:]), c[1][0], loads_MLSE.sum(2), topology.experts_per_gpu))
    # every free slot of a node, all step, quotas per micro-batch (planning.step_set)
    sets = step_long_sets(loads_MLSE, topology, placement_LE, min_tokens, prefilled, keep_prefilled, extra is not None)
    plans.append(sets[0])
    owner_LE = placement_LE // topology.experts_per_gpu
    price_PL = torch.stack([step_price_L(*p, owner_LE, saved_s, fill_s, latency_s) for p in plans])
    chosen = cheapest_per_layer(plans, price_PL)
    if extra is not None and len(sets) > 1:  # the same with at most c copies filled from one GPU
        capped_PL = torch.stack([step_price_L(*p, owner_LE, saved_s, fill_s, latency_s) for p in sets[1:]])
        # per layer the capped set of lowest step price where it is below the choice, else the choice
        beats_L = capped_PL.min(0).values < price_PL.min(0).values
        if bool(beats_L.any()):
            extra.append(cheapest_per_layer([chosen, *sets[1:]], torch.cat([
                torch.where(beats_L, float("inf"), 0.0).unsqueeze(0), capped_PL])))
    return chosen


def cheapest_per_layer(plans: list[tuple[torch.Tensor, torch.Tensor]], price_PL: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(slot_expert_MLGJ, slot_tokens_MLGJ)`` taking each layer from the plan of ``plans``
    (``P`` pairs of int64 ``[M, L, G, J]``) with the lowest ``price_PL`` (float64 ``[P, L]``),
    the first on ties."""
    pick = price_PL.argmin(0).view(1, -1, 1, 1)
    out = [plans[0][i].clone() for i in (0, 1)]
    for k in range(1, len(plans)):
        for i in (0, 1):
            out[i] = torch.where(pick == k, plans[k][i], out[i])
    return out[0].contiguous(), out[1].contiguous()


def _spread(slot_expert_MLGJ: torch.Tensor, quota_LGJ: torch.Tensor, load_MLE: torch.Tensor, El: int) -> tuple:
    """Per micro-batch quotas for a step-long set of slots planned with step quotas
    ``quota_LGJ``: each instance takes its share of the expert's micro-batch load (integer
    floor), the native slot the rest."""
    M, L, G, J = slot_expert_MLGJ.shape
    E = load_MLE.shape[-1]
    se = slot_expert_MLGJ.reshape(M, L, G * J)
    idx = se.clamp(min=0)
    q = torch.where(se >= 0, quota_LGJ.reshape(1, L, G * J).expand(M, L, G * J), 0)
    total = torch.zeros(M, L, E, dtype=torch.int64).scatter_add_(2, idx, q).gather(2, idx)
    share = torch.where(q > 0, load_MLE.gather(2, idx) * q // total.clamp(min=1), 0)
    native = torch.arange(G * J).view(1, 1, G * J) % J < El                 # slots 0..El-1: natives
    rest = load_MLE - torch.zeros_like(load_MLE).scatter_add_(2, idx, torch.where(native, 0, share))
    tokens = torch.where(native & (se >= 0), rest.gather(2, idx), torch.where(native, 0, share))
    return slot_expert_MLGJ.contiguous(), tokens.view(M, L, G, J)
