"""Two-hop replicas: more copies of a remote expert on a node fill from the node's first copy.

Legend: M micro-batches, L layers, G GPUs, J slots per GPU, N nodes, g GPUs per node,
P = g * J slots of one node, X = G * J slots, B (micro-batch, layer, node) rows.

A cross-node fill (a replica residency, ``planning.residency``, whose expert's owner is on
another node) costs one inter-node weight transfer and one inter-node gradient return. When
a node holds several copies of one remote expert, only one of them has to cross: the others
can copy it over NVLink and reduce their gradients into it. The plan format does not say
which copy is the hub; this module derives it by one deterministic rule, used by the
simulator (``sim.transfers``: counts and prices) and by the layer (``moe.residents``:
executes it), so both agree without changing :class:`~relibra_torch.planning.StepPlan`:

    Each cross-node residency ``x`` of expert ``e`` on node ``n`` spans ``[a_x, b_x]``: its
    fill micro-batch (first with tokens) through its return micro-batch (last with tokens).
    Residency ``y`` *covers* ``x`` when both are cross-node residencies of ``e`` on ``n``,
    ``a_y <= a_x``, ``b_y >= b_x`` and ``y`` is longer or, with the same span, in a lower
    slot (``gpu * J + j``). A residency no other covers is *direct*: it fills from the owner
    (first hop) and returns its gradient to the owner. Any other residency's *hub* is the
    lowest direct residency covering it: it fills from the hub over NVLink, after the hub's
    own fill (second hop), and in its return micro-batch's backward reduces its gradient
    into the hub's over NVLink, before the hub returns the sum to the owner (the hub's
    return micro-batch is never earlier). Only a second hop whose hub fills (returns) in
    the same micro-batch needs an exchange of its own after (before) the first hops; the
    others ride in the micro-batch's first-hop exchange (:func:`sequential_hops`). Covering is a strict partial order, so every
    non-direct residency has a direct cover, and a hub is always direct: at most two hops.

Only kept replicas (``refetch_replicas=False``) use hubs: re-fetched replicas keep nothing
between micro-batches to forward from. Tokenless residencies have no fill, hence no hub.
"""

from __future__ import annotations

import torch

__all__ = ["hop_routes", "residency_spans", "sequential_hops", "two_hop_hubs"]


