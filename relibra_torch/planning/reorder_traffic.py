"""Traffic-aware reordering: each node's cross-node send and receive after its traffic replicas.

The all-to-all is most of an MoE layer's time, and the cost model charges it per micro-batch
at the busiest GPU. After the load-first swap search of :func:`relibra_torch.planning.relibra.reorder`,
this second search moves experts between nodes to lower, summed over the step's
micro-batches,

    t_compute / g * max_n node_load[m, n]  +  t_cross / g * max_n max(send[m, n], recv[m, n])

plus ``move_price_s`` per expert that changes node (``reorder_greedy``), where ``send`` and ``recv`` are
each node's cross-node tokens *left after its traffic replicas*: the planner copies each
node's most-requested remote experts onto it (:mod:`relibra_torch.planning.traffic`), so
those tokens never cross and an objective that counted them would push experts toward
senders that keep their tokens home anyway. The replicas are modelled as EPLB-like step
sets: per (layer, node) the ``B = g * r`` remote experts with the most step demand whose
saving beats one inter-node fill (what the step-long option of the traffic planner picks).
With hierarchical dispatch the co-activated pairs placed together are subtracted as in the
first search.

Search: steepest descent over node swaps, all layers at once, on the same candidate set as
the first search (each node's heaviest and lightest experts). A swap changes only its two
nodes' terms, and every term is a sum of a part of expert ``a`` and a part of ``b``, so all
``W`` candidate swaps are scored by broadcasting ``[.., P, C, 1]`` against ``[.., P, 1, C]``
(P node pairs, C candidates per node): no per-swap gathers over micro-batches (only the
``[L, W]`` migration and co-activation terms gather per swap). The scoring freezes the
replica sets of the round (an expert entering a node's remote set joins its replicas when
its demand beats the set's smallest); each round's chosen swap is then re-scored exactly,
with fresh replica sets, and kept only if the exact objective falls, so the search is a
descent on the exact objective and stops. Integer arithmetic up to one float64 combination
per candidate: identical plans on every rank.

Legend: M micro-batches, L layers, E experts, N nodes, g GPUs per node, r traffic replica
slots per GPU, B = g * r, C candidates per node, P = N (N - 1) / 2 node pairs,
W = P * C * C candidate swaps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reorder_greedy import move_price_s

__all__ = ["SwapPairs", "swap_pairs", "swap_candidates", "max_without_pair", "coactivation_gain",
           "colocated_pairs", "replica_min_tokens", "swap_node_terms", "traffic_objective", "traffic_swap_search"]


@dataclass(frozen=True)
class SwapPairs:
    """Index structure of the candidate swaps (constant for given ``N`` and ``C``).

    Attributes:
        ni_P, nj_P: the two nodes of every node pair ``i < j``.
        pos_a_W, pos_b_W: each swap's two candidates, as positions in ``[N * C]``.
        na_W, nb_W: their nodes; ``W`` is ordered pair-major, so ``[.., W]`` views as
            ``[.., P, C, C]`` (``a``'s candidate index, then ``b``'s).
        others_NNN: ``others[i, j, n]`` is true when ``n`` is neither ``i`` nor ``j``.
        slot_node_X: the node of every candidate position ``X = N * C`` (node-major).
    """

    ni_P: torch.Tensor
    nj_P: torch.Tensor
    pos_a_W: torch.Tensor
    pos_b_W: torch.Tensor
    na_W: torch.Tensor
    nb_W: torch.Tensor
    others_NNN: torch.Tensor
    slot_node_X: torch.Tensor

    def a_side(self, x_X: torch.Tensor) -> torch.Tensor:
        """``[.., N * C]`` per candidate -> ``[.., P, C, 1]``: the value of each swap's ``a``
        (a candidate of the pair's first node), to broadcast against :meth:`b_side`."""
        N = self.others_NNN.shape[0]
        return x_X.reshape(*x_X.shape[:-1], N, -1)[..., self.ni_P, :].unsqueeze(-1)

    def b_side(self, x_X: torch.Tensor) -> torch.Tensor:
        """``[.., N * C]`` -> ``[.., P, 1, C]``: the value of each swap's ``b`` (second node)."""
        N = self.others_NNN.shape[0]
        return x_X.reshape(*x_X.shape[:-1], N, -1)[..., self.nj_P, :].unsqueeze(-2)


def swap_pairs(N: int, C: int) -> SwapPairs:
    """The candidate swaps between ``N`` nodes with ``C`` candidates each."""
    ni, nj = torch.triu_indices(N, N, offset=1)
    ci, cj = torch.meshgrid(torch.arange(C), torch.arange(C), indexing="ij")
    pos_a = (ni.view(-1, 1) * C + ci.reshape(1, -1)).reshape(-1)
    pos_b = (nj.view(-1, 1) * C + cj.reshape(1, -1)).reshape(-1)
    others = torch.ones(N, N, N, dtype=torch.bool)
    idx = torch.arange(N)
    others[idx, :, idx] = False
    others[:, idx, idx] = False
    return SwapPairs(ni, nj, pos_a, pos_b, ni.repeat_interleave(C * C), nj.repeat_interleave(C * C), others,
                     torch.arange(N * C) // C)


def swap_candidates(node_LE: torch.Tensor, total_LE: torch.Tensor, N: int, per_side: int) -> torch.Tensor:
    """int64 ``[L, N * C]``: on every node its ``per_side`` lightest and as many heaviest
    experts by step load (``C = 2 * per_side``), node-major."""
    L, E = node_LE.shape
    key_LE = total_LE + node_LE * (total_LE.max() + 1)   # group by node, then load
    order_LNE = key_LE.sort(dim=1, stable=True).indices.view(L, N, E // N)
    return torch.cat([order_LNE[:, :, :per_side], order_LNE[:, :, -per_side:]], 2).reshape(L, -1)


def max_without_pair(x_LMN: torch.Tensor, pairs: SwapPairs) -> torch.Tensor:
    """``[L, M, P]``: max over the nodes outside each node pair (-1 when there are none)."""
    L, M, N = x_LMN.shape
    masked = x_LMN.view(L, M, 1, 1, N).expand(L, M, N, N, N).masked_fill(~pairs.others_NNN, -1)
    return masked.max(-1).values[:, :, pairs.ni_P, pairs.nj_P]


def swap_node_terms(nl_LMN: torch.Tensor, load_LME: torch.Tensor, cand_LX: torch.Tensor, pairs: "SwapPairs",
                    dtype=torch.int64) -> torch.Tensor:
    """``[L, M, P, C, C]``: the larger load of a swap's two nodes after it (node loads ``nl_LMN``)."""
    L, M, N = nl_LMN.shape
    X = cand_LX.shape[1]
    slot = pairs.slot_node_X.view(1, 1, X).expand(L, M, X)
    load_X = load_LME.gather(2, cand_LX.unsqueeze(1).expand(L, M, X))
    out_X = (nl_LMN.gather(2, slot) - load_X).to(dtype)                      # the slot's node without it
    lx = load_X.to(dtype)
    a_side, b_side = pairs.a_side, pairs.b_side
    return torch.maximum(a_side(out_X) + b_side(lx), b_side(out_X) + a_side(lx))


def colocated_pairs(pairs_LEE: torch.Tensor, node_LE: torch.Tensor, N: int) -> torch.Tensor:
    """int64 ``[L]``: co-activated token pairs whose two experts share a node."""
    onehot_LEN = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
    partners_LEN = torch.bmm(pairs_LEE, onehot_LEN)                      # pairs of e on node n
    return partners_LEN.gather(2, node_LE.unsqueeze(-1)).squeeze(-1).sum(1) // 2


def coactivation_gain(pairs_LEE: torch.Tensor, node_LE: torch.Tensor, a_LW: torch.Tensor, b_LW: torch.Tensor,
                      pairs: SwapPairs, N: int) -> torch.Tensor:
    """int64 ``[L, W]``: co-located pairs gained by swapping ``a`` (node ``na``) with ``b``
    (node ``nb``): a's partners on nb (less b) and b's on na (less a), minus what they leave."""
    L, E, _ = pairs_LEE.shape
    onehot_LEN = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
    part_LX = torch.bmm(pairs_LEE, onehot_LEN).reshape(L, E * N)
    c_ab = pairs_LEE.reshape(L, E * E).gather(1, a_LW * E + b_LW)
    na, nb = pairs.na_W, pairs.nb_W
    return (part_LX.gather(1, a_LW * N + nb) - part_LX.gather(1, a_LW * N + na)
            + part_LX.gather(1, b_LW * N + na) - part_LX.gather(1, b_LW * N + nb) - 2 * c_ab)


def _replica_sets(node_LE: torch.Tensor, own_step_LNE: torch.Tensor, B: int,
                  min_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``n``'s modelled traffic replicas, bool ``[L, N, E]`` (its ``B`` remote experts with
    the most step demand, at least ``min_tokens``), and int64 ``[L, N]`` the demand an expert
    entering ``n``'s remote set must reach to join them."""
    L, N, E = own_step_LNE.shape
    floor = max(min_tokens, 1)
    if B == 0:
        return torch.zeros(L, N, E, dtype=torch.bool), torch.full((L, N), torch.iinfo(torch.int64).max)
    remote_LNE = own_step_LNE.masked_fill(node_LE.unsqueeze(1) == torch.arange(N).view(1, N, 1), -1)
    # stable sort: among equal demands the lower ids, as the traffic planner picks them
    top_LNB = (-remote_LNE).argsort(dim=2, stable=True)[..., :min(B, E)]
    top_values = remote_LNE.gather(2, top_LNB)
    in_LNE = torch.zeros(L, N, E, dtype=torch.bool).scatter_(2, top_LNB, top_values >= floor)
    return in_LNE, top_values[..., -1].clamp(min=floor)


def _residual(node_LE: torch.Tensor, load_LME: torch.Tensor, own_LMNE: torch.Tensor,
              replicated_LNE: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Node loads, each node's residual cross-node send and receive ``[L, M, N]``, and each
    expert's residual inflow at its owner ``[L, M, E]`` (tokens no traffic replica keeps home)."""
    N = own_LMNE.shape[2]
    onehot_LEN = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
    crosses_LNE = (node_LE.unsqueeze(1) != torch.arange(N).view(1, N, 1)) & ~replicated_LNE
    resid_LMNE = own_LMNE * crosses_LNE.unsqueeze(1)
    inflow_LME = resid_LMNE.sum(2)
    return torch.bmm(load_LME, onehot_LEN), resid_LMNE.sum(-1), torch.bmm(inflow_LME, onehot_LEN), inflow_LME


def traffic_objective(node_LE: torch.Tensor, load_LME: torch.Tensor, own_LMNE: torch.Tensor,
                      prev_node_LE: torch.Tensor, config, g: int, traffic_slots: int,
                      pairs_LEE: torch.Tensor | None = None, coloc_w: float = 0.0) -> torch.Tensor:
    """float64 ``[L]``: the objective of the module docstring for the node assignment
    ``node_LE`` (arguments as in :func:`traffic_swap_search`)."""
    N = own_LMNE.shape[2]
    replicated, _ = _replica_sets(node_LE, own_LMNE.sum(1), g * traffic_slots, replica_min_tokens(config, g))
    nl, send, recv, _ = _residual(node_LE, load_LME, own_LMNE, replicated)
    obj = (config.compute_s_per_token / g * nl.max(-1).values.sum(1).to(torch.float64)
           + config.cross_node_s_per_token / g * torch.maximum(send, recv).max(-1).values.sum(1).to(torch.float64)
           + move_price_s(config, g, N) * (node_LE != prev_node_LE).sum(1).to(torch.float64))
    if coloc_w:
        obj = obj - coloc_w * colocated_pairs(pairs_LEE, node_LE, N).to(torch.float64)
    return obj


def _below(x: torch.Tensor) -> torch.Tensor:
    """What an objective must beat to count as a strict improvement on ``x`` (a relative
    margin against float noise; the objective can be negative with co-activation)."""
    return x - 1e-12 * x.abs()


def replica_min_tokens(config, g: int) -> int:
    """Fewest step tokens a node's traffic replica must keep home to pay for its inter-node fill."""
    token_s = config.cross_node_s_per_token / g
    if token_s <= 0:
        return torch.iinfo(torch.int64).max
    fill_s = config.cross_replica_fill_s_per_expert
    return math.ceil(fill_s / token_s) if fill_s > 0 else 0


def traffic_swap_search(node_LE: torch.Tensor, load_LME: torch.Tensor, own_LMNE: torch.Tensor,
                        prev_node_LE: torch.Tensor, config, g: int, traffic_slots: int,
                        pairs_LEE: torch.Tensor | None = None, coloc_w: float = 0.0) -> torch.Tensor:
    """Refine a node assignment on the traffic objective of the module docstring.

    Args:
        node_LE: int64 ``[L, E]`` start (the load-first search's result).
        load_LME: int64 ``[L, M, E]`` the expert loads its load term weighs (``relibra.reorder``:
            zeros where that term is a constant, ``R = 0`` with one expert per GPU).
        own_LMNE: int64 ``[L, M, N, E]`` tokens for each expert from each node's sources.
        prev_node_LE: int64 ``[L, E]`` nodes before the step (migration).
        config: the :class:`~relibra_torch.planning.relibra.ReLibraConfig` (weights, search limits).
        traffic_slots: ``r``, traffic replica slots per GPU (0: no replicas modelled).
        pairs_LEE, coloc_w: co-activation counts and the seconds one co-located pair saves.

    Returns:
        int64 ``[L, E]``: the refined node of every expert.
    """
    L, M, N, E = own_LMNE.shape
    if N < 2 or L == 0:
        return node_LE
    B = g * traffic_slots
    min_tokens = replica_min_tokens(config, g)
    tc, tx = config.compute_s_per_token / g, config.cross_node_s_per_token / g
    own_step_LNE = own_LMNE.sum(1)
    total_LE = own_LMNE.sum(2).sum(1)                                    # step load per expert (candidates)
    per_side = min(config.swap_candidates, E // N // 2) or 1
    C = 2 * per_side
    pairs = swap_pairs(N, C)
    P = pairs.ni_P.numel()
    rows = torch.arange(L)

    def objective(n_LE: torch.Tensor) -> torch.Tensor:
        return traffic_objective(n_LE, load_LME, own_LMNE, prev_node_LE, config, g, traffic_slots, pairs_LEE, coloc_w)

    a_side, b_side, slot_node = pairs.a_side, pairs.b_side, pairs.slot_node_X

    current_L = objective(node_LE)
    active_L = torch.ones(L, dtype=torch.bool)
    for _ in range(config.max_swap_rounds):
        replicated_LNE, join_LN = _replica_sets(node_LE, own_step_LNE, B, min_tokens)
        nl, send, recv, inflow_LME = _residual(node_LE, load_LME, own_LMNE, replicated_LNE)
        cand_LX = swap_candidates(node_LE, total_LE, N, per_side)            # X = N * C slots
        cand_LMX = cand_LX.unsqueeze(1).expand(L, M, N * C)
        own_LMNX = own_LMNE.gather(3, cand_LX.view(L, 1, 1, N * C).expand(L, M, N, N * C))
        home_X = own_LMNX.gather(2, slot_node.view(1, 1, 1, -1).expand(L, M, 1, N * C)).squeeze(2)
        # U: the candidate's home tokens that cross once it leaves (unless it joins the
        # replicas of its old node); V[n]: node n's residual tokens for the candidate.
        joins_LX = (own_step_LNE.reshape(L, N * E).gather(1, slot_node * E + cand_LX)
                    >= join_LN[:, slot_node])                                # at its own node
        U_LMX = home_X * (~joins_LX).unsqueeze(1)
        res_LNX = ~replicated_LNE.gather(2, cand_LX.unsqueeze(1).expand(L, N, N * C))
        V_LMNX = own_LMNX * res_LNX.unsqueeze(1)
        node_of = lambda x_LMN: x_LMN.gather(2, slot_node.view(1, 1, -1).expand(L, M, N * C))  # noqa: E731
        inflow_X = inflow_LME.gather(2, cand_LMX)
        # The [L, M, P, C, C] scores are the bulk of the work: int32 (a node's tokens in one
        # micro-batch are far below 2^31), in place, summed over M in int64.
        i32 = torch.int32
        send_out = (node_of(send) + U_LMX).to(i32)     # send of the slot's node once it leaves
        recv_out = (node_of(recv) - inflow_X).to(i32)  # recv of the slot's node without it
        brings = (inflow_X + U_LMX).to(i32)            # what the slot adds to the node it joins
        V_view = V_LMNX.to(i32).view(L, M, N, N, C)
        t_a = a_side(recv_out) + b_side(brings)
        torch.maximum(t_a, a_side(send_out), out=t_a)
        t_a.sub_(V_view[:, :, pairs.ni_P, pairs.nj_P].unsqueeze(-2))        # na's residual for b
        t_b = b_side(recv_out) + a_side(brings)
        torch.maximum(t_b, b_side(send_out), out=t_b)
        t_b.sub_(V_view[:, :, pairs.nj_P, pairs.ni_P].unsqueeze(-1))        # nb's residual for a
        torch.maximum(t_a, t_b, out=t_a)
        torch.maximum(t_a, max_without_pair(torch.maximum(send, recv), pairs).to(i32).view(L, M, P, 1, 1), out=t_a)
        tr_max = t_a.sum(1, dtype=torch.int64)                                   # [L, P, C, C]
        u = swap_node_terms(nl, load_LME, cand_LX, pairs, i32)
        torch.maximum(u, max_without_pair(nl, pairs).to(i32).view(L, M, P, 1, 1), out=u)
        nl_max = u.sum(1, dtype=torch.int64)
        a_LW, b_LW = cand_LX[:, pairs.pos_a_W], cand_LX[:, pairs.pos_b_W]
        pa, pb = prev_node_LE.gather(1, a_LW), prev_node_LE.gather(1, b_LW)
        na, nb = pairs.na_W, pairs.nb_W
        moved_LW = ((node_LE != prev_node_LE).sum(1, keepdim=True)
                    + (nb != pa).to(torch.int64) - (na != pa).to(torch.int64)
                    + (na != pb).to(torch.int64) - (nb != pb).to(torch.int64))
        obj_LW = (tc * nl_max.reshape(L, -1).to(torch.float64) + tx * tr_max.reshape(L, -1).to(torch.float64)
                  + move_price_s(config, g, N) * moved_LW.to(torch.float64))
        if coloc_w:
            gain_LW = colocated_pairs(pairs_LEE, node_LE, N).unsqueeze(1) + coactivation_gain(
                pairs_LEE, node_LE, a_LW, b_LW, pairs, N)
            obj_LW = obj_LW - coloc_w * gain_LW.to(torch.float64)
        best_W = obj_LW.argmin(1)
        improve_L = active_L & (obj_LW[rows, best_W] < _below(current_L))
        if not improve_L.any():
            break
        a_L, b_L = a_LW[rows, best_W], b_LW[rows, best_W]
        trial_LE = node_LE.clone()
        trial_LE[rows, a_L] = torch.where(improve_L, node_LE[rows, b_L], node_LE[rows, a_L])
        trial_LE[rows, b_L] = torch.where(improve_L, node_LE[rows, a_L], node_LE[rows, b_L])
        exact_L = objective(trial_LE)
        keep_L = improve_L & (exact_L < _below(current_L))
        active_L = active_L & (keep_L | ~improve_L)     # a layer whose estimate misled it stops
        node_LE = torch.where(keep_L.unsqueeze(1), trial_LE, node_LE)
        current_L = torch.where(keep_L, exact_L, current_L)
    return node_LE
