"""Step-long traffic replicas whose fills do not pile up on one owner's link.

Measured on the default trace under hierarchical dispatch (docs/results.md, "Where the
EP 32 step goes"): relibra's step-long traffic set is filled in the forward of the first
micro-batch and returns its fp32 gradients in the backward of the last, all at once, and
the cost model charges each at the busiest link. The receivers are spread (one traffic
slot per GPU), but a hot expert is copied to every other node and its owner sends every
copy: the busiest owner sent about 5 of a layer's copies, so the fills and returns cost
about 5 fill times per layer where one GPU's slot alone would take one.

Here the step-long set may be capped at ``c`` copies per owner GPU (each node still takes
its remote experts with the most step demand, skipping those whose owner already sends
``c``), and per layer the planner keeps, of the uncapped choice (relibra's existing per
(layer, node) choice of a per-micro-batch or step-long set) and the capped sets, the one
with the lowest price:

* the all-to-all's inter-node part at the busiest GPU, ``max(send, landing receive)`` in
  ``(token, remote node)`` rows, by the simulator's own count estimate
  (:func:`~relibra_torch.planning.hier_estimate.approx_need_pieces`, the rule ``sim.dispatch``
  charges count-only loads with), times ``cross_node_s_per_token``;
* expert compute at the busiest node's pairs over ``g`` (balancing spreads a node over its
  GPUs), times ``compute_s_per_token``;
* the fills: per micro-batch, the most residencies any GPU starts receiving or sending
  (the owner), times one inter-node fill and return.

So the choice is never priced above the uncapped set on that price. It applies under
hierarchical dispatch only (``ReLibraConfig.spread_fills``); the estimate uses per-source
counts only (no co-activation), as the simulator does for count-level loads.

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, g GPUs per node,
G GPUs, r traffic slots per GPU, B = g * r.
"""

from __future__ import annotations

from typing import Callable

import torch

from .hier_estimate import approx_need_pieces
from .residency import residency_masks

__all__ = ["LINK_BLOCK_ELEMENTS", "capped_step_set", "fill_link_seconds", "link_seconds", "spread_args", "spread_step_fills"]


def spread_args(config) -> tuple[int, float, float] | None:
    """``traffic_replicas``' ``spread`` argument for a ``ReLibraConfig``: ``(top_k,
    cross-node seconds per row at the busiest GPU, compute seconds per pair)`` with
    ``spread_fills`` under hierarchical dispatch and a known ``top_k``, else None."""
    if config.spread_fills and config.dispatch == "hierarchical" and config.top_k > 0:
        return config.top_k, config.cross_node_s_per_token, config.compute_s_per_token
    return None


#: Elements of one ``[X, S, E]`` float64 block :func:`link_seconds` prices at once (32 MB):
#: micro-batches go in chunks below it, so a 32-micro-batch step at EP 256 stays in memory.
LINK_BLOCK_ELEMENTS = 1 << 22


