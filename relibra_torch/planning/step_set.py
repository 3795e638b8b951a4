"""relibra's step-long replica set over every free slot of a node, with per-micro-batch quotas.

A candidate of balancing's residency-aware choice (:func:`relibra_torch.planning.balance.replicate_step`,
which keeps per layer the cheapest of its plans at their step price). Per (layer, node):

* **which copies, all step**: while a GPU of the node has a free replica slot, the node's
  native expert with the most step tokens per instance gets one more instance, on the GPU
  with the least projected step load (each expert's step tokens shared evenly by its
  instances) that has a free slot and does not hold it, as long as the new instance's
  share of the step's tokens, ``w / (n + 1)``, is at least ``min_tokens`` (a fill's worth of
  tokens: each copy keeps its slot all step, so it is filled once and its gradient goes home
  once, ``planning.residency``): the *share rule*. The *margin rule* (:func:`margin_sets`)
  asks instead that the new instance take a fill's worth off each existing one,
  ``w / (n (n + 1)) >= min_tokens``.
* **how many tokens each instance takes, per micro-batch**: what replay knows and a
  step-long placement from step totals does not. Start from an even split of the
  micro-batch's tokens over the expert's instances, then repeatedly move tokens from the
  node's busiest GPU to the least loaded GPU holding another instance of one of its
  experts, half the gap at most, the expert that moves the most first, until no move
  reaches 1/256 of the busiest GPU's load. Every instance
  keeps its slot whatever its quota, so quotas change nothing in the fills.

Traffic replicas (``prefilled``, their slots first): one that holds the same expert in
every micro-batch is shared like a native when ``keep_prefilled`` (two-hop replicas): its
copies on the node fill from it over NVLink (``planning.two_hop``), so the hot remote
expert spreads over the node for one inter-node fill, and it keeps a token wherever it has
some, so that its residency spans theirs. The others keep their quotas. A traffic
replica's expert is another node's, never among a node's natives. Integer arithmetic
on counts, plus one float64 ratio per round: the same loads give the same plan everywhere.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, G GPUs, g GPUs per
node, El native experts per GPU, R replica slots per GPU, J = El + R, r0 prefilled slots
per GPU, f = R - r0 free slots per GPU, K = g * El native experts of a node, P = g * r0
traffic slots of a node, I = K + P items a copy can share, B rows (L * N, or M * L * N),
h a GPU of the node (the other end of a move).
"""

from __future__ import annotations

import numpy as np
import torch

from .topology import Topology

__all__ = ["margin_sets", "step_long_set", "step_long_sets"]

_BIG = torch.iinfo(torch.int64).max
# the most (micro-batch, slot) pairs whose caps are planned in one pass: below it each op's
# fixed cost dominates; above it, the rounds of the cap that needs most would run on all
_STACK_SLOTS = 1 << 14


