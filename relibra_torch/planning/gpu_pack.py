"""Experts to GPUs inside each node when no replica slot can spread a node's load (``R = 0``).

Reordering (:func:`relibra_torch.planning.relibra.reorder`) chooses each expert's node by
the busiest *node*, because with replica slots balancing copies spread a node's load over
its ``g`` GPUs. Without replica slots no copy exists: the busiest *GPU* sets the layer's
expert compute, and :func:`~relibra_torch.planning.fastpath.assign_gpus` (experts stay on
their previous GPU when it is in their node) never evens two hot experts that share a GPU
(the default trace at ``R = 0``: relibra's per-micro-batch GPU imbalance 2.00 against
eplb-oracle's 1.45, its step 0.94x eplb-oracle's).

Here, per (layer, node), steepest-descent swaps of two experts between the node's GPUs
minimise

    compute_s_per_token * sum_m max_p gpu_load[m, p]  +  price * experts off their previous GPU

with ``price = intra_migration_s_per_expert / 2``: one swap moves two experts over NVLink
and each GPU sends one and receives one at once, and the cost model charges a GPU's sent
or received bytes (``sim.cost.CostModel.migration``). Each round scores the swaps of every
expert on the node's busiest GPU (summed over micro-batches where it is the busiest) with
every expert on the node's other GPUs, exactly (only the two GPUs change: the new maximum is
``max(the node's other GPUs, new p, new q)``, from each micro-batch's three busiest GPUs),
and applies the best one where it lowers the objective; all layers and nodes at once, in
numpy (integer loads, one float64 objective: the same plan on every rank).

An expert that reordering brought from another node swaps only with another such expert:
each GPU then receives as many experts across nodes as ``assign_gpus`` gave it. The cost
model charges the busiest GPU's inter-node migration bytes, and a swap that stacked two
arrivals on one GPU doubled the step's migration (a tiny instance of
``benchmarks/bound_gap.py``: 245 -> 520 us for 40 us of compute saved).

Legend: L layers, M micro-batches, E experts, N nodes, g GPUs per node, El native experts
per GPU, K = g * El experts of a node, W candidate swaps of a node (El * (K - El)).
"""

from __future__ import annotations

import numpy as np
import torch

from .topology import Topology

__all__ = ["pack_gpus", "swap_can_pay"]


