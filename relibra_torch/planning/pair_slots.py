"""Which instance of its expert every (token, k) pair goes to: the one rule of the project.

Legend (shape suffixes): T tokens, K top-k, S source ranks, X destination slots
``G * J`` (flattened ``(gpu, slot)``), E logical experts.

A plan's :func:`~relibra_torch.planning.token_split` says how many pairs of expert ``e``
every source sends to every slot holding ``e`` (its quota), not which pairs. The rule that
picks them, used by the layer (``moe.schedule.assign_slots``) and by the simulator's
exact hierarchical count (``sim.dispatch``), is: a source's pairs of expert ``e``, in flat
``t * K + k`` order, fill ``e``'s instances in slot order (GPU, then slot), each up to its
quota. With replicas it decides which tokens share a destination GPU or node, hence how
many (token, node) and (token, GPU) copies a hierarchical exchange makes, so both sides
call these two functions and nothing else.
"""

from __future__ import annotations

import torch

__all__ = ["DISPATCH_MODES", "assign_pair_slots", "slot_quota_runs"]

#: Token exchanges the layer runs and the simulator prices: ``flat`` (one copy per
#: token-expert pair) and ``hierarchical`` (DeepEP's normal mode: one copy per (token,
#: remote node), then one per (token, GPU) inside the node).
DISPATCH_MODES = ("flat", "hierarchical")


def slot_quota_runs(slot_expert_X: torch.Tensor, quota_SX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots sorted by (expert, slot) and the sources' quota runs in that order.

    Args:
        slot_expert_X: int64 ``[X]`` logical expert in each slot, ``-1`` empty.
        quota_SX: int64 ``[S, X]`` pairs each source sends to each slot (0 on empty slots).

    Returns:
        ``(order_X, cum_end_R)``: int64 ``[X]`` slots sorted by (expert, slot index), empty
        slots first; int64 ``[S * X]`` cumulative ends of the quotas laid out source by
        source in that order. Source ``s``'s ``p``-th pair in (expert, flat index) order,
        counted after all pairs of sources ``< s``, goes to slot ``order_X[q % X]`` with
        ``q`` the first index whose end exceeds that position.
    """
    X = slot_expert_X.numel()
    valid_X = slot_expert_X >= 0
    key_X = torch.where(valid_X, slot_expert_X * X + torch.arange(X, device=slot_expert_X.device),
                        torch.full_like(slot_expert_X, -1))
    order_X = key_X.argsort(stable=True)
    cum_end_R = (quota_SX * valid_X)[:, order_X].reshape(-1).cumsum(0)
    return order_X, cum_end_R


def assign_pair_slots(ids_TK: torch.Tensor, order_X: torch.Tensor, cum_end_R: torch.Tensor,
                      num_experts: int, source_T: torch.Tensor | None = None) -> torch.Tensor:
    """Destination slot of every (token, k) pair, by the rule of the module docstring.

    Args:
        ids_TK: int ``[T, K]`` expert ids, ``-1`` a pad (no expert).
        order_X, cum_end_R: from :func:`slot_quota_runs` (one source: ``R = X``).
        num_experts: ``E``.
        source_T: int64 ``[T]`` source rank of every token, ascending (sources in rank order);
            ``None``: all tokens from one source (the layer's own tokens).

    Returns:
        int64 ``[T, K]`` slots in ``[0, X)``, ``X`` for pads. The caller must hold routing
        whose per-(source, expert) counts equal the quotas (the layer checks it, the
        simulator's routing is what the plan was counted from); otherwise pairs past a run
        land in the next slot.
    """
    device = ids_TK.device
    X = order_X.numel()
    T, K = ids_TK.shape
    flat = ids_TK.reshape(-1).to(torch.int64)
    pad = flat < 0
    key = flat if source_T is None else source_T.to(device).repeat_interleave(K) * num_experts + flat
    # Pads sort after every pair, so real pairs keep their positions. The keys fit int32 where
    # (sources x experts) does (sources ascending: the last is the largest), and an int32 sort
    # takes half the time of an int64 one.
    sources = 1 if source_T is None or not source_T.numel() else int(source_T[-1]) + 1
    small = sources * num_experts < torch.iinfo(torch.int32).max
    dtype = torch.int32 if small else torch.int64
    key = torch.where(pad, torch.iinfo(dtype).max, key.to(dtype))
    order = key.argsort(stable=True)
    # The j-th pair in sorted order fills the run whose end first exceeds j: searching the
    # sorted positions 0..n-1 (5x faster than the pairs' own positions, in random order),
    # then placing each result at its pair.
    q = torch.searchsorted(cum_end_R.to(device), torch.arange(order.numel(), device=device), right=True)
    q = q.clamp(max=max(cum_end_R.numel() - 1, 0))
    dest_sorted = order_X.to(device)[q % X] if X else torch.zeros_like(q)
    dest = torch.empty_like(dest_sorted).scatter_(0, order, dest_sorted)
    return torch.where(pad, X, dest).view(T, K)