def residency_spans(held_MLGJ: torch.Tensor, fill_start_MLGJ: torch.Tensor,
                    grad_return_MLGJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(fill_mb, return_mb)`` of the residency held at each position (``-1`` where no
    buffer is held), any trailing shape after the micro-batch dimension.

    A held run goes from its ``fill_start`` to its ``grad_return`` (``planning.residency``),
    so the fill micro-batch is the last fill start at or before ``m`` and the return
    micro-batch the first return at or after it.
    """
    M = held_MLGJ.shape[0]
    idx = torch.arange(M).view(M, *([1] * (held_MLGJ.dim() - 1))).expand_as(held_MLGJ)
    fill_mb = torch.where(fill_start_MLGJ, idx, -1).cummax(0).values
    big = M + 1
    ret_mb = torch.where(grad_return_MLGJ, idx, big).flip(0).cummin(0).values.flip(0)
    none = torch.full_like(idx, -1)
    return torch.where(held_MLGJ, fill_mb, none), torch.where(held_MLGJ, ret_mb, none)


def two_hop_hubs(slot_expert_MLGJ: torch.Tensor, cross_node_MLGJ: torch.Tensor, held_MLGJ: torch.Tensor,
                 fill_start_MLGJ: torch.Tensor, grad_return_MLGJ: torch.Tensor,
                 gpus_per_node: int) -> torch.Tensor:
    """The hub of every second-hop residency (the rule of the module docstring).

    Args:
        slot_expert_MLGJ: int64 ``[M, L, G, J]`` expert per slot (``-1`` empty).
        cross_node_MLGJ: bool, the slot's expert is owned on another node.
        held_MLGJ / fill_start_MLGJ / grad_return_MLGJ: bool, the residency masks
            (:func:`~relibra_torch.planning.residency.residency_masks`).
        gpus_per_node: ``g``.

    Returns:
        int64 ``[M, L, G, J]``: at every micro-batch a second-hop residency is held, the
        flat slot ``gpu * J + j`` of its hub (on the same node); ``-1`` elsewhere (direct
        residencies, intra-node fills, owners, empty slots).
    """
    M, L, G, J = slot_expert_MLGJ.shape
    g = gpus_per_node
    N, P = G // g, g * J
    hub = torch.full((M, L, G, J), -1, dtype=torch.int64)
    valid_BP = (held_MLGJ & cross_node_MLGJ).reshape(M * L * N, P)
    if M == 0 or not bool(valid_BP.any()):
        return hub
    e_BP = torch.where(valid_BP, slot_expert_MLGJ.reshape(-1, P), -1)
    # Only rows where one expert has two held cross-node copies can have a hub.
    s = e_BP.sort(1).values
    rows = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(1).nonzero().flatten()
    if rows.numel() == 0:
        return hub
    a_MLGJ, b_MLGJ = residency_spans(held_MLGJ, fill_start_MLGJ, grad_return_MLGJ)
    e = e_BP[rows]
    v = valid_BP[rows]
    a, b = a_MLGJ.reshape(-1, P)[rows], b_MLGJ.reshape(-1, P)[rows]
    p = torch.arange(P)
    # covers[r, y, x]: y covers x
    same = v.unsqueeze(2) & v.unsqueeze(1) & (e.unsqueeze(2) == e.unsqueeze(1))
    ay, ax, by, bx = a.unsqueeze(2), a.unsqueeze(1), b.unsqueeze(2), b.unsqueeze(1)
    longer = (ay < ax) | (by > bx) | (p.view(P, 1) < p.view(1, P))
    covers = same & (ay <= ax) & (by >= bx) & longer & (p.view(P, 1) != p.view(1, P))
    direct = v & ~covers.any(1)
    cand = covers & direct.unsqueeze(2)                        # direct y covering x
    first = torch.where(cand, p.view(1, P, 1), P).min(1).values  # lowest such y, P if none
    node = rows % N
    hub_rp = torch.where(first < P, node.unsqueeze(1) * P + first, -1)
    hub.view(-1, P)[rows] = hub_rp
    return hub


def sequential_hops(hub_MLGJ: torch.Tensor, held_MLGJ: torch.Tensor, fill_start_MLGJ: torch.Tensor,
                    grad_return_MLGJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which second hops must wait for their hub in the same micro-batch (bool ``[M, L, G, J]``).

    ``fill_after``: a second-hop fill whose hub is filled in the same forward: it runs in an
    exchange after the first hops. A hub filled earlier already holds the weights, so its
    copies join the micro-batch's first-hop exchange. ``return_before``: a second-hop
    reduction whose hub returns in the same backward: it runs in an exchange before the
    returns; one whose hub returns later joins that backward's return exchange.
    """
    M, L, G, J = hub_MLGJ.shape
    hop2 = hub_MLGJ >= 0
    if not bool(hop2.any()):
        return hop2.clone(), hop2.clone()
    a, b = residency_spans(held_MLGJ, fill_start_MLGJ, grad_return_MLGJ)
    idx = hub_MLGJ.clamp(min=0).view(M, L, G * J)
    hub_a = a.view(M, L, G * J).gather(2, idx).view_as(a)
    hub_b = b.view(M, L, G * J).gather(2, idx).view_as(b)
    return hop2 & fill_start_MLGJ & (hub_a == a), hop2 & grad_return_MLGJ & (hub_b == b)


def hop_routes(owner_MLGJ: torch.Tensor, cross_node_MLGJ: torch.Tensor, hub_MLGJ: torch.Tensor,
               held_MLGJ: torch.Tensor, fill_start_MLGJ: torch.Tensor, grad_return_MLGJ: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each replica slot's weights come from and its gradient goes, as the layer runs it.

    Returns ``(src_gpu, cross_link, fill_after, return_before)`` ``[M, L, G, J]``: the GPU
    at the other end of the slot's fill and return (its hub's GPU, ``hub // J``, for a second
    hop, else its expert's owner; int64, ``-1`` owners stay ``-1``), whether that transfer
    crosses nodes (first hops of cross-node residencies only: second hops are NVLink), and
    :func:`sequential_hops` (the second hops that need an exchange of their own). The
    simulator's counts (``sim.transfers.replica_traffic``) and the planner's prices
    (``planning.price``) both read this."""
    J = hub_MLGJ.shape[-1]
    hop2 = hub_MLGJ >= 0
    src = torch.where(hop2, hub_MLGJ // J, owner_MLGJ)
    fill_after, return_before = sequential_hops(hub_MLGJ, held_MLGJ, fill_start_MLGJ, grad_return_MLGJ)
    return src, cross_node_MLGJ & ~hop2, fill_after, return_before
