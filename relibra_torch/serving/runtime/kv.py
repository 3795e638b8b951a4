"""Prompt KV-cache handoff from prefill-attention ranks to decode-attention ranks (CPU).

One shared slot per request id: the prefill rank writes the request's keys and values of
every layer, then its length (last, so a reader that sees the length sees the data); the
decode rank waits for the length (with backoff and a timeout) and appends the rows to its
packed cache. Works with any cache shaped like ``examples/tiny_lm.py``'s ``KVCache``
(``k_CHDh`` / ``v_CHDh`` lists per layer of ``[C, H, Dh]``, ``sample_C``, ``pos_C``), whose
rows may be in any order (attention masks by sequence id and position).

Legend: N request slots, L layers, Q max positions, H heads, Dh head dim, C cached rows.
"""

from __future__ import annotations

import torch

from ...checks import check_int
from .transport import Backoff, wait_until

__all__ = ["KVHandoff", "drop_sequences"]


class KVHandoff:
    """Shared ``[N, L, 2, Q, H, Dh]`` prompt caches and ``[N]`` lengths (0 = not written yet)."""

    def __init__(self, requests: int, layers: int, max_len: int, heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32):
        shape = (check_int("requests", requests), check_int("layers", layers), 2, check_int("max_len", max_len),
                 check_int("heads", heads), check_int("head_dim", head_dim))
        self.kv = torch.zeros(shape, dtype=dtype).share_memory_()
        self.length_N = torch.zeros(requests, dtype=torch.int64).share_memory_()

    def put(self, cache, request: int, sample_id: int) -> None:
        """Write sequence ``sample_id`` of ``cache`` (positions 0..n-1) as request ``request``."""
        rows = (cache.sample_C == sample_id).nonzero()[:, 0]
        order = cache.pos_C[rows].argsort()
        rows = rows[order]
        n = rows.numel()
        if not 0 < n <= self.kv.shape[3]:
            raise ValueError(f"request {request} has {n} cached positions; allowed: 1..{self.kv.shape[3]} (max_len)")
        for layer in range(self.kv.shape[1]):
            self.kv[request, layer, 0, :n] = cache.k_CHDh[layer][rows]
            self.kv[request, layer, 1, :n] = cache.v_CHDh[layer][rows]
        self.length_N[request] = n

    def take(self, cache, request: int, sample_id: int, *, timeout_s: float = 60.0,
             backoff: Backoff = Backoff()) -> int:
        """Wait for request ``request`` and append it to ``cache`` as sequence ``sample_id``; its length."""
        wait_until(lambda: int(self.length_N[request]) > 0, timeout_s,
                   lambda: f"decode rank waiting for the prompt KV of request {request}", backoff)
        n = int(self.length_N[request])
        for layer in range(self.kv.shape[1]):
            k, v = self.kv[request, layer, 0, :n].clone(), self.kv[request, layer, 1, :n].clone()
            old_k, old_v = cache.k_CHDh[layer], cache.v_CHDh[layer]
            cache.k_CHDh[layer] = k if old_k is None else torch.cat([old_k, k])
            cache.v_CHDh[layer] = v if old_v is None else torch.cat([old_v, v])
        cache.sample_C = torch.cat([cache.sample_C, torch.full((n,), sample_id, dtype=torch.int64)])
        cache.pos_C = torch.cat([cache.pos_C, torch.arange(n, dtype=torch.int64)])
        return n


def drop_sequences(cache, sample_ids: list[int]) -> None:
    """Remove finished sequences' rows from a packed cache (requests leaving)."""
    if not sample_ids:
        return
    keep = ~torch.isin(cache.sample_C, torch.tensor(sample_ids, dtype=torch.int64))
    for layer in range(len(cache.k_CHDh)):
        if cache.k_CHDh[layer] is not None:
            cache.k_CHDh[layer] = cache.k_CHDh[layer][keep]
            cache.v_CHDh[layer] = cache.v_CHDh[layer][keep]
    cache.sample_C, cache.pos_C = cache.sample_C[keep], cache.pos_C[keep]
