"""Packing inputs and outputs: prices, options, the plan, and the node placement the objective assumes.

Legend: see :mod:`relibra_torch.planning.packing`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...checks import check_choice, check_int, check_number, check_tensor
from ..eplb import balanced_packing

PACKING_METHODS = ("fixed", "length", "routepack")

INT_DTYPES = (torch.int16, torch.int32, torch.int64, torch.uint8, torch.int8)


@dataclass(frozen=True)
class PackingCosts:
    """Seconds per unit of work (forward + backward), as plain numbers.

    Attributes:
        num_moe_layers / num_dense_layers: layers of each kind.
        moe_layer_s_per_token: one MoE layer's attention projections, router and shared
            experts per token of a rank.
        dense_layer_s_per_token: one dense layer's attention projections and FFN per token.
        s_per_attention_pair: one layer's causal score and value products per (query, key)
            pair.
        head_s_per_token: the LM head per token.
        compute_s_per_token: expert compute per token-expert pair on one GPU.
        cross_node_s_per_token / intra_node_s_per_token: all four all-to-all passes of one
            token-expert pair over one GPU's inter-node / NVLink link.
    """

    num_moe_layers: int
    moe_layer_s_per_token: float
    s_per_attention_pair: float
    num_dense_layers: int = 0
    dense_layer_s_per_token: float = 0.0
    head_s_per_token: float = 0.0
    compute_s_per_token: float = 0.0
    cross_node_s_per_token: float = 0.0
    intra_node_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        check_int("num_moe_layers", self.num_moe_layers, 1)
        check_int("num_dense_layers", self.num_dense_layers, 0)
        for name in ("moe_layer_s_per_token", "s_per_attention_pair", "dense_layer_s_per_token",
                     "head_s_per_token", "compute_s_per_token", "cross_node_s_per_token",
                     "intra_node_s_per_token"):
            check_number(name, getattr(self, name), 0.0)


@dataclass(frozen=True)
class PackingConfig:
    """How to pack one step.

    Attributes:
        num_ranks: data-parallel ranks ``S`` (= EP ranks, node-major).
        num_micro_batches: micro-batches per rank ``M`` (every rank gets exactly ``M``, none
            empty).
        max_tokens: token cap of one rank's micro-batch; a sample longer than it gets a
            micro-batch of its own.
        gpus_per_node: ranks per node (rank ``s`` is on node ``s // gpus_per_node``).
        method: ``fixed`` (the given start, repaired if needed), ``length`` (longest-first
            greedy), ``routepack`` (search from the better of both).
        seed: seed of the search's random stream.
        max_proposals: moves / swaps the search tries (the deterministic stopping rule).
        time_budget_s: optional wall-clock cap on the search (``None``: none).
        temperature: annealing start temperature, as a fraction of the mean micro-batch cost;
            it falls linearly to 0.
    """

    num_ranks: int
    num_micro_batches: int
    max_tokens: int
    gpus_per_node: int = 1
    method: str = "routepack"
    seed: int = 0
    max_proposals: int = 12_000
    time_budget_s: float | None = None
    temperature: float = 1e-3

    def __post_init__(self) -> None:
        check_int("num_ranks", self.num_ranks, 1)
        check_int("num_micro_batches", self.num_micro_batches, 1)
        check_int("max_tokens", self.max_tokens, 1)
        check_int("gpus_per_node", self.gpus_per_node, 1)
        if self.num_ranks % self.gpus_per_node:
            raise ValueError(f"num_ranks = {self.num_ranks} is not a multiple of gpus_per_node = "
                             f"{self.gpus_per_node}; allowed: whole nodes")
        check_choice("method", self.method, PACKING_METHODS)
        check_int("seed", self.seed, 0)
        check_int("max_proposals", self.max_proposals, 0)
        if self.time_budget_s is not None:
            check_number("time_budget_s", self.time_budget_s, 0.0)
        check_number("temperature", self.temperature, 0.0)


@dataclass
class PackingPlan:
    """Where every sample of a step goes.

    Attributes:
        rank_N / micro_batch_N: int64 ``[N]``.
        permutation_N: int64 ``[N]``: sample ids in (rank, micro-batch, original index)
            order; rank ``r``'s micro-batch ``m`` is ``permutation_N[bin_offsets[r * M + m]:
            bin_offsets[r * M + m + 1]]``.
        bin_offsets: int64 ``[S * M + 1]`` (bins rank-major).
        objective_s: the objective (seconds) of this packing.
        start_objectives_s: objective of each start (``fixed``, ``length``) that was
            evaluated; ``None`` for a fixed start that could not be made feasible, or a
            length start its greedy could not pack under a tight cap (routepack then starts
            from the fixed packing).
        method: the method that produced it; proposals / accepted: search counts.
    """

    rank_N: torch.Tensor
    micro_batch_N: torch.Tensor
    permutation_N: torch.Tensor
    bin_offsets: torch.Tensor
    objective_s: float
    start_objectives_s: dict = field(default_factory=dict)
    method: str = "routepack"
    proposals: int = 0
    accepted: int = 0

    @property
    def num_micro_batches(self) -> int:
        return (self.bin_offsets.numel() - 1) // self.num_ranks

    @property
    def num_ranks(self) -> int:
        return int(self.rank_N.max()) + 1  # every rank holds M non-empty micro-batches

    def micro_batches_of(self, rank: int) -> list[torch.Tensor]:
        """Sample ids of each of ``rank``'s micro-batches, in order (int64 tensors)."""
        check_int("rank", rank, 0, self.num_ranks - 1)
        M = self.num_micro_batches
        o = self.bin_offsets
        return [self.permutation_N[int(o[rank * M + m]):int(o[rank * M + m + 1])] for m in range(M)]


def aggregate_LE(counts_f_NLE: torch.Tensor, max_count: int) -> torch.Tensor:
    """float64 ``[L, E]``: float32 integer counts (each <= ``max_count``) summed over
    samples exactly: chunks small enough that every float32 partial sum stays below 2**24."""
    N, L, E = counts_f_NLE.shape
    chunk = max(1, (1 << 24) // max(1, max_count))
    out = torch.zeros(L, E, dtype=torch.float64)
    for i in range(0, N, chunk):
        out += counts_f_NLE[i:i + chunk].sum(0)
    return out


def balanced_node_placement(load_LE: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """int64 ``[L, E]`` node of every expert: heaviest expert first to the lightest node
    with room (``ceil(E / Q)`` experts per node), per layer, vectorised over layers
    (:func:`relibra_torch.planning.eplb.balanced_packing` with the nodes as packs).

    Args: load_LE: ``[L, E]`` aggregate demand of the step (any real dtype).
    """
    check_tensor("load_LE", load_LE, dim=2)
    Q = check_int("num_nodes", num_nodes, 1)
    return balanced_packing(load_LE.to(torch.float64), Q)[0]