def link_seconds(loads_MLSE: torch.Tensor, owner_gpu_LE: torch.Tensor, expert_MLGr: torch.Tensor, g: int,
                 top_k: int, row_s: float, pair_s: float) -> torch.Tensor:
    """float64 ``[L]``: the inter-node all-to-all at the busiest GPU plus expert compute at
    the busiest node, summed over the micro-batches (module docstring), with the traffic
    slots ``expert_MLGr`` (``-1``: empty) taking their node's tokens for their expert.
    Micro-batches are priced in chunks (:data:`LINK_BLOCK_ELEMENTS`) and summed in order, so
    the figure is the one a micro-batch at a time gives, about 3x sooner at 64 GPUs."""
    M, L, S, E = loads_MLSE.shape
    chunk = max(1, LINK_BLOCK_ELEMENTS // max(L * S * E, 1))
    link_ML = torch.cat([_link_rows(loads_MLSE[m:m + chunk], owner_gpu_LE, expert_MLGr[m:m + chunk], g, top_k, row_s,
                                    pair_s) for m in range(0, M, chunk)]) if M else torch.zeros(0, L, dtype=torch.float64)
    out = torch.zeros(L, dtype=torch.float64)
    for m in range(M):      # in micro-batch order, as the figure has always been summed
        out += link_ML[m]
    return out


def _link_rows(loads_MLSE: torch.Tensor, owner_gpu_LE: torch.Tensor, expert_MLGr: torch.Tensor, g: int, top_k: int,
               row_s: float, pair_s: float) -> torch.Tensor:
    """float64 ``[M, L]``: :func:`link_seconds`' figure of each micro-batch and layer, every
    row ``X = M L`` at once (each with its micro-batch's tokens: every op is elementwise or
    reduces within a row)."""
    M, L, S, E = loads_MLSE.shape
    G, X = S, M * L
    N = G // g
    node_S = torch.arange(S) // g
    owner_node_LE = owner_gpu_LE // g
    local_LNE = torch.nn.functional.one_hot(owner_node_LE, N).permute(0, 2, 1).bool()
    e = expert_MLGr.reshape(M, L, N, -1)
    held_MLNE = torch.zeros(M, L, N, E, dtype=torch.int64).scatter_add_(3, e.clamp(min=0), (e >= 0).to(torch.int64))
    local_MLNE = local_LNE.unsqueeze(0) | (held_MLNE > 0)      # (a scatter of booleans would let -1's 0 win)
    local_MLSE = local_MLNE[:, :, node_S, :]
    piece_XSE = torch.where(local_MLSE, node_S.view(1, 1, S, 1), owner_node_LE.view(1, L, 1, E)).reshape(X, S, E)
    loads_XSE = loads_MLSE.to(torch.int64).reshape(X, S, E)
    tokens_MS = loads_MLSE[:, 0].to(torch.int64).sum(-1) // top_k                  # each micro-batch's first layer
    tokens_XS = tokens_MS.unsqueeze(1).expand(M, L, S).reshape(X, S)
    need = approx_need_pieces(loads_XSE, piece_XSE.contiguous(), N, tokens_XS, top_k)      # [X, S, N]
    need = need.masked_fill(torch.nn.functional.one_hot(node_S, N).bool().unsqueeze(0), 0.0)
    send = need.sum(-1)
    recv = need.view(X, N, g, N).sum(1).permute(0, 2, 1).reshape(X, G)             # lands on (o, i)
    node_load = torch.zeros(X, N, dtype=torch.float64).scatter_add_(
        1, piece_XSE.reshape(X, -1), loads_XSE.reshape(X, -1).to(torch.float64))     # [X, N]
    return (row_s * torch.maximum(send, recv).max(-1).values + pair_s * node_load.max(-1).values / g).view(M, L)


def fill_link_seconds(expert_MLGr: torch.Tensor, quota_MLGr: torch.Tensor, owner_gpu_LE: torch.Tensor,
                      fill_s: float) -> torch.Tensor:
    """float64 ``[L]``: per micro-batch, the most residencies (``planning.residency``) any GPU
    starts receiving or, as the owner, sending, times ``fill_s`` (weights in, gradients
    back), summed over the micro-batches."""
    M, L, G, r = expert_MLGr.shape
    start = residency_masks(expert_MLGr, expert_MLGr >= 0, quota_MLGr)[0]              # [M, L, G, r]
    recv = start.sum(-1)
    owner = owner_gpu_LE.gather(1, expert_MLGr.clamp(min=0).permute(1, 0, 2, 3).reshape(L, -1))
    send = torch.zeros(L, M, G, dtype=torch.int64)
    owner_LMX = owner.view(L, M, G * r)
    send.scatter_add_(2, owner_LMX, start.permute(1, 0, 2, 3).reshape(L, M, G * r).to(torch.int64))
    busiest = torch.maximum(recv.permute(1, 0, 2), send).max(-1).values                # [L, M]
    return busiest.sum(-1).to(torch.float64) * fill_s


def capped_step_set(step_LNE: torch.Tensor, owner_gpu_LE: torch.Tensor, B: int, cap: int, token_s: float,
                    fill_s: float) -> torch.Tensor:
    """int64 ``[L, N, B]``: each node's step-long traffic replicas (``-1``: none): over all
    nodes of a layer, the (node, remote expert) candidates in decreasing step demand (ties:
    lower node, then expert), each taken while its node has a free slot and its owner GPU
    sends fewer than ``cap`` copies, if its demand times ``token_s`` beats ``fill_s`` (the
    step-long rule of :func:`~relibra_torch.planning.traffic.step_replicas`)."""
    L, N, E = step_LNE.shape
    value_LX = (step_LNE.to(torch.float64) * token_s - fill_s).reshape(L, N * E)
    order_LX = (-value_LX).argsort(dim=1, stable=True)
    values, orders, owners = value_LX.tolist(), order_LX.tolist(), owner_gpu_LE.tolist()
    out = [[[-1] * B for _ in range(N)] for _ in range(L)]
    for l in range(L):
        used, sends = [0] * N, {}
        for x in orders[l]:
            if values[l][x] <= 0:
                break
            n, e = divmod(x, E)
            o = owners[l][e]
            if used[n] >= B or sends.get(o, 0) >= cap:
                continue
            out[l][n][used[n]] = e
            used[n] += 1
            sends[o] = sends.get(o, 0) + 1
    return torch.tensor(out, dtype=torch.int64).view(L, N, B)


def spread_step_fills(best_MLGr: tuple[torch.Tensor, torch.Tensor], step_LNE: torch.Tensor,
                      owner_gpu_LE: torch.Tensor, loads_MLSE: torch.Tensor, g: int, B: int, top_k: int,
                      weights: tuple[float, float, float, float],
                      slots_of: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                      caps: tuple[int, ...] = (1, 2, 3, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer, the cheapest of ``best_MLGr`` (``(expert_MLGr, quota_MLGr)``, the uncapped
    choice) and the step-long sets capped at each of ``caps`` copies per owner GPU
    (:func:`capped_step_set` of the nodes' remote step demand ``step_LNE``, put in slots by
    ``slots_of``, ``traffic.step_slots``), by the price of the module docstring.
    ``weights``: ``(token_s, row_s, pair_s, fill_s)``, the step-long rule's seconds per pair
    at a node's mean GPU, one row at the busiest GPU, one pair of expert compute, and one
    inter-node fill with its gradient return."""
    token_s, row_s, pair_s, fill_s = weights
    expert, quota = best_MLGr
    if expert.shape[0] == 0:
        return expert, quota

    def price(e_MLGr: torch.Tensor, q_MLGr: torch.Tensor, layers: torch.Tensor) -> torch.Tensor:
        return (link_seconds(loads_MLSE[:, layers], owner_gpu_LE[layers], e_MLGr[:, layers], g, top_k, row_s,
                             pair_s)
                + fill_link_seconds(e_MLGr[:, layers], q_MLGr[:, layers], owner_gpu_LE[layers], fill_s))

    L, G = expert.shape[1], expert.shape[2]
    best_L = torch.full((L,), float("inf"), dtype=torch.float64)
    priced = torch.zeros(L, dtype=torch.bool)   # the uncapped choice, priced where a cap differs
    for cap in caps:
        chosen_LNB = capped_step_set(step_LNE, owner_gpu_LE, B, cap, token_s, fill_s)
        e_MLGr, q_MLGr = slots_of(chosen_LNB)
        differs = ~((e_MLGr == expert) & (q_MLGr == quota)).flatten(2).all(-1).all(0)      # [L]
        todo = differs & ~priced
        if bool(todo.any()):
            best_L[todo] = price(expert, quota, todo.nonzero().squeeze(1))
            priced |= todo
        if bool(differs.any()):
            idx = differs.nonzero().squeeze(1)
            better = torch.zeros(L, dtype=torch.bool)
            p_d = price(e_MLGr, q_MLGr, idx)
            better[idx] = p_d < best_L[idx]
            if bool(better.any()):
                pick = better.view(1, -1, 1, 1)
                expert, quota = torch.where(pick, e_MLGr, expert), torch.where(pick, q_MLGr, quota)
                best_L[idx] = torch.minimum(best_L[idx], p_d)
        # a cap every owner meets leaves the step-long set as it is: larger caps change nothing more
        owners_LX = owner_gpu_LE.gather(1, chosen_LNB.clamp(min=0).view(L, -1))
        sends = torch.zeros(L, G, dtype=torch.int64).scatter_add_(
            1, owners_LX, (chosen_LNB >= 0).view(L, -1).to(torch.int64))
        if bool((sends.max(-1).values < cap).all()):
            break
    return expert.contiguous(), quota.contiguous()
