"""The step's overlap window from every layer's counts, bounded from below: what the guard
(:mod:`~relibra_torch.planning.worth`) lets a rank's share of searches use when a search is
free (its floor and schedules fit the share's part of the whole step's window).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, N nodes, g GPUs per
node, X rows (micro-batch, layer).
"""

from __future__ import annotations

import functools

import torch

from .price import exchange_latency_s, flat_rows, rows_seconds
from .topology import Topology

__all__ = ["StepWindow", "step_window_s"]


def step_window_s(loads_MLSE: torch.Tensor, topology: Topology, config, at_least: float = 0.0,
                  whole: bool = True) -> float:
    """A lower bound of the step's overlap window, static placement's forward pass
    (``sim.simulator.forward_s``): per (micro-batch, layer) a third of the expert compute at
    static's busiest GPU, half of the all-to-all (exact under flat dispatch; across nodes
    under hierarchical dispatch a lower bound of its rows, :func:`_hierarchical_floor_ML`;
    none on one node there) and half of the exchange's latency; per micro-batch the rest of
    the model's forward at the rank with the most tokens (``config.dense_fwd_s_per_token``,
    a token's pairs being ``top_k``). ``loads_MLSE``: the whole step's loads (every layer),
    which every EP rank reads from replay, so every rank and the whole-step plan get the same
    window. 0.0 where an upper bound of the window from each source's pairs alone (a GPU's
    rows at most its sources' tokens) is already below ``at_least``: then the passes over
    the pairs per GPU are skipped (a step that nothing makes free, most of all one where
    nothing pays). ``whole=False``: the looser bound the full search is admitted on, the MoE
    layers alone with the expert compute at the mean GPU load (``worth.Tiers.search_free``)."""
    return StepWindow(loads_MLSE, topology, config)(at_least, whole)


