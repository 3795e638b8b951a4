"""The greedy start of relibra's reordering (:func:`relibra_torch.planning.relibra.reorder`).

Legend: L layers, M micro-batches, N nodes, E experts; ``load_LME`` int64 step loads per
micro-batch, ``total_LE`` their step totals, ``src_node_LNE`` each expert's step tokens from
node ``n``'s sources, ``prev_node_LE`` each expert's node now.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["MOVE_SPREAD_NODES", "greedy_nodes", "move_price_s", "objective"]


#: Beyond this many nodes a move's price falls as ``1 / N`` (:func:`move_price_s`).
MOVE_SPREAD_NODES = 4


def move_price_s(cfg, g: int, N: int) -> float:
    """What one expert that changes node adds to the step's migration, as both reordering
    searches (and the fast path's proof that they keep the placement) price it:
    ``migration_s_per_expert / g * min(1, 4 / N)`` on ``N`` nodes of ``g`` GPUs.

    The cost model moves all layers at once and charges the busiest GPU's sent or received
    bytes (``sim.cost.CostModel.migration``): ``k`` swaps between two nodes cost
    ``ceil(k / g)`` transfers, and moves spread evenly over all ``N g`` GPUs ``k / (N g)``.
    Up to :data:`MOVE_SPREAD_NODES` nodes the price is a transfer per ``g`` moves: exact for a
    lone swap between 2-GPU nodes, twice the even spread on 2 nodes. Beyond, moves between
    different node pairs run side by side and the price falls as ``4 / N``. This is a weight
    measured on the simulator, not the cost model's charge: moves pile up on the nodes that
    shed hot experts, so it charged 0.07-0.5 of a transfer per ``g`` moved experts on 4-48
    nodes, more than this price on 16-48 nodes. What the lower price buys there is the first
    step's moves out of static placement, whose saving comes back every step the placement
    holds: on DeepSeek-V3 (32 x 8) over four steps, the first one counted, the step fell from
    6.00 to 4.45 s. At ``2 / N`` the 4-node runs lost 0.1-0.4% (docs/results.md, "Moves priced
    over the node pairs that run them")."""
    return cfg.migration_s_per_expert / g * min(1.0, MOVE_SPREAD_NODES / N)


def objective(max_sum, cross, moved, cfg, g: int, N: int):
    """Reordering's objective (``relibra`` module docstring) from float64 parts of any
    matching shape, torch tensors or numpy arrays alike: the summed per-micro-batch
    busiest-node load, cross-node tokens, experts moved (the same products in the same
    order for both, so the greedy start and the searches rank alike)."""
    node_w = (cfg.compute_s_per_token + cfg.cross_node_s_per_token) / g
    return max_sum * node_w + cross * cfg.cross_node_s_per_token / g + moved * move_price_s(cfg, g, N)


def greedy_nodes(load_LME: torch.Tensor, total_LE: torch.Tensor, src_node_LNE: torch.Tensor,
                 prev_node_LE: torch.Tensor, cfg, N: int, g: int) -> torch.Tensor:
    """int64 ``[L, E]``: the greedy start of reordering: experts in decreasing step load
    (stable), each to the node with room (``E / N`` experts) whose objective grows least
    (:func:`objective`; ties to the lowest node), all layers at once.

    In numpy: one round per expert of a few ops on ``[L, M, N]`` arrays, where torch's
    per-call cost made the loop most of ``reorder``'s time (256 experts: ~40 ms of one
    thread). The same integers and the same float64 objective as the torch loop it
    replaced, so the same nodes."""
    L, M, E = load_LME.shape
    per_node = E // N
    order_LE = total_LE.sort(dim=1, descending=True, stable=True).indices.numpy()
    load, total, src, prev = (t.numpy() for t in (load_LME, total_LE, src_node_LNE, prev_node_LE))
    rows, nodes = np.arange(L), np.arange(N)
    greedy_LE = np.empty((L, E), dtype=np.int64)
    nl_LMN = np.zeros((L, M, N), dtype=np.int64)
    count_LN = np.zeros((L, N), dtype=np.int64)
    for i in range(E):
        e_L = order_LE[:, i]
        add_LM = load[rows, :, e_L]                                             # [L, M]
        new_max_LN = np.maximum(nl_LMN.max(-1, keepdims=True), nl_LMN + add_LM[..., None]).sum(1)   # [L, N]
        cross_LN = total[rows, e_L][:, None] - src[rows, :, e_L]
        moved_LN = (nodes != prev[rows, e_L][:, None]).astype(np.int64)
        cost_LN = objective(*(x.astype(np.float64) for x in (new_max_LN, cross_LN, moved_LN)), cfg, g, N)
        cost_LN[count_LN >= per_node] = np.inf
        n_L = cost_LN.argmin(1)
        greedy_LE[rows, e_L] = n_L
        nl_LMN[rows, :, n_L] += add_LM
        count_LN[rows, n_L] += 1
    return torch.from_numpy(greedy_LE)
