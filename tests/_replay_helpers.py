"""Helpers shared by the replay tests: random valid replays and raw (unchecked) file writers.

Shape legend: T tokens, L layers, K top-k, E experts, N samples, X steps, M micro-batches,
S source ranks.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save_file


def random_ids_TLK(T: int, L: int, K: int, E: int, seed: int = 0, skew: float = 0.0) -> torch.Tensor:
    """Valid expert ids [T, L, K]: K distinct experts per token, optionally skewed to low ids."""
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, L, E, generator=gen)
    if skew:
        scores = scores + skew * torch.linspace(1.0, 0.0, E)
    return scores.topk(K, dim=-1).indices


def offsets_from_lengths(lengths) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def write_raw(path, tensors: dict, metadata: dict | None) -> None:
    """Write a safetensors file without any relibra validation (for bad-file tests)."""
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)


def split_file(data: bytes) -> tuple[dict, bytes]:
    """(header dict, data section) of safetensors bytes."""
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_file(header: dict, body: bytes) -> bytes:
    """Safetensors bytes from a header dict and a data section (no consistency checks)."""
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def naive_counts(ids_TLK, offsets, rank_N, micro_N, M, S, E) -> torch.Tensor:
    """Reference loads [M, L, S, E] by explicit Python loops over tokens."""
    T, L, K = ids_TLK.shape
    out = torch.zeros(M, L, S, E, dtype=torch.int64)
    for i in range(offsets.numel() - 1):
        m, s = int(micro_N[i]), int(rank_N[i])
        for t in range(int(offsets[i]), int(offsets[i + 1])):
            for layer in range(L):
                for k in range(K):
                    out[m, layer, s, int(ids_TLK[t, layer, k])] += 1
    return out


def skewed_routing_file(path, E: int, K: int, L: int, num_samples: int, lo: int, hi: int, seed: int) -> None:
    """A routing file of ``num_samples`` samples of ``lo..hi`` tokens; per (sample, layer) a
    skewed expert preference, each token ``K`` distinct experts drawn from it."""
    from relibra_torch.replay import RoutingReplay
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (num_samples,), generator=g)
    parts = []
    for n in lengths.tolist():
        ids = torch.empty(n, L, K, dtype=torch.int64)
        for l in range(L):
            w = torch.rand(E, generator=g) ** 3 + 1e-2
            ids[:, l] = torch.multinomial(w.expand(n, E), K, replacement=False, generator=g)
        parts.append(ids)
    RoutingReplay(torch.cat(parts).to(torch.int16), offsets_from_lengths(lengths.tolist()), E).save(str(path))