class StepWindow:
    """:func:`step_window_s` of one step, asked at several ``at_least`` and both bounds: each
    pass over the pairs (the sums the early outs need, static's busiest GPU, the all-to-all's
    floor) runs at most once, when a call first needs it."""

    def __init__(self, loads_MLSE: torch.Tensor, topology: Topology, config) -> None:
        self.loads_MLSE, self.topology, self.config = loads_MLSE, topology, config
        M, L = loads_MLSE.shape[:2]
        self.latency = 0.5 * exchange_latency_s(topology, config) * M * L
        self.hier = config.dispatch == "hierarchical" and config.top_k > 0   # an unknown top-k is priced flat

    def __call__(self, at_least: float = 0.0, whole: bool = True) -> float:
        M, L, S, E = self.loads_MLSE.shape
        G, config = self.topology.num_gpus, self.config
        total = self._total
        dense = self._dense if whole else 0.0
        per_gpu = min(config.top_k, E // G) / config.top_k if config.top_k > 0 else 1.0   # a token's pairs on one GPU
        if (total * per_gpu * config.compute_s_per_token / 3 + self.latency + dense
                + 0.5 * total * (config.cross_node_s_per_token + config.intra_node_s_per_token)) < at_least:
            return 0.0
        compute = (self._busiest if whole else self._mean) * config.compute_s_per_token / 3 + dense
        if self.hier and self.topology.num_nodes == 1:
            return compute + self.latency
        if compute + 0.5 * self._a2a_upper + self.latency < at_least:
            return 0.0
        return compute + 0.5 * self._a2a_floor + self.latency

    @functools.cached_property
    def _pairs_MLS(self) -> torch.Tensor:
        return self.loads_MLSE.sum(-1, dtype=torch.int64)   # the one pass over the pairs the early outs need

    @functools.cached_property
    def _total(self) -> float:
        return float(self._pairs_MLS.sum())   # every term at most the step's pairs: one sum decides small steps

    @functools.cached_property
    def _dense(self) -> float:
        """At least a rank's pairs over top-k tokens; the busiest rank's, as every layer waits for it."""
        top_k, L = self.config.top_k, self.loads_MLSE.shape[1]
        return (float((self._pairs_MLS[:, 0] // top_k).amax(-1).sum()) * self.config.dense_fwd_s_per_token
                if top_k > 0 and L else 0.0)

    @functools.cached_property
    def _mean(self) -> float:
        G = self.topology.num_gpus
        return float(((self._pairs_MLS.sum(-1) + G - 1) // G).sum())

    @functools.cached_property
    def _busiest(self) -> float:
        """Static holds each GPU's experts contiguously: its busiest GPU is a maximum over a view."""
        M, L, S, E = self.loads_MLSE.shape
        G = self.topology.num_gpus
        return float(self.loads_MLSE.sum(2, dtype=torch.int64).view(M, L, G, E // G).sum(-1).amax(-1).sum())

    @functools.cached_property
    def _a2a_upper(self) -> float:
        """An upper bound of the all-to-all from the sources' pairs alone (a GPU's rows at most
        its sources' tokens): below ``at_least``, the floor's pass over the pairs is skipped."""
        M, L, S, E = self.loads_MLSE.shape
        topology, config, hier = self.topology, self.config, self.hier
        G, g = topology.num_gpus, topology.gpus_per_node
        # rows one source can send to one GPU (or, hierarchical, per remote node): its pairs (tokens)
        rows_XS = (self._pairs_MLS // max(config.top_k, 1) if hier else self._pairs_MLS).reshape(M * L, S).to(
            torch.float64)
        node_S, local_S = torch.arange(S) // g, torch.arange(S) % g
        remote_SG = node_S.view(S, 1) != node_S.view(1, G)
        into_SG = (local_S.view(S, 1) != local_S.view(1, G)) if hier else (~remote_SG & ~torch.eye(S, dtype=torch.bool))
        cross_XG = torch.maximum(rows_XS * (topology.num_nodes - 1 if hier else 1.0),
                                 rows_XS @ (remote_SG & (~into_SG if hier else remote_SG)).double())
        return float((cross_XG * config.cross_node_s_per_token
                      + torch.maximum(rows_XS, rows_XS @ into_SG.double()) * config.intra_node_s_per_token)
                     .amax(-1).sum())

    @functools.cached_property
    def _a2a_floor(self) -> float:
        M, L, S, E = self.loads_MLSE.shape
        if not self.hier:   # static placement: a GPU's experts are contiguous, its pairs a sum over a view
            G = self.topology.num_gpus
            flow_XSG = self.loads_MLSE.to(torch.int64).reshape(M * L, S, G, E // G).sum(-1)
            return float(rows_seconds(*flat_rows(flow_XSG, self.topology), self.config)[0].sum())
        return float(_hierarchical_floor_ML(self.loads_MLSE, self.topology, self.config).sum())


def _hierarchical_floor_ML(loads_MLSE: torch.Tensor, topology: Topology, config) -> torch.Tensor:
    """float64 ``[M, L]``: a lower bound of static placement's hierarchical all-to-all, as
    :mod:`~relibra_torch.planning.price` prices it (count-level) and as the simulator counts
    it from per-token routing (``hier_estimate.hierarchical_traffic``'s rows, each GPU at
    ``max(send, receive)`` across nodes plus over NVLink, the slowest GPU's time).

    A source's tokens with a pair on a node (or a GPU) are at least its pairs to the busiest
    one expert there: a token picks an expert once, and the count-level estimate keeps that
    bound (``hier_estimate._need``: at least the most-chosen expert's share). Per GPU it
    counts the inter-node rows it sends and those it receives as a landing GPU (one per
    (token, remote node)), and the NVLink rows it receives, from its node's other GPUs and
    forwarded by its node's landing GPUs (every source whose local index differs from its
    own); it leaves out the NVLink rows it sends. Static placement holds a node's and a GPU's
    experts contiguously, so their busiest expert is a maximum over a view."""
    M, L, S, E = loads_MLSE.shape
    N, g, G = topology.num_nodes, topology.gpus_per_node, topology.num_gpus
    X = M * L
    busiest_XSG = loads_MLSE.reshape(X, S, G, E // G).amax(-1).to(torch.int64)   # sums below: no narrow overflow
    busiest_XSN = busiest_XSG.view(X, S, N, g).amax(-1)
    busiest_XSN.masked_fill_(torch.nn.functional.one_hot(torch.arange(S) // g, N).bool().unsqueeze(0), 0)
    send_XG = busiest_XSN.sum(-1)                                              # sources are GPUs
    land_XG = busiest_XSN.view(X, N, g, N).sum(1).transpose(1, 2).reshape(X, G)  # landing GPU (n, i)
    # NVLink rows into GPU q: from every source but those of q's local index (q itself, and
    # the remote ones that land on q): all sources less the (source node, q) diagonal
    same_XNG = busiest_XSG.view(X, N, g, N, g).diagonal(dim1=2, dim2=4).sum(1)   # [X, N, g]
    nvlink_XG = busiest_XSG.sum(1) - same_XNG.reshape(X, G)
    gpu_XG = (torch.maximum(send_XG, land_XG).to(torch.float64) * config.cross_node_s_per_token
              + nvlink_XG.to(torch.float64) * config.intra_node_s_per_token)
    return gpu_XG.amax(-1).view(M, L)