def _copies(w_BK: torch.Tensor, own_BgK: torch.Tensor, fixed_Bg: torch.Tensor, free: int,
            min_tokens: int, home_K: torch.Tensor | None = None, cap: int = 0, marginal: bool = False) -> torch.Tensor:
    """int64 ``[B, g, free]`` item (``0..K-1``, ``-1`` none) copied into each free slot.
    ``w_BK``: each item's step tokens; ``own_BgK``: the GPUs that hold its expert already;
    ``fixed_Bg``: step tokens of what no copy can share; ``cap > 0``: at most ``cap`` copies
    fill from one GPU (``home_K``: each item's GPU in the node, the one its copies fill from);
    ``marginal``: the margin rule, ``w / (n (n + 1)) >= min_tokens`` for an item's ``n + 1``-th
    instance (:func:`margin_sets`)."""
    B, g, K = own_BgK.shape
    # in numpy (integers, and float64 shares compared, not summed; the loads' sums stay in
    # torch, the same floats): torch's per-call cost on these small tensors was most of it
    own = own_BgK.numpy().copy()
    n_BK = np.maximum(own.sum(1), 1)
    out = np.full((B, g, max(free, 0)), -1, dtype=np.int64)
    used = np.zeros((B, g), dtype=np.int64)
    sends_Bg = np.zeros((B, g), dtype=np.int64)
    w = w_BK.numpy()
    # each item's share per instance, float64 w / n (the same division as torch's), updated
    # where n changes; torch reads it through a view of the same memory
    share = w.astype(np.float64) / n_BK
    own_t, share_t1 = torch.from_numpy(own), torch.from_numpy(share).unsqueeze(1)
    fixed = fixed_Bg.to(torch.float64)
    home = None if home_K is None else home_K.numpy()
    rows = np.arange(B)
    for _ in range(g * free):
        load_Bg = ((own_t * share_t1).sum(-1) + fixed).numpy()
        room_Bg = used < free
        # an item can gain an instance where a GPU with room lacks it, and its share pays
        addable_BK = ((~own) & room_Bg[..., None]).any(1) & (w >= min_tokens * (n_BK + 1) * (n_BK if marginal else 1))
        if cap > 0:  # ... and its home GPU sends fewer than cap copies
            addable_BK &= sends_Bg[:, home] < cap
        if not addable_BK.any():
            break
        k = np.where(addable_BK, share, -1.0).argmax(-1)
        active = addable_BK[rows, k]
        can_Bg = room_Bg & ~own[rows, :, k]
        u = np.where(can_Bg, load_Bg, np.inf).argmin(-1)
        r, uu, kk = rows[active], u[active], k[active]
        out[r, uu, used[r, uu]] = kk
        own[r, uu, kk] = True
        n_BK[r, kk] += 1
        share[r, kk] = w[r, kk] / n_BK[r, kk]
        used[r, uu] += 1
        if cap > 0:
            sends_Bg[r, home[kk]] += 1
    return torch.from_numpy(out)