def swap_can_pay(load_MLE: torch.Tensor, placement_LE: torch.Tensor, topology: Topology, config) -> bool:
    """Whether :func:`pack_gpus` may swap anything on ``placement_LE`` (``False`` proves it
    keeps it): a swap can lower a node's busiest GPU by at most its excess over the node's
    mean, ``max_p load - ceil(node load / g)`` per micro-batch, and it moves two experts."""
    if (topology.replica_slots > 0 or topology.experts_per_gpu < 2 or topology.gpus_per_node < 2
            or config.compute_s_per_token <= 0):
        return False
    M, L, E = load_MLE.shape
    N, g = topology.num_nodes, topology.gpus_per_node
    gpu_MLNg = torch.zeros(M, L, N * g, dtype=torch.int64).scatter_add_(
        2, (placement_LE // topology.experts_per_gpu).unsqueeze(0).expand(M, L, E), load_MLE.to(torch.int64)
    ).view(M, L, N, g)
    excess_LN = (gpu_MLNg.amax(-1) - (gpu_MLNg.sum(-1) + g - 1) // g).sum(0)
    return bool((excess_LN.to(torch.float64) * config.compute_s_per_token
                 > config.intra_migration_s_per_expert).any())


def pack_gpus(placement_LE: torch.Tensor, load_LME: torch.Tensor, prev_gpu_LE: torch.Tensor,
              topology: Topology, config) -> torch.Tensor:
    """``placement_LE`` (int64 ``[L, E]`` native slot per expert) with experts swapped between
    GPUs of their node as the module docstring says, in canonical slot order (experts in
    logical order inside a GPU, as ``assign_gpus`` orders them); unchanged where ``R > 0``,
    ``El == 1`` (a swap only permutes GPUs), one GPU per node, or no swap pays.

    Args:
        load_LME: int ``[L, M, E]`` tokens per expert per micro-batch.
        prev_gpu_LE: int64 ``[L, E]`` each expert's GPU before this step (moves are priced
            against it).
        config: a ``ReLibraConfig`` (``compute_s_per_token``, ``intra_migration_s_per_expert``,
            ``max_swap_rounds``).
    """
    El = topology.experts_per_gpu
    if topology.replica_slots > 0 or El < 2 or topology.gpus_per_node < 2 or config.compute_s_per_token <= 0:
        return placement_LE
    L, M, E = load_LME.shape
    N, g = topology.num_nodes, topology.gpus_per_node
    K = g * El
    gpu = (placement_LE // El).numpy().copy()
    prev = prev_gpu_LE.numpy()
    # experts grouped by node (fixed here), each node's in logical order: [L, N, K]
    members = np.argsort((gpu // g) * E + np.arange(E), axis=1, kind="stable").reshape(L, N, K)
    x = np.take_along_axis(load_LME.numpy().astype(np.int64), members.reshape(L, 1, E), 2)
    x = x.reshape(L, M, N, K).transpose(0, 2, 1, 3)                              # [L, N, M, K]
    prev_local = np.take_along_axis(prev, members.reshape(L, E), 1).reshape(L, N, K)   # GPU ids, not local
    base = (np.arange(N) * g).reshape(1, N, 1)
    # experts that came from another node this step: their GPUs keep them (module docstring)
    arrived = (prev_local // g) != np.arange(N).reshape(1, N, 1)                  # [L, N, K]
    price = config.intra_migration_s_per_expert / 2 / config.compute_s_per_token   # tokens per moved expert
    changed = False
    for _ in range(config.max_swap_rounds):
        local = np.take_along_axis(gpu, members.reshape(L, E), 1).reshape(L, N, K) - base   # [L, N, K]
        gl = x @ (local[..., None] == np.arange(g)).astype(np.int64)            # [L, N, M, g]
        node_max = gl.max(-1)                                                    # [L, N, M]
        # the bottleneck GPU: most micro-batch load where it is the busiest
        hot = np.where(gl == node_max[..., None], gl, 0).sum(2).argmax(-1)       # [L, N]
        on_hot = local == hot[..., None]                                          # [L, N, K], El true
        a = np.argsort(~on_hot, axis=-1, kind="stable")[..., :El]                 # [L, N, El]
        b = np.argsort(on_hot, axis=-1, kind="stable")[..., :K - El]              # [L, N, K - El]
        a_w = np.repeat(a, K - El, -1)                                            # [L, N, W]
        b_w = np.tile(b, (1, 1, El))
        q_w = np.take_along_axis(local, b_w, -1)
        xa = np.take_along_axis(x, a_w[:, :, None, :], -1)                       # [L, N, M, W]
        xb = np.take_along_axis(x, b_w[:, :, None, :], -1)
        lp = np.take_along_axis(gl, hot[:, :, None, None], -1)                  # [L, N, M, 1]
        lq = np.take_along_axis(gl, q_w[:, :, None, :], -1)
        # the node's busiest GPU outside p and q, from its three busiest
        order = np.argsort(-gl, axis=-1, kind="stable")[..., :3]
        top = np.take_along_axis(gl, order, -1)
        if g < 3:
            pad = 3 - g
            order = np.concatenate([order, np.full(order.shape[:-1] + (pad,), -1)], -1)
            top = np.concatenate([top, np.zeros(top.shape[:-1] + (pad,), dtype=np.int64)], -1)
        out_pq = (order[..., None, :] != hot[:, :, None, None, None]) & (order[..., None, :] != q_w[:, :, None, :, None])
        rest = np.where(out_pq & (order[..., None, :] >= 0), top[..., None, :], 0).max(-1)   # [L, N, M, W]
        new_max = np.maximum(rest, np.maximum(lp - xa + xb, lq - xb + xa)).sum(2)           # [L, N, W]
        pa = np.take_along_axis(prev_local, a_w, -1) - base
        pb = np.take_along_axis(prev_local, b_w, -1) - base
        moved = ((q_w != pa).astype(np.int64) - (hot[..., None] != pa) + (hot[..., None] != pb) - (q_w != pb))
        delta = (new_max - node_max.sum(2)[..., None]).astype(np.float64) + price * moved
        delta[np.take_along_axis(arrived, a_w, -1) != np.take_along_axis(arrived, b_w, -1)] = np.inf
        best = delta.argmin(-1)
        gain = np.take_along_axis(delta, best[..., None], -1)[..., 0]
        do = gain < -1e-9 * np.maximum(node_max.sum(2), 1)
        if not do.any():
            break
        changed = True
        l_i, n_i = np.nonzero(do)
        ea = members[l_i, n_i, a_w[l_i, n_i, best[l_i, n_i]]]
        eb = members[l_i, n_i, b_w[l_i, n_i, best[l_i, n_i]]]
        gpu[l_i, ea], gpu[l_i, eb] = gpu[l_i, eb], gpu[l_i, ea].copy()
    if not changed:
        return placement_LE
    # canonical slot order: experts in logical order inside each GPU
    order = np.argsort(gpu * E + np.arange(E), axis=1, kind="stable")
    slot = np.empty_like(order)
    np.put_along_axis(slot, order, np.arange(E)[None, :].repeat(L, 0), 1)
    return torch.from_numpy(slot)
