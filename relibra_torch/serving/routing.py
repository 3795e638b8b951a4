"""Expert routing for the serving model: popularity per layer, and tile tables from it.

The routing enters the serving cost only through the expert grouped GEMM on each GPU: its
row tiles (``tile_footprint``, the rule the runtime shares) and how many experts it reads.
For a batch of ``T`` tokens, the rows of expert ``e`` in layer ``l`` are drawn as
``Binomial(T, pi[l, e])`` (``pi`` the per-token inclusion probability, each row summing to
the top-k), experts sit on GPUs by a placement table, and the table keeps, averaged over
layers, the most loaded GPU's row tiles and active experts: an EP group waits for its
slowest GPU. Tables are built once per placement on a grid of ``T`` and interpolated in
``log T``.

Popularity sources: the synthetic trace model's calibrated heat
(:func:`relibra_torch.sim.traces.base_inclusion_LE`), or a routing replay / loads file.
Replication (``replicated_placement``): DeepSeek EPLB's global policy (its
:func:`~relibra_torch.planning.eplb.replicate_experts` and
:func:`~relibra_torch.planning.eplb.balanced_packing`) run on a *recent* routing window, so a
hot expert gets extra copies on the expert servers; rows of a replicated expert split evenly.

Legend: L MoE layers, E experts, G GPUs of the EP group, J expert slots per GPU, T grid points.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import check_int
from ..planning.eplb import balanced_packing, replicate_experts
from .tiles import tile_footprint

__all__ = ["TileTable", "popularity_from_file", "synthetic_popularity", "static_placement",
           "replicated_placement", "build_tile_table"]

T_GRID = np.unique(np.round(np.geomspace(1, 262144, 40)).astype(np.int64))


def synthetic_popularity(num_layers: int, num_experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """float64 ``[L, E]`` inclusion probabilities of the synthetic trace model (rows sum to K)."""
    from ..sim.traces import TraceConfig, base_inclusion_LE
    return base_inclusion_LE(TraceConfig(num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                                         seed=seed)).clone()


def popularity_from_file(path: str, num_layers: int, num_experts: int, top_k: int,
                         dense_layers: int = 0) -> torch.Tensor:
    """float64 ``[L, E]`` inclusion probabilities counted from a routing replay or loads file."""
    from .. import replay
    from ..replay.fileio import read_header
    if not os.path.exists(path):
        raise FileNotFoundError(f"--routing {path!r} does not exist")
    fmt = read_header(path).metadata.get("format")
    if fmt == replay.ROUTING_FORMAT:
        rr = replay.load_routing(path)
        shape = (rr.num_layers, rr.num_experts, rr.top_k)
        counts_LE = replay.count_experts(rr.routed_experts_TLK, rr.num_experts).to(torch.float64)
        tokens = rr.routed_experts_TLK.shape[0]
    elif fmt == replay.LOADS_FORMAT:
        lf = replay.load_loads(path)
        X, M, L, S, E = lf.loads_XMLSE.shape
        shape = (L, E, lf.top_k)
        counts_LE = lf.loads_XMLSE.to(torch.float64).sum(dim=(0, 1, 3))
        tokens = float(counts_LE[0].sum()) / lf.top_k
    else:
        raise ValueError(f"--routing {path!r} has format {fmt!r}; allowed: {replay.ROUTING_FORMAT!r} or "
                         f"{replay.LOADS_FORMAT!r}")
    if shape != (num_layers, num_experts, top_k):
        sets = [f"--set model.{field}={got}" for field, got, want in zip(
            ("num_moe_layers", "num_experts", "top_k"), shape, (num_layers, num_experts, top_k)) if got != want]
        if shape[0] != num_layers:  # keep the model's dense layers
            sets.append(f"--set model.num_layers={shape[0] + dense_layers}")
        raise ValueError(f"--routing {path!r} has (layers, experts, top_k) = {shape} but the model has "
                         f"{(num_layers, num_experts, top_k)}; pass the matching --model or --model-config, "
                         f"or {' '.join(sets)} (keeps the model's other dims)")
    if tokens <= 0:
        raise ValueError(f"--routing {path!r} holds no tokens")
    return (counts_LE / tokens).clamp(max=1.0)


def static_placement(num_layers: int, num_experts: int, num_gpus: int) -> torch.Tensor:
    """int64 ``[L, G, ceil(E/G)]``: contiguous expert blocks per GPU (the engines' default EP
    layout). When ``G`` does not divide ``E`` the first ``E % G`` GPUs hold one expert more
    and the others' last slot is empty (``-1``)."""
    check_int("num_gpus", num_gpus, minimum=1)
    if num_gpus > num_experts:
        raise ValueError(f"{num_gpus} expert GPUs for {num_experts} experts; allowed: at most one GPU per expert")
    J, extra = -(-num_experts // num_gpus), num_experts % num_gpus
    slots_GJ = torch.full((num_gpus, J), -1, dtype=torch.int64)
    start = 0
    for g in range(num_gpus):
        n = num_experts // num_gpus + (1 if g < extra else 0)
        slots_GJ[g, :n] = torch.arange(start, start + n)
        start += n
    return slots_GJ.unsqueeze(0).expand(num_layers, -1, -1).clone()


def replicated_placement(recent_LE: torch.Tensor, num_gpus: int, replica_slots: int) -> torch.Tensor:
    """int64 ``[L, G, J]``, ``J = ceil(E / G) + replica_slots``: EPLB's global policy planned
    from a recent routing window ``recent_LE`` (float ``[L, E]``, load per expert).

    The ``G * J`` physical experts are every expert once plus ``G * J - E`` copies, each given
    to the expert with the most load per copy, then packed ``J`` per GPU, heaviest first to
    the lightest GPU. Any ``G <= E`` works: where ``G`` does not divide ``E`` the slots that
    :func:`static_placement` leaves empty hold copies too. Where it divides, this is
    :func:`relibra_torch.planning.eplb.eplb_slots` on one node (tested).
    """
    L, E = recent_LE.shape
    check_int("num_gpus", num_gpus, minimum=1, maximum=E)
    check_int("replica_slots", replica_slots, minimum=0)
    J = -(-E // num_gpus) + replica_slots
    weight_LE = recent_LE.to(torch.float64)
    phy2log_LP, count_LE = replicate_experts(weight_LE, num_gpus * J)
    pack_LP, rank_LP = balanced_packing((weight_LE / count_LE).gather(1, phy2log_LP), num_gpus)
    slots_LP = torch.empty_like(phy2log_LP).scatter_(1, pack_LP * J + rank_LP, phy2log_LP)
    return slots_LP.view(L, num_gpus, J)


@dataclass(frozen=True)
class TileTable:
    """Per-GPU grouped-GEMM work of one EP group on a grid of batch sizes.

    Attributes:
        tokens_T: int64 grid of tokens per batch (all GPUs of the group together).
        max_tiles_T: float64 row tiles of the most loaded GPU (mean over layers).
        max_active_T: float64 experts with rows on the most loaded GPU (weights it reads).
        slots_per_gpu: expert weight copies each GPU holds.
        tiles_TL, active_TL: the same per layer (``[T, L]``), for per-layer rules.
    """

    tokens_T: np.ndarray
    max_tiles_T: np.ndarray
    max_active_T: np.ndarray
    slots_per_gpu: int
    tiles_TL: np.ndarray | None = None
    active_TL: np.ndarray | None = None

    def __post_init__(self) -> None:
        # plain-Python copies: the engine looks these up once per iteration
        object.__setattr__(self, "_log_t", np.log(self.tokens_T).tolist())
        object.__setattr__(self, "_tiles", self.max_tiles_T.tolist())
        object.__setattr__(self, "_active", self.max_active_T.tolist())

    def _at(self, values: list, tokens: float) -> float:
        """Linear interpolation in log tokens (clamped at the grid's ends)."""
        if tokens <= 0:
            return 0.0
        x, xs = math.log(tokens), self._log_t
        if x <= xs[0]:
            return values[0] * tokens / self.tokens_T[0]
        i = bisect.bisect_right(xs, x) - 1
        if i >= len(xs) - 1:
            return values[-1]
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        return values[i] + w * (values[i + 1] - values[i])

    def tiles(self, tokens: float) -> float:
        return self._at(self._tiles, tokens)

    def per_layer(self, tokens: float) -> tuple[np.ndarray, np.ndarray]:
        """``([L], [L])`` row tiles and active experts of the most loaded GPU, per layer."""
        if tokens <= 0:
            z = np.zeros(self.tiles_TL.shape[1])
            return z, z
        x, xs = math.log(tokens), self._log_t
        if x <= xs[0]:
            f = tokens / self.tokens_T[0]
            return self.tiles_TL[0] * f, self.active_TL[0] * f
        i = bisect.bisect_right(xs, x) - 1
        if i >= len(xs) - 1:
            return self.tiles_TL[-1], self.active_TL[-1]
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        return (self.tiles_TL[i] + w * (self.tiles_TL[i + 1] - self.tiles_TL[i]),
                self.active_TL[i] + w * (self.active_TL[i + 1] - self.active_TL[i]))

    def active(self, tokens: float) -> float:
        return self._at(self._active, tokens)


def build_tile_table(pi_LE: torch.Tensor, slots_LGJ: torch.Tensor, tile_m: int, seed: int = 0) -> TileTable:
    """Draw routed rows on the grid and measure the slowest GPU's tiles and active experts.

    Args:
        pi_LE: float64 ``[L, E]`` inclusion probabilities.
        slots_LGJ: int64 ``[L, G, J]`` logical expert in every slot (every expert at least
            once; ``-1``: an empty slot).
        tile_m: tile height ``M_t``.
        seed: the draw's seed (the table is deterministic for a seed).
    """
    L, G, J = slots_LGJ.shape
    E = pi_LE.shape[1]
    # an empty slot (-1) points at an extra expert column E that never gets a row
    slots_LGJ = torch.where(slots_LGJ < 0, torch.full_like(slots_LGJ, E), slots_LGJ)
    copies_LE = torch.zeros(L, E + 1, dtype=torch.int64).scatter_add_(
        1, slots_LGJ.reshape(L, -1), torch.ones(L, G * J, dtype=torch.int64))[:, :E]
    if int(copies_LE.min()) < 1:
        raise ValueError("the placement leaves an expert without a copy; every expert needs a slot")
    g = torch.Generator().manual_seed(seed)
    prob = pi_LE.to(torch.float64).clamp(0.0, 1.0)
    tiles, active = [], []
    for T in T_GRID.tolist():
        rows_LE = torch.binomial(torch.full_like(prob, float(T)), prob, generator=g).to(torch.int64)
        # a replicated expert's rows split evenly over its copies, each priced at the rounded-up
        # share (what the first copies take when the rows do not divide: a bound, never under)
        per_copy_LE = torch.div(rows_LE + copies_LE - 1, copies_LE, rounding_mode="floor")
        per_copy_LE = torch.cat([per_copy_LE, torch.zeros(L, 1, dtype=torch.int64)], dim=1)
        rows_LGJ = per_copy_LE.gather(1, slots_LGJ.reshape(L, -1)).view(L, G, J)
        tiles_LG = tile_footprint(rows_LGJ, tile_m)
        active_LG = (rows_LGJ > 0).sum(-1)
        # (numpy: torch's int64 max over a short dim is oddly slow on CPU)
        tiles.append(tiles_LG.numpy().max(axis=1).astype(np.float64))
        active.append(active_LG.numpy().max(axis=1).astype(np.float64))
    tiles_TL, active_TL = np.stack(tiles), np.stack(active)
    return TileTable(T_GRID.copy(), tiles_TL.mean(1), active_TL.mean(1), J, tiles_TL, active_TL)