def _rebalance(item_BgJ: torch.Tensor, tok_BgJ: torch.Tensor, keep_BgJ: torch.Tensor, items: int,
               rounds: int) -> torch.Tensor:
    """Quotas ``tok_BgJ`` with tokens moved between instances of one item (same index
    ``0..items-1`` in ``item_BgJ``; ``-1``: a slot whose tokens stay) from the busiest GPU
    toward the least loaded (module docstring); a slot keeps at least ``keep_BgJ`` tokens."""
    B, g, J = item_BgJ.shape
    # in numpy: integers only (the same values), a few hundred small ops whose per-call
    # cost in torch was most of the planner's time on small loads
    tok = tok_BgJ.clone()
    tok_n, keep_n, item_n = tok.numpy(), keep_BgJ.numpy(), item_BgJ.numpy()
    # once: each item's slot on every GPU (-1: none), then each slot's peers on the other GPUs
    valid = item_n >= 0
    flat = np.where(valid, item_n * g + np.arange(g).reshape(1, g, 1), items * g).reshape(B, g * J)
    inst_BIg = np.full((B, items * g + 1), -1, dtype=np.int64)
    inst_BIg[np.arange(B).reshape(B, 1), flat] = np.tile(np.arange(J), g)     # a GPU holds an item once
    inst_BIg = inst_BIg[:, :-1].reshape(B, items, g)
    peer_n = np.take_along_axis(inst_BIg, np.maximum(item_n, 0).reshape(B, g * J, 1), 1).reshape(B, g, J, g)
    peer_n[~valid] = -1
    peer_n[:, np.arange(g), :, np.arange(g)] = -1
    lone_n = (peer_n < 0).all(-1)                                                # [B, g, J]: no peer
    rows_n = np.arange(B)
    load = tok_n.sum(-1)
    for _ in range(rounds):
        h = load.argmax(-1)
        peer_BJh = peer_n[rows_n, h]                                            # [B, J, g]
        cand = np.where(peer_BJh < 0, _BIG, load[:, None, :])
        u_BJ = cand.argmin(-1)
        load_h = load[rows_n, h]
        gap = load_h[:, None] - cand.min(-1)
        amount_BJ = np.minimum(tok_n[rows_n, h] - keep_n[rows_n, h], np.maximum(gap // 2, 0))
        amount_BJ[lone_n[rows_n, h]] = 0
        j = amount_BJ.argmax(-1)
        amt = amount_BJ[rows_n, j]
        # moves under 1/256 of the busiest GPU's load (< 0.4% of its compute) are not worth a round
        amt = amt * (amt > load_h // 256)
        if not (amt > 0).any():
            break
        u = u_BJ[rows_n, j]
        ju = np.maximum(peer_BJh[rows_n, j, u], 0)
        tok_n[rows_n, h, j] -= amt
        tok_n[rows_n, u, ju] += amt
        load[rows_n, h] -= amt
        load[rows_n, u] += amt
    return tok


def step_long_set(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, min_tokens: int,
                  prefilled: tuple[torch.Tensor, torch.Tensor] | None = None,
                  keep_prefilled: int = 0, cap: int = 0, marginal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The step-long candidate of the module docstring (``cap > 0``: at most ``cap`` copies
    filled from one GPU, see :func:`step_long_sets`; ``marginal``: the margin rule of
    :func:`margin_sets` instead of the share rule).

    Args:
        loads_MLSE: int ``[M, L, S, E]``; placement_LE: int64 ``[L, E]`` native slot per expert.
        min_tokens: fewest step tokens a copy's share must reach (its one fill's worth).
        prefilled: ``(expert_MLGr, quota_MLGr)`` traffic replicas in the first ``r0`` replica
            slots, as :func:`relibra_torch.planning.balance.replicate` takes them.
        keep_prefilled: tokens a traffic replica keeps when it shares its quota with copies
            (``ReLibraConfig.two_hop``: 1, so that its residency, the copies' hub, spans
            theirs); 0: traffic replicas are not shared (a copy would fill across nodes).
    Returns:
        ``(slot_expert_MLGJ, slot_tokens_MLGJ)`` int64 ``[M, L, G, J]``; the copies keep
        their slots in every micro-batch.
    """
    return _planner(loads_MLSE, topology, placement_LE, min_tokens, prefilled, keep_prefilled)[0]([cap], marginal)[0][0]


def margin_sets(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor,
                min_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step-long set (no traffic replicas, no cap) by the share rule of the module
    docstring, then by the **margin rule** where that copies anything differently: an item
    gets its ``n + 1``-th instance only where that takes a fill's worth off each of its
    ``n`` instances, ``w / n - w / (n + 1) = w / (n (n + 1)) >= min_tokens``, instead of
    the new instance's own share ``w / (n + 1) >= min_tokens``. The rules agree on the first
    copy. Every copy of an item fills from the same GPU, whose link carries one more fill and
    gradient return per copy, while the item's busiest instance falls by ``w / (n (n + 1))``
    tokens only; but a copy on a GPU also keeps that GPU's own tokens for the item off the
    all-to-all, which the margin rule does not count. Neither rule prices lower everywhere
    (``docs/results.md``, "The light plan weighs the margin rule"), so the light plan
    (:mod:`~relibra_torch.planning.light`) prices both where its window holds the second.
    Arguments as :func:`step_long_set`; one or two ``(slot_expert_MLGJ, slot_tokens_MLGJ)``
    pairs, the share rule's first."""
    plan, copies = _planner(loads_MLSE, topology, placement_LE, min_tokens, None, 0)
    share_BGf, margin_BGf = copies(0, False), copies(0, True)
    if torch.equal(share_BGf, margin_BGf):
        return plan([0], local=share_BGf)[0]
    return plan([0, 0], local=torch.cat([share_BGf, margin_BGf]))[0]


def step_long_sets(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, min_tokens: int,
                   prefilled: tuple[torch.Tensor, torch.Tensor] | None = None,
                   keep_prefilled: int = 0, capped: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The step-long set without a cap, then with at most ``c`` copies filled from one GPU
    for each ``c`` of 1, 2, 4, 8, ... below the most any GPU fills without a cap:
    every free slot taken by the items with the most tokens per instance piles a hot
    expert's fills and gradient returns on its owner's link (``max(sent, received)`` per
    GPU), and fewer copies of it, more of the next ones, can cost less fill than the
    compute they leave (``switch-8/zipf/t16x64/1x8`` on H800 at 16 micro-batches: 15.2 ms
    against 18.7 ms for the layers' experts, eplb 17.8 ms). Which is cheapest is for the
    caller's price (``balance.replicate_step``). Arguments as :func:`step_long_set`;
    ``capped=False``: the set without a cap alone."""
    plan = _planner(loads_MLSE, topology, placement_LE, min_tokens, prefilled, keep_prefilled)[0]
    out, most = plan([0])
    caps = [1 << i for i in range(max(most - 1, 0).bit_length())] if capped else []   # 1, 2, 4, ... < most
    M, L, _, _ = loads_MLSE.shape
    if M * L * topology.num_gpus * topology.slots_per_gpu <= _STACK_SLOTS:  # small: one pass for all caps
        return out + (plan(caps)[0] if caps else [])
    return out + [plan([c])[0][0] for c in caps]   # large: each cap's rounds stop when its own rows are done


def _planner(loads_MLSE: torch.Tensor, topology: Topology, placement_LE: torch.Tensor, min_tokens: int,
             prefilled: tuple[torch.Tensor, torch.Tensor] | None, keep_prefilled: int):
    """``(plan, copies)``: ``plan(caps, marginal=False, local=None) -> ([(slot_expert_MLGJ,
    slot_tokens_MLGJ) per cap], most copies one GPU fills)``, the step-long candidate of the
    module docstring, with what every cap shares computed once; after each cap's copies
    (``copies(cap, marginal)``, int64 ``[L * N, g, f]``, or ``local``: those of every cap,
    concatenated), the caps planned together, their layers stacked (rows do not interact:
    one pass of small ops for all, each cap's plan as alone)."""
    M, L, S, E = loads_MLSE.shape
    N, g, El, R = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    G, J, K = topology.num_gpus, topology.slots_per_gpu, topology.gpus_per_node * topology.experts_per_gpu
    r0 = 0 if prefilled is None else prefilled[0].shape[-1]
    free, P = R - r0, g * r0
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
    # Items that copies can share: the node's natives, and (two-hop) each traffic replica
    # slot that holds one expert all step; the other traffic slots' tokens stay where they are.
    pe_MLNP, pq_MLNP = pre_e.view(M, L, N, P), pre_q.view(M, L, N, P)
    steady_LNP = (pe_MLNP == pe_MLNP[:1]).all(0) & (pe_MLNP[0] >= 0) & (keep_prefilled > 0)
    item_e_LNI = torch.cat([native_LNK, torch.where(steady_LNP, pe_MLNP[0], -1)], -1)      # I = K + P
    item_MLNI = torch.cat([native_MLNK, pq_MLNP * steady_LNP], -1)
    fixed_LNg = (pq_MLNP * ~steady_LNP).sum(0).view(L, N, g, r0).sum(-1)
    home_I = torch.cat([torch.arange(K) // El, torch.arange(P) // r0])
    # GPUs holding an item's expert: its own, and any GPU with it in a traffic slot in some micro-batch
    seen_LNgP = pre_e.view(M, L, N, g, 1, r0) == item_e_LNI.view(1, L, N, 1, -1, 1)
    own_LNgI = (home_I == torch.arange(g).view(g, 1)).expand(L, N, g, K + P) | seen_LNgP.any(-1).any(0)
    own_LNgI &= (item_e_LNI >= 0).unsqueeze(2) | (torch.arange(K + P) < K)
    w_BI, own_BgI, fixed_Bg = item_MLNI.sum(0).view(L * N, -1), own_LNgI.view(L * N, g, -1), fixed_LNg.view(L * N, g)

    def copies(cap: int, marginal: bool) -> torch.Tensor:
        return _copies(w_BI, own_BgI, fixed_Bg, free, min_tokens, home_I, cap, marginal)

    def plan(caps: list[int], marginal: bool = False, local: torch.Tensor | None = None):
        C = len(caps)
        if local is None:
            local = torch.cat([copies(cap, marginal) for cap in caps])
        local_CLNgf = local.view(C * L, N, g, free)
        t = (lambda x, d: x) if C == 1 else (lambda x, d: torch.cat([x] * C, d))    # noqa: E731
        se, tok, most = _plan_cap(local_CLNgf, M, topology, keep_prefilled, r0, t(native_LNK, 0), t(item_MLNI, 1),
                                  home_I, t(item_e_LNI, 0), t(steady_LNP, 0), t(pe_MLNP, 1), t(pq_MLNP, 1))
        if C == 1:
            return [(se, tok)], most
        return [(se[:, i * L:(i + 1) * L].contiguous(), tok[:, i * L:(i + 1) * L].contiguous()) for i in range(C)], most
    return plan, copies


def _plan_cap(local_LNgf: torch.Tensor, M: int, topology: Topology, keep_prefilled: int, r0: int, native_LNK,
              item_MLNI, home_I, item_e_LNI, steady_LNP, pe_MLNP, pq_MLNP):
    """:func:`_planner`'s plans from their copies ``local_LNgf`` (:func:`_copies`, int64
    ``[L, N, g, free]``): the tokens of every instance per micro-batch. ``L``: the layers of
    every cap, stacked, with the other arguments stacked alike."""
    L = local_LNgf.shape[0]
    N, g, El, R = topology.num_nodes, topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    G, J, K = topology.num_gpus, topology.slots_per_gpu, g * El
    free, P = R - r0, g * r0
    copy_e_LNgf = torch.where(local_LNgf >= 0, item_e_LNI.gather(2, local_LNgf.clamp(min=0).view(L, N, -1))
                              .view(L, N, g, free), -1)
    # per micro-batch: each item's tokens split evenly over its instances (the first, the
    # native or the traffic replica, takes the rest), then rebalanced
    n_LNI = 1 + torch.zeros(L, N, K + P, dtype=torch.int64).scatter_add_(
        2, local_LNgf.clamp(min=0).view(L, N, -1), (local_LNgf >= 0).to(torch.int64).view(L, N, -1))
    share_MLNI = item_MLNI // n_LNI
    first_MLNI = item_MLNI - share_MLNI * (n_LNI - 1)
    pre_tok = torch.where(steady_LNP, first_MLNI[..., K:], pq_MLNP)
    copy_tok = torch.where(local_LNgf >= 0, share_MLNI.gather(3, local_LNgf.clamp(min=0).view(1, L, N, -1)
                                                               .expand(M, L, N, g * free)).view(M, L, N, g, free), 0)
    B = M * L * N
    se = torch.cat([native_LNK.view(1, L, N, g, El).expand(M, L, N, g, El), pe_MLNP.view(M, L, N, g, r0),
                    copy_e_LNgf.expand(M, L, N, g, free)], -1).reshape(B, g, J)
    tok = torch.cat([first_MLNI[..., :K].reshape(M, L, N, g, El), pre_tok.view(M, L, N, g, r0), copy_tok],
                    -1).reshape(B, g, J)
    # each slot's item: natives and steady traffic slots in order, copies by what they copy
    item_LNgJ = torch.cat([torch.arange(K).view(g, El).expand(L, N, g, El),
                           torch.where(steady_LNP, K + torch.arange(P), -1).view(L, N, g, r0), local_LNgf], -1)
    hub = torch.zeros(J, dtype=torch.bool)
    hub[El:El + r0] = True
    item = item_LNgJ.unsqueeze(0).expand(M, L, N, g, J).reshape(B, g, J)
    keep = (hub & (item >= 0) & (tok > 0)).to(torch.int64) * int(keep_prefilled)
    tok = _rebalance(item, tok, keep, K + P, 2 * g * J)
    copies_LNgf = local_LNgf >= 0
    sends_LNg = torch.zeros(L, N, g, dtype=torch.int64).scatter_add_(
        2, home_I[local_LNgf.clamp(min=0)].view(L, N, -1), copies_LNgf.to(torch.int64).view(L, N, -1))
    most = int(sends_LNg.max()) if sends_LNg.numel() else 0
    return se.view(M, L, G, J).contiguous(), tok.view(M, L, G, J).contiguous(), most
