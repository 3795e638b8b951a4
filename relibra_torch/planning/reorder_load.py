"""relibra's load-first reordering search (:func:`relibra_torch.planning.relibra.reorder`):
steepest-descent swaps of experts between nodes on the objective of the ``relibra`` module
docstring (``reorder_greedy.objective``), all layers at once.

Legend: L layers, M micro-batches, E experts, N nodes, g GPUs per node, C swap candidates
per node, X = N * C candidate positions, P node pairs, W candidate swaps.
"""

from __future__ import annotations

import torch

from .reorder_greedy import objective
from .reorder_traffic import coactivation_gain, max_without_pair, swap_candidates, swap_node_terms, swap_pairs

__all__ = ["load_first_objective", "load_term", "swap_search"]


def load_term(load_xE: torch.Tensor, replica_slots: int, experts_per_gpu: int) -> torch.Tensor:
    """The loads ``[..., E]`` the node searches' load term weighs: ``load_xE`` itself, or zeros
    with no replica slot and one expert per GPU, where the busiest GPU is the largest expert
    whatever the placement (a constant), so only the all-to-all and the moves steer placement.
    :func:`relibra_torch.planning.relibra.reorder` and the fast path's proof share it."""
    return torch.zeros_like(load_xE) if replica_slots == 0 and experts_per_gpu == 1 else load_xE


def load_first_objective(max_sum, cross, moved, cfg, g: int, N: int) -> torch.Tensor:
    """float64 objective of integer parts: summed busiest-node load term, cross-node tokens, moves."""
    return objective(*(x.to(torch.float64) for x in (max_sum, cross, moved)), cfg, g, N)


def swap_search(node_LE: torch.Tensor, load_LME: torch.Tensor, src_node_LNE: torch.Tensor, total_LE: torch.Tensor,
                prev_node_LE: torch.Tensor, cfg, N: int, g: int, full_objective, pairs_LEE: torch.Tensor | None = None,
                coloc_w: float = 0.0) -> torch.Tensor:
    """Steepest-descent node swaps, all layers at once, until no layer improves. Candidates per
    round: each node's ``swap_candidates`` heaviest and as many lightest experts (step load); every
    pair on two nodes is scored exactly (only its two nodes change: the new per-micro-batch maximum
    is ``max(max over the other nodes, new load of node a, new load of node b)``)."""
    L, M, E = load_LME.shape
    per_side = min(cfg.swap_candidates, E // N // 2) or 1
    C = 2 * per_side
    current_L = full_objective(node_LE)
    rows = torch.arange(L)
    pairs = swap_pairs(N, C)
    ni, nj = pairs.ni_P, pairs.nj_P
    P = ni.numel()
    a_side, b_side, slot_node = pairs.a_side, pairs.b_side, pairs.slot_node_X

    for _ in range(cfg.max_swap_rounds):
        onehot = torch.nn.functional.one_hot(node_LE, N).to(torch.int64)
        nl_LMN = torch.bmm(load_LME, onehot)
        cand_LX = swap_candidates(node_LE, total_LE, N, per_side)
        # Only the swap's two nodes change: new max = max(the other nodes, node a, node b).
        new_max = swap_node_terms(nl_LMN, load_LME, cand_LX, pairs)
        torch.maximum(new_max, max_without_pair(nl_LMN, pairs).view(L, M, P, 1, 1), out=new_max)
        max_sum_LW = new_max.sum(1).reshape(L, -1)
        # tokens kept inside their node: a leaves na for nb, b leaves nb for na
        src_LNX = src_node_LNE.gather(2, cand_LX.unsqueeze(1).expand(L, N, N * C))
        home_LX = src_LNX.gather(1, slot_node.expand(L, 1, N * C)).squeeze(1)
        src_view = src_LNX.view(L, N, N, C)                                  # [L, node, slot node, C]
        gain_a = src_view[:, nj, ni].unsqueeze(-1) - a_side(home_LX)          # a's tokens from nb
        gain_b = src_view[:, ni, nj].unsqueeze(-2) - b_side(home_LX)          # b's tokens from na
        local_delta_LW = (gain_a + gain_b).reshape(L, -1)
        cross_now_L = (total_LE - src_node_LNE.gather(1, node_LE.unsqueeze(1)).squeeze(1)).sum(1)
        prev_X = prev_node_LE.gather(1, cand_LX)
        moved_a = (nj.view(1, P, 1) != prev_X.view(L, N, C)[:, ni]).to(torch.int64) \
            - (ni.view(1, P, 1) != prev_X.view(L, N, C)[:, ni]).to(torch.int64)
        moved_b = (ni.view(1, P, 1) != prev_X.view(L, N, C)[:, nj]).to(torch.int64) \
            - (nj.view(1, P, 1) != prev_X.view(L, N, C)[:, nj]).to(torch.int64)
        moved_delta_LW = (moved_a.unsqueeze(-1) + moved_b.unsqueeze(-2)).reshape(L, -1)
        moved_now_L = (node_LE != prev_node_LE).sum(1)
        obj_LW = load_first_objective(max_sum_LW, cross_now_L.unsqueeze(1) - local_delta_LW,
                                      moved_now_L.unsqueeze(1) + moved_delta_LW, cfg, g, N)
        a_LW, b_LW = cand_LX[:, pairs.pos_a_W], cand_LX[:, pairs.pos_b_W]
        if coloc_w:  # co-located pairs gained by the swap
            obj_LW = obj_LW - coloc_w * coactivation_gain(pairs_LEE, node_LE, a_LW, b_LW, pairs, N).to(torch.float64)
        best_W = obj_LW.argmin(1)
        best_obj_L = obj_LW[rows, best_W]
        improve_L = best_obj_L < current_L - 1e-12 * current_L.abs()
        if not improve_L.any():
            break
        a_L, b_L = a_LW[rows, best_W], b_LW[rows, best_W]
        na_L, nb_L = node_LE[rows, a_L], node_LE[rows, b_L]
        node_LE = node_LE.clone()
        node_LE[rows, a_L] = torch.where(improve_L, nb_L, na_L)
        node_LE[rows, b_L] = torch.where(improve_L, na_L, nb_L)
        current_L = torch.where(improve_L, best_obj_L, current_L)
    return node_LE
