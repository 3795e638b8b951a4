"""Replayed expert ids -> token counts per expert, and the checks on expert ids.

The one implementation of "count the tokens each expert gets" in the package: the hook
counts a rank's micro-batches with it, :class:`~relibra_torch.replay.RoutingReplay` counts
files, the simulator counts synthetic traces. All counting is vectorised (one ``bincount``
per chunk of tokens over a flattened (group, layer, expert) index); chunks bound the
temporary memory on million-token replays without per-token Python loops.

Each token counts once per expert of its top-k, so a layer's counts sum to ``K * tokens``.

Legend: T tokens (any leading dims, flattened), L MoE layers, K top-k, E experts,
B groups of tokens (samples, micro-batches, (micro-batch, source rank) pairs),
M micro-batches.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..checks import check_int, check_tensor
from .fileio import dtype_name

__all__ = [
    "checked_counts",
    "count_pairs",
    "ID_DTYPES",
    "MAX_EXPERTS",
    "check_expert_ids",
    "count_by_group",
    "count_experts",
    "count_micro_batches",
    "token_chunks",
    "validate_expert_ids",
]

# Limit on the expert count (also the file formats' metadata limit): generous, but small
# enough that flattened (group, layer, expert) indices stay in int64.
MAX_EXPERTS = 2**20
ID_DTYPES = (torch.int16, torch.int32, torch.int64)  # accepted expert-id dtypes in memory

# Token chunk for the vectorised passes: bounds temporary memory (chunk * L * K int64
# indices) on million-token files without falling back to per-token Python loops.
CHUNK_ELEMENTS = 1 << 22


def token_chunks(num_tokens: int, per_token: int):
    """``(start, stop)`` ranges covering ``num_tokens`` tokens, ~``CHUNK_ELEMENTS`` elements each."""
    step = max(1, CHUNK_ELEMENTS // max(1, per_token))
    for start in range(0, num_tokens, step):
        yield start, min(num_tokens, start + step)


def check_expert_ids(expert_ids, num_experts: int, *, name: str = "expert_ids",
                     distinct: bool = False, pads: bool = False) -> torch.Tensor:
    """``expert_ids`` if it is an int16/int32/int64 tensor ``[..., K]`` of ids in ``[0, E)``.

    With ``distinct`` the ``K`` ids of one row must differ (a token's top-k never repeats an
    expert). With ``pads``, ``-1`` is allowed too: "no expert" for that (token, k), as the
    layer takes it at run time (files never hold pads). Raises ``TypeError`` for a
    non-tensor, ``ValueError`` naming the first bad position and value otherwise.
    """
    expert_ids = check_tensor(name, expert_ids)
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    if expert_ids.dtype not in ID_DTYPES:
        raise ValueError(f"{name} has dtype {dtype_name(expert_ids.dtype)}; allowed: int16, int32 or int64")
    if expert_ids.dim() < 1:
        raise ValueError(f"{name} has shape {tuple(expert_ids.shape)}; allowed: [..., top_k]")
    k = expert_ids.shape[-1]
    if k > num_experts:
        raise ValueError(f"{name}: top_k = {k} exceeds num_experts = {num_experts}; allowed: top_k <= num_experts")
    if expert_ids.numel() == 0:
        return expert_ids
    # min/max first: one cheap pass on the valid (common) case; the position only on error.
    low = -1 if pads else 0
    if int(expert_ids.min()) < low or int(expert_ids.max()) >= num_experts:
        bad = (expert_ids < low) | (expert_ids >= num_experts)
        pos = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}{list(pos)} = {int(expert_ids[pos])} is out of range; allowed: expert ids in "
            f"[0, {num_experts})" + (", or -1 for a pad" if pads else "")
        )
    if not distinct or k < 2:
        return expert_ids
    rows = expert_ids.reshape(-1, k)
    for start, stop in token_chunks(rows.shape[0], k):
        srt = rows[start:stop].sort(dim=-1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=-1)
        if bool(dup.any()):
            flat = start + int(dup.nonzero()[0, 0])
            pos = list(torch.unravel_index(torch.tensor(flat), expert_ids.shape[:-1])) if expert_ids.dim() > 1 else []
            pos = [int(p) for p in pos]
            raise ValueError(
                f"{name}{pos} = {rows[flat].tolist()} repeats an expert; allowed: distinct expert ids "
                "within one token's top-k"
            )
    return expert_ids


def validate_expert_ids(expert_ids, num_experts: int, *, name: str = "routed_experts",
                        check_duplicates: bool = True) -> None:
    """Check an integer tensor ``[..., K]`` of expert ids.

    Every id must be in ``[0, num_experts)`` and (with ``check_duplicates``) the ``K`` ids of
    one row distinct. dtype must be int16, int32 or int64. Usable on in-memory routing, e.g.
    ``[T, K]`` from a router or ``[T, L, K]`` from a replay. Raises ``ValueError`` naming the
    first bad position and value, ``TypeError`` for a non-tensor.
    """
    check_expert_ids(expert_ids, num_experts, name=name, distinct=check_duplicates)


def _check_layered(ids, num_experts: int, name: str, num_layers: int | None, pads: bool = False) -> torch.Tensor:
    """``ids`` as ``[T, L, K]`` (leading dims flattened), range-checked."""
    ids = check_expert_ids(ids, num_experts, name=name, pads=pads)
    if ids.dim() < 2 or (num_layers is not None and ids.shape[-2] != num_layers):
        layers = "L" if num_layers is None else f"L={num_layers}"
        raise ValueError(f"{name} has shape {tuple(ids.shape)}; allowed: [..., {layers}, K] "
                         "(one row of top-k ids per MoE layer)")
    return ids.reshape(-1, ids.shape[-2], ids.shape[-1])


def _bincount_TLK(ids_TLK: torch.Tensor, group_T: torch.Tensor | None, num_groups: int,
                  num_experts: int) -> torch.Tensor:
    """int64 ``[B, L, E]`` from checked ids ``[T, L, K]`` and groups ``[T]`` (None: one group)."""
    T, L, K = ids_TLK.shape
    # One bin more per layer, in front, for pads (-1): counted there, then dropped.
    E = num_experts + 1
    device = ids_TLK.device
    # Flattened index of (b, l, e) = (b * L + l) * E + e: a per-token part (b), a per-layer
    # part (l) and the expert id.
    layer_L = torch.arange(L, dtype=torch.int64, device=device) * E
    out = torch.zeros(num_groups * L * E, dtype=torch.int64, device=device)
    for start, stop in token_chunks(T, L * K):
        idx = ids_TLK[start:stop].long() + 1 + layer_L[None, :, None]
        if group_T is not None:
            idx += (group_T[start:stop] * (L * E))[:, None, None]
        out += torch.bincount(idx.reshape(-1), minlength=out.numel())
    return out.view(num_groups, L, E)[..., 1:]


def count_experts(expert_ids_TLK, num_experts: int, *, name: str = "expert_ids",
                  num_layers: int | None = None, pads: bool = False) -> torch.Tensor:
    """Tokens per (layer, expert): int64 ``[L, E]`` from expert ids ``[..., L, K]``.

    All leading dims are tokens. Ids are range-checked (``ValueError`` outside ``[0, E)``);
    duplicates inside a top-k are not checked (:func:`validate_expert_ids` does), they would
    simply count twice. ``num_layers``, when given, must equal ``L``. With ``pads``, ids of
    ``-1`` are allowed and counted nowhere. The result is on the ids' device.
    """
    ids_TLK = _check_layered(expert_ids_TLK, num_experts, name, num_layers, pads)
    return _bincount_TLK(ids_TLK, None, 1, num_experts)[0]


def count_by_group(expert_ids_TLK, group_T, num_groups: int, num_experts: int, *,
                   name: str = "expert_ids") -> torch.Tensor:
    """Tokens per (group, layer, expert): int64 ``[B, L, E]``.

    Args:
        expert_ids_TLK: int ``[T, L, K]`` (or ``[..., L, K]``, leading dims flattened).
        group_T: integer ``[T]`` in ``[0, B)``: the group (sample, micro-batch, ...) of
            each token.
        num_groups: ``B``; groups without tokens get zero counts.
    """
    ids_TLK = _check_layered(expert_ids_TLK, num_experts, name, None)
    B = check_int("num_groups", num_groups, 1)
    group_T = check_tensor("group_T", group_T, dim=1)
    if group_T.dtype.is_floating_point or group_T.dtype == torch.bool or group_T.is_complex():
        raise ValueError(f"group_T has dtype {dtype_name(group_T.dtype)}; allowed: an integer dtype")
    if group_T.numel() != ids_TLK.shape[0]:
        raise ValueError(f"group_T has {group_T.numel()} entries but {name} has {ids_TLK.shape[0]} tokens; "
                         "allowed: one group per token")
    if group_T.numel() and (int(group_T.min()) < 0 or int(group_T.max()) >= B):
        i = int(((group_T < 0) | (group_T >= B)).nonzero()[0, 0])
        raise ValueError(f"group_T[{i}] = {int(group_T[i])}; allowed: [0, {B})")
    return _bincount_TLK(ids_TLK, group_T.to(device=ids_TLK.device, dtype=torch.int64), B, num_experts)


def count_micro_batches(routed_experts: Sequence[torch.Tensor], num_layers: int, num_experts: int, *,
                        name: str = "routed_experts", top_k: int | None = None) -> torch.Tensor:
    """Token-expert counts of a rank's micro-batches: int64 ``[M, L, E]`` on the CPU.

    Args:
        routed_experts: one integer tensor ``[T_m, L, K]`` (or ``[..., L, K]``) per
            micro-batch; ``T_m`` (and ``K``, unless ``top_k`` is given) may differ between
            micro-batches. Run-time routing: ``-1`` (a pad, no expert) is allowed and counted nowhere.
        top_k: the layers' top-k, which every tensor's ``K`` must equal (``None``: any).
    """
    if isinstance(routed_experts, torch.Tensor) or not isinstance(routed_experts, Sequence):
        raise TypeError(f"{name} is {type(routed_experts).__name__}; allowed: a list of [T, L, K] "
                        "tensors, one per micro-batch")
    L = check_int("num_layers", num_layers, 1)
    check_int("num_experts", num_experts, 1, MAX_EXPERTS)
    out = torch.zeros(len(routed_experts), L, num_experts, dtype=torch.int64)
    for m, ids in enumerate(routed_experts):
        where = f"{name}[{m}]"
        check_tensor(where, ids, dtypes=ID_DTYPES)
        if top_k is not None and ids.dim() >= 2 and ids.shape[-1] != top_k:
            raise ValueError(f"{where} has shape {tuple(ids.shape)}: top-k {ids.shape[-1]}, but the layers route "
                             f"to top_k {top_k}; the replay was recorded for another model")
        out[m] = count_experts(ids, num_experts, name=where, num_layers=L, pads=True).cpu()
    return out


def count_pairs(expert_ids_TLK, num_experts: int, *, name: str = "expert_ids") -> torch.Tensor:
    """Co-activation counts: int64 ``[L, E, E]``, entry ``[l, a, b]`` the tokens whose top-k
    at layer ``l`` holds both ``a`` and ``b`` (symmetric, zero diagonal; pads, ``-1``, are in
    no pair). All leading dims of ``expert_ids_TLK`` ``[..., L, K]`` are tokens.

    Only replay gives these for the coming step: with hierarchical dispatch a token crosses
    to each remote node once, so experts chosen together are cheaper on one node.
    """
    ids_TLK = _check_layered(expert_ids_TLK, num_experts, name, None, pads=True)
    T, L, K = ids_TLK.shape
    E = num_experts
    out = torch.zeros(L * E * E, dtype=torch.int64, device=ids_TLK.device)
    if K < 2 or T == 0:
        return out.view(L, E, E)
    i, j = torch.triu_indices(K, K, offset=1, device=ids_TLK.device)
    layer_L = (torch.arange(L, device=ids_TLK.device) * E * E).view(1, L, 1)
    for start, stop in token_chunks(T, L * K * K):
        ids = ids_TLK[start:stop].long()
        a, b = ids[..., i], ids[..., j]                                   # [t, L, P] pairs
        ok = (a >= 0) & (b >= 0)
        idx = (torch.minimum(a, b) * E + torch.maximum(a, b)).clamp(min=0) + layer_L
        out += torch.bincount(idx[ok], minlength=out.numel())
    upper = out.view(L, E, E)
    return upper + upper.transpose(1, 2)


def checked_counts(counts_MLE: torch.Tensor, num_layers: int, num_experts: int) -> torch.Tensor:
    """int64 ``[M, L, E]``: ``counts_MLE`` checked (shape, integral, finite, >= 0) before any cast."""
    if not isinstance(counts_MLE, torch.Tensor):
        raise TypeError(f"counts_MLE is {type(counts_MLE).__name__}; allowed: a tensor [M, L, E]")
    if counts_MLE.dim() != 3 or tuple(counts_MLE.shape[1:]) != (num_layers, num_experts):
        raise ValueError(f"counts_MLE has shape {tuple(counts_MLE.shape)}; allowed: [M, {num_layers}, {num_experts}]")
    c = counts_MLE.detach().cpu()
    if c.dtype == torch.bool or c.is_complex():
        raise TypeError(f"counts_MLE has dtype {c.dtype}; allowed: an integer or float tensor of whole counts")
    if c.is_floating_point():
        bad = ~torch.isfinite(c) | (c != c.round())
        if bool(bad.any()):
            i = tuple(int(v) for v in bad.nonzero()[0])
            raise ValueError(f"counts_MLE{list(i)} = {float(c[i])}; allowed: whole token counts (finite, no fraction)")
    if c.numel() and bool((c < 0).any()):
        i = tuple(int(v) for v in (c < 0).nonzero()[0])
        raise ValueError(f"counts_MLE{list(i)} = {c[i].item()} is negative; allowed: counts >= 0")
    return c.to(torch.int64)
