"""relibra's own price of a plan: the simulator's step cost, in its units, as far as a
planner can know it.

The terms are :class:`relibra_torch.sim.cost.CostModel`'s (which the planner may not
import) with the weights of :class:`~relibra_torch.planning.relibra.ReLibraConfig` (the
simulator builds them with ``CostModel.reorder_weights()``, so the per-unit prices are the
cost model's). Per (micro-batch, layer):

* expert compute: ``compute_s_per_token`` x the busiest GPU's tokens (fwd + bwd);
* all-to-all: ``max_G(cross_node_s_per_token * max(cross_send, cross_recv) +
  intra_node_s_per_token * max(intra_send, intra_recv))`` (dispatch + combine, fwd + bwd),
  tokens routed by :func:`~relibra_torch.planning.plan.token_split` as the layer routes
  them. Under hierarchical dispatch the rows are the simulator's count-level estimate
  (:mod:`relibra_torch.planning.hier_estimate`, the same functions), so on count-only
  loads the price is the simulator's; with per-token routing the simulator counts exact
  rows and the price is an estimate;
* replica fills and gradient returns per residency (:mod:`relibra_torch.planning.residency`,
  the one definition): the weights (``fill_weight_share`` of a fill's price) in the forward
  of the residency's first micro-batch with tokens, the fp32 gradient (the rest) in the
  backward of its last; per GPU ``max(sent, received)`` per link (an owner feeding three
  replicas sends three copies), the slowest GPU sets the time, forward and backward apart;
  a second hop of a two-hop replica (:func:`~relibra_torch.planning.two_hop.hop_routes`)
  fills from and returns into its hub's GPU over NVLink, in an exchange of its own after
  (fills) or before (returns) the first hops where its hub fills or returns in the same
  micro-batch, else within theirs;
* collective latency: the layer's token exchange and plan check, plus one collective where
  a residency starts and one where one ends, and one per sequential second-hop exchange
  (``inter_node_latency_s`` per collective with
  several nodes, ``nvlink_latency_s`` on one);
* migration, once per step: :func:`migration_seconds` (all layers at once, the cost
  model's rule) or :func:`migration_seconds_L` (each layer as if it moved alone: their sum
  bounds the joint move from above).

:func:`step_seconds` adds them up: the cost model's step time minus attention and dense
layers (the same for every plan) and host planning. Not priced: ``--overlap-replication``
(the planner prices fills fully: it can then only copy less than pays) and
``--refetch-replicas``.

Legend: M micro-batches, L layers (or stacked rows of layers), S source ranks, E experts,
N nodes, G GPUs, g GPUs per node, J slots per GPU, El native experts per GPU, K top-k.
"""

from __future__ import annotations

import numpy as np
import torch

from .hier_estimate import approx_need_batched, hierarchical_traffic
from .plan import StepPlan, token_split
from .residency import residencies, residency_masks_numpy
from .topology import Topology
from .two_hop import hop_routes, two_hop_hubs

__all__ = ["a2a_parts_ML", "a2a_seconds_ML", "collective_latency_s", "compute_seconds_ML", "exchange_collectives",
           "exchange_latency_s", "flat_rows", "hierarchical_collectives", "hierarchical_estimate", "split_chunks", "migration_seconds", "migration_seconds_L", "moe_parts_ML", "moe_seconds_ML",
           "moves_seconds", "replica_seconds_ML", "rows_seconds", "step_seconds", "transfer_seconds", "window_seconds"]


def collective_latency_s(topo: Topology, config) -> float:
    """Seconds of one collective's fixed latency (0 on one GPU: none is issued)."""
    if topo.num_gpus == 1:
        return 0.0
    return config.inter_node_latency_s if topo.num_nodes > 1 else config.nvlink_latency_s


def exchange_collectives(num_nodes: int, gpus_per_node: int, dispatch: str) -> int:
    """Collectives of one layer's token exchange per micro-batch, forward + backward (0 on
    one GPU): flat, dispatch and combine each way; hierarchical, :func:`hierarchical_collectives`.
    The one count the planner's prices and the simulator (``sim.transfers``) both use."""
    if num_nodes * gpus_per_node == 1:
        return 0
    return hierarchical_collectives(num_nodes, gpus_per_node) if dispatch == "hierarchical" else 4


def hierarchical_collectives(num_nodes: int, gpus_per_node: int) -> int:
    """Collectives of one layer's hierarchical exchange, forward + backward
    (``distributed.hierarchical``): the size all-gather, the inter-node stage (rows with their
    routes, one packed exchange) unless one node, the NVLink stage unless one GPU per node, and
    combine's way back through the stages it used; every exchange but the all-gather has a
    backward."""
    stages = int(num_nodes > 1) + int(gpus_per_node > 1)      # dispatch: one exchange per stage
    return 1 + 2 * (2 * stages)                                # + combine, one per stage; x2: backward


def exchange_latency_s(topo: Topology, config) -> float:
    """Latency every plan's layer pays per micro-batch: its token exchange's collectives
    (:func:`exchange_collectives`) and the plan check."""
    exchange = exchange_collectives(topo.num_nodes, topo.gpus_per_node, config.dispatch)
    return (exchange + 1) * collective_latency_s(topo, config)


def compute_seconds_ML(slot_tokens_MLGJ: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: expert compute of the busiest GPU, forward + backward."""
    return slot_tokens_MLGJ.sum(-1).max(-1).values.to(torch.float64) * config.compute_s_per_token


def _hierarchical_counts(split_BLSGJ: torch.Tensor, slot_expert_BLGJ: torch.Tensor, tokens_BS: torch.Tensor,
                         top_k: int, topo: Topology) -> tuple[torch.Tensor, ...]:
    """The simulator's count-level hierarchical rows (``sim.dispatch.approx_cross_tokens``,
    ``approx_gpu_copies``, ``hierarchical_traffic``) of ``B`` micro-batches (``tokens_BS``:
    each one's tokens per source), ``[B L, G]`` each."""
    return hierarchical_traffic(*hierarchical_estimate(split_BLSGJ, slot_expert_BLGJ, tokens_BS, top_k, topo), topo)


def hierarchical_estimate(split_BLSGJ: torch.Tensor, slot_expert_BLGJ: torch.Tensor, tokens_BS: torch.Tensor,
                          top_k: int, topo: Topology) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(copies [B L, S, G], cross [B L, S, N])``: the count-level estimate of each
    source's (token, GPU) copies and (token, remote node) rows that :func:`_hierarchical_counts`
    turns into per-GPU rows.

    The node flow keeps, per row, only the (node, expert) columns some slot holds (at most
    ``g J`` per node of ``E``), in the simulator's column order: absent experts add zeros.
    Its width is each micro-batch's own (the widest of its layers): micro-batches of one
    width are estimated together (:func:`~relibra_torch.planning.hier_estimate.approx_need_batched`,
    the same floats as one micro-batch at a time)."""
    B, L, S, G, J = split_BLSGJ.shape
    N, g, E = topo.num_nodes, topo.gpus_per_node, topo.num_experts
    R, X = B * L, G * J
    e_RX = slot_expert_BLGJ.reshape(R, X)
    valid_RX = e_RX >= 0
    node_X = torch.arange(X) // (J * g)
    # column of each slot: its expert's rank among the experts its node holds in that row
    used_RNE = torch.zeros(R, N * E + 1, dtype=torch.bool)  # the last column takes the empty slots
    used_RNE.scatter_(1, torch.where(valid_RX, node_X * E + e_RX, N * E), True)
    rank_RNE = used_RNE[:, :N * E].reshape(R, N, E).cumsum(-1) - 1
    width_B = (rank_RNE[..., -1].view(B, -1).amax(1) + 1).clamp(min=1)
    col_RX = rank_RNE.view(R, N * E).gather(1, (node_X * E + e_RX.clamp(min=0))).clamp(min=0)  # empty: adds 0
    vals_BLSX = (split_BLSGJ.reshape(R, S, X) * valid_RX.unsqueeze(1)).view(B, L, S, X)
    # per (micro-batch, l, s, slot): its place in a [K, L, S, N] block, the experts first
    at_BLSX = (col_RX.view(B, L, 1, X) * (L * S * N) + torch.arange(L).view(1, L, 1, 1) * (S * N)
               + torch.arange(S).view(1, 1, S, 1) * N + node_X.view(1, 1, 1, X))
    tokens_BS = tokens_BS.to(torch.int64)
    cross_BLSN = torch.empty(B, L, S, N, dtype=torch.float64)
    widths = width_B.unique().tolist()
    for width in widths:  # one flat scatter per width: [B', K, L, S, N]
        bs = (width_B == width).nonzero().squeeze(1)
        n = bs.numel()
        one = len(widths) == 1  # every micro-batch (no copies of the index)
        idx = (at_BLSX if one else at_BLSX[bs])
        if n > 1:
            idx = idx + torch.arange(n).view(n, 1, 1, 1) * (width * L * S * N)
        flow = torch.zeros(n * width * L * S * N, dtype=torch.int64)
        flow.scatter_add_(0, idx.reshape(-1), (vals_BLSX if one else vals_BLSX[bs]).reshape(-1))
        need = approx_need_batched(flow.view(n, width, L, S, N), tokens_BS if one else tokens_BS[bs], top_k)
        if one:
            cross_BLSN = need
        else:
            cross_BLSN[bs] = need
    own = torch.nn.functional.one_hot(torch.arange(G) // g, N).bool()
    cross = cross_BLSN.view(R, S, N).masked_fill(own.unsqueeze(0), 0.0)
    split_BJLSG = (split_BLSGJ * (slot_expert_BLGJ >= 0).unsqueeze(2)).movedim(-1, 1).contiguous()
    copies = approx_need_batched(split_BJLSG, tokens_BS, top_k).view(R, S, G)
    return copies, cross


def _splits(plan: StepPlan, loads_MLSE: torch.Tensor, m0: int, m1: int) -> torch.Tensor:
    """int64 ``[B, L, S, G, J]``: :func:`token_split` of micro-batches ``m0 .. m1 - 1``, each
    as alone (the rule is per (micro-batch, layer), with its shortcut for rows without a
    replica)."""
    return token_split(StepPlan(plan.topology, plan.placement_LE, plan.slot_expert_MLGJ[m0:m1],
                                plan.slot_tokens_MLGJ[m0:m1]), loads_MLSE[m0:m1])


# bound on one chunk's int64 [B, L, S, G, J] split (a few more of that size live): small, so
# that a chunk stays in cache (larger chunks ran slower on a 48-layer, 32-GPU step); at that
# size, one micro-batch at a time
_CHUNK_BYTES = 2 << 20


def a2a_parts_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[M, L]`` ``(all-to-all, its inter-node part)``: dispatch + combine, forward
    + backward, under ``config.dispatch``, and the slowest GPU's inter-node term alone (a
    lower bound of the first for any plan with the same inter-node rows: balancing copies,
    which stay in their node, leave them unchanged).

    Hierarchical dispatch needs ``config.top_k`` (a rank's tokens are its pairs // top_k,
    as the simulator counts them on loads files); unknown (0), the cross-node units stay
    pairs (flat's count, an upper bound on tokens).

    Micro-batches are priced a chunk at a time (``_CHUNK_BYTES`` bounds the split), each
    exactly as alone (``tests/test_price_batched.py``)."""
    topo = plan.topology
    M, L, S, _ = loads_MLSE.shape
    hier = config.dispatch == "hierarchical" and config.top_k > 0
    out = torch.empty(M, L, dtype=torch.float64)
    cross_out = torch.empty(M, L, dtype=torch.float64)
    for m0, m1, split_BLSGJ in split_chunks(plan, loads_MLSE):
        if hier:
            tokens_BS = loads_MLSE[m0:m1, 0].to(torch.int64).sum(-1) // config.top_k
            cs, cr, is_, ir = _hierarchical_counts(split_BLSGJ, plan.slot_expert_MLGJ[m0:m1], tokens_BS,
                                                   config.top_k, topo)
        else:
            cs, cr, is_, ir = flat_rows(split_BLSGJ.sum(-1).flatten(0, 1), topo)
        a2a, cross = rows_seconds(cs, cr, is_, ir, config)
        out[m0:m1], cross_out[m0:m1] = a2a.view(m1 - m0, L), cross.view(m1 - m0, L)
    return out, cross_out


def split_chunks(plan: StepPlan, loads_MLSE: torch.Tensor):
    """Yield ``(m0, m1, split_BLSGJ)``: the plan's token splits a chunk of micro-batches at a
    time (``_CHUNK_BYTES`` bounds each)."""
    M, L, S, _ = loads_MLSE.shape
    chunk = max(1, _CHUNK_BYTES // max(1, L * S * plan.topology.num_gpus * plan.topology.slots_per_gpu * 8))
    for m0 in range(0, M, chunk):
        m1 = min(M, m0 + chunk)
        yield m0, m1, _splits(plan, loads_MLSE, m0, m1)


def flat_rows(split_XSG: torch.Tensor, topo: Topology) -> tuple[torch.Tensor, ...]:
    """Per-GPU ``(cross send, cross receive, intra send, intra receive)`` ``[X, G]`` of flat
    dispatch from the pairs each source sends to each GPU, ``split_XSG`` (any leading ``X``):
    a source's own GPU costs nothing, its node's other GPUs NVLink, the rest the inter-node link."""
    G, g = topo.num_gpus, topo.gpus_per_node
    node_G = torch.arange(G) // g
    same_node = node_G.view(G, 1) == node_G.view(1, G)
    cross, intra = split_XSG * ~same_node, split_XSG * (same_node & ~torch.eye(G, dtype=torch.bool))
    return cross.sum(-1), cross.sum(-2), intra.sum(-1), intra.sum(-2)


def rows_seconds(cs: torch.Tensor, cr: torch.Tensor, is_: torch.Tensor, ir: torch.Tensor,
                 config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(all-to-all, its inter-node part)`` ``[X]`` from per-GPU rows ``[X, G]``
    (:func:`flat_rows` or the hierarchical ones): per GPU ``max(send, receive)`` per link at its
    price, the slowest GPU's time."""
    cross_XG = torch.maximum(cs, cr).to(torch.float64) * config.cross_node_s_per_token
    return ((cross_XG + torch.maximum(is_, ir).to(torch.float64) * config.intra_node_s_per_token).max(-1).values,
            cross_XG.max(-1).values)


def a2a_seconds_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: the all-to-all of :func:`a2a_parts_ML`."""
    return a2a_parts_ML(plan, loads_MLSE, config)[0]


def moe_parts_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``[M, L]`` ``(moe, inter-node part)``: :func:`moe_seconds_ML` and the
    all-to-all's inter-node part alone (:func:`a2a_parts_ML`)."""
    a2a, cross = a2a_parts_ML(plan, loads_MLSE, config)
    return (compute_seconds_ML(plan.slot_tokens_MLGJ, config) + a2a + exchange_latency_s(plan.topology, config),
            cross)


def moe_seconds_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: expert compute + all-to-all + the exchange's latency (replicas
    and migration apart: they depend on neighbouring micro-batches and the step)."""
    return moe_parts_ML(plan, loads_MLSE, config)[0]


def transfer_seconds(mask_XGJ: torch.Tensor, cross_XGJ: torch.Tensor, src_XGJ: torch.Tensor,
                     cross_s: float, intra_s: float) -> torch.Tensor:
    """float64 ``[X]``: one copy per masked slot between the slot's GPU and ``src_XGJ`` (its
    expert's owner, or a second hop's hub: ``two_hop.hop_routes``; ``cross_XGJ``: over the
    inter-node link, ``cross_s`` per copy, else NVLink, ``intra_s``): per GPU
    ``max(received, sent)`` per link, the slowest GPU's time (the cost model's
    ``transfer_s``). Any leading shape ``X``."""
    *X, G, J = mask_XGJ.shape
    mask = mask_XGJ.reshape(-1, G, J)
    src = src_XGJ.reshape(-1, G * J).clamp(min=0)
    per_gpu = torch.zeros(mask.shape[0], G, dtype=torch.float64)
    for link, price in ((cross_XGJ.reshape(-1, G, J), cross_s), (~cross_XGJ.reshape(-1, G, J), intra_s)):
        here = (mask & link).to(torch.int64)
        sent = torch.zeros(mask.shape[0], G, dtype=torch.int64).scatter_add_(1, src, here.reshape(-1, G * J))
        per_gpu += torch.maximum(here.sum(-1), sent).to(torch.float64) * price
    return per_gpu.max(-1).values.view(X)


def _hop_seconds(event: torch.Tensor, seq: torch.Tensor, src: torch.Tensor, cross_link: torch.Tensor,
                 cross_s: float, intra_s: float, lat: float) -> torch.Tensor:
    """float64 ``[...]`` of slots ``[..., G, J]``: the exchange of the ``event`` slots (fills
    or returns) that ride together, then the second hops ``seq`` that wait for their hubs
    (NVLink, an exchange of their own: times and latencies add, as ``CostModel.replica_s``)."""
    first = event & ~seq
    none = torch.zeros_like(cross_link)
    return (transfer_seconds(first, cross_link, src, cross_s, intra_s) + transfer_seconds(seq, none, src, cross_s, intra_s)
            + lat * (first.flatten(-2).any(-1).double() + seq.flatten(-2).any(-1).double()))


def _prices(config) -> tuple[float, float, float, float]:
    """``(fill cross, fill intra, return cross, return intra)`` seconds per copy."""
    w = config.fill_weight_share
    c, i = config.cross_replica_fill_s_per_expert, config.replica_fill_s_per_expert
    return c * w, i * w, c * (1.0 - w), i * (1.0 - w)


def _fill_masks(slot_expert: torch.Tensor, owner_gpu_LE: torch.Tensor, topo: Topology
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(fill, cross, owner)`` of slots ``[..., L, G, J]`` under ``owner_gpu_LE`` ``[L, E]``."""
    *lead, L, G, J = slot_expert.shape
    E = owner_gpu_LE.shape[1]
    owner = owner_gpu_LE.view(L, 1, E).expand(*lead, L, G, E).gather(-1, slot_expert.clamp(min=0))
    gpu = torch.arange(G).view(G, 1)
    fill = (slot_expert >= 0) & (owner != gpu)
    cross = fill & (owner // topo.gpus_per_node != gpu // topo.gpus_per_node)
    return fill, cross, owner


def replica_seconds_ML(plan: StepPlan, config) -> torch.Tensor:
    """float64 ``[M, L]``: the plan's replica fills (forward) + gradient returns (backward)
    + their collectives' latency, per residency (:func:`~relibra_torch.planning.residency.residencies`),
    second hops from and into their hubs (:func:`~relibra_torch.planning.two_hop.hop_routes`)."""
    direct = _direct_replica_seconds_ML(plan, config)
    if direct is not None:
        return direct
    res = residencies(plan)
    fc, fi, rc, ri = _prices(config)
    lat = collective_latency_s(plan.topology, config)
    src, cross_link, seq_fill, seq_ret = hop_routes(res.owner_MLGJ, res.cross_node_MLGJ, res.hubs(), res.held_MLGJ,
                                                    res.fill_start_MLGJ, res.grad_return_MLGJ)
    return (_hop_seconds(res.fill_start_MLGJ, seq_fill, src, cross_link, fc, fi, lat)
            + _hop_seconds(res.grad_return_MLGJ, seq_ret, src, cross_link, rc, ri, lat))


def _direct_replica_seconds_ML(plan: StepPlan, config) -> torch.Tensor | None:
    """:func:`replica_seconds_ML` in numpy where no slot holds another node's expert (one
    node, or no traffic replica): then no second hop (``two_hop_hubs`` needs two held
    cross-node copies), every transfer goes between the slot and its expert's owner, and this is the
    same integer counts and the same float64 operations, in the same order, as the torch
    path, at a fraction of its per-call cost on small steps; ``None`` otherwise."""
    topo = plan.topology
    se = plan.slot_expert_MLGJ.numpy()
    M, L, G, J = se.shape
    if M == 0:
        return None
    owner = plan.owner_gpu_LE().numpy()[np.arange(L).reshape(1, L, 1, 1), np.maximum(se, 0)]
    gpu = np.arange(G).reshape(G, 1)
    fill = (se >= 0) & (owner != gpu)
    cross = fill & (owner // topo.gpus_per_node != gpu // topo.gpus_per_node)
    if cross.any():   # checked before the residencies: on large steps with traffic replicas, little is lost
        return None
    start, ret = (x.reshape(M * L, G, J) for x in residency_masks_numpy(
        se.reshape(M, -1), fill.reshape(M, -1), plan.slot_tokens_MLGJ.numpy().reshape(M, -1))[:2])
    fc, fi, rc, ri = _prices(config)
    lat = collective_latency_s(topo, config)
    cross, at_XGJ = cross.reshape(M * L, G, J), (np.arange(M * L) * G).reshape(-1, 1, 1) + owner.reshape(M * L, G, J)

    def hop(event_XGJ: np.ndarray, cross_s: float, intra_s: float) -> np.ndarray:
        # _hop_seconds without second hops: transfer_seconds of the events, + 0.0 for the
        # empty sequential exchange, the latency where an event is
        per_gpu = np.zeros((M * L, G), dtype=np.float64)
        for link, price in ((cross, cross_s), (~cross, intra_s)):
            here = event_XGJ & link
            sent = np.bincount(at_XGJ[here], minlength=M * L * G).reshape(M * L, G)
            per_gpu += np.maximum(here.sum(-1), sent).astype(np.float64) * price
        return per_gpu.max(-1) + 0.0 + lat * (event_XGJ.reshape(M * L, -1).any(-1).astype(np.float64) + 0.0)

    return torch.from_numpy((hop(start, fc, fi) + hop(ret, rc, ri)).reshape(M, L))


def window_seconds(se_a: torch.Tensor, st_a: torch.Tensor, se_b: torch.Tensor, st_b: torch.Tensor,
                   owner_gpu_LE: torch.Tensor, topo: Topology, config) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica time decided by two consecutive micro-batches ``a, b`` (slots ``[..., L, G, J]``,
    ``-1`` everywhere for none: before the step's first or after its last): float64
    ``[..., L]`` ``(fills of b, returns of a)``, latency included.

    On candidates normalised so that every fill slot has tokens
    (:func:`relibra_torch.planning.choose.candidate_sets`) ``residency_masks`` starts a
    residency where a fill slot's expert differs from the micro-batch before and ends one
    where it differs from the one after. Second hops (``planning.two_hop``) are found by the
    hub rule on the two micro-batches alone, as if every residency held at ``a`` started
    there and every one held at ``b`` ended there: exact when no second hop's cover depends
    on micro-batches outside the window (one micro-batch, or no two cross-node copies of an
    expert on a node), so a step's replica time is then the sum of its windows'
    (``tests/test_relibra_choose.py``); otherwise an estimate (``chosen_plan`` compares
    whole-step alternatives at their exact price)."""
    fill_a, cross_a, owner_a = _fill_masks(se_a, owner_gpu_LE, topo)
    fill_b, cross_b, owner_b = _fill_masks(se_b, owner_gpu_LE, topo)
    kept = fill_a & fill_b & (se_a == se_b)
    start_b, ret_a = (fill_b & (st_b > 0)) & ~kept, (fill_a & (st_a > 0)) & ~kept
    fc, fi, rc, ri = _prices(config)
    lat = collective_latency_s(topo, config)
    *lead, L, G, J = se_a.shape
    stack = lambda a, b: torch.stack([a, b]).reshape(2, -1, G, J)  # noqa: E731  [2, X L, G, J]
    cross, owner = stack(cross_a, cross_b), stack(owner_a, owner_b)
    start = stack((fill_a & (st_a > 0)) | (kept & fill_a), start_b)
    ret = stack(ret_a, (fill_b & (st_b > 0)) | kept)
    held = stack(fill_a & (start[0].view_as(fill_a) | ret_a | kept), fill_b & (start_b | kept))
    hub = two_hop_hubs(stack(se_a, se_b), cross, held, start, ret, topo.gpus_per_node)
    src, cross_link, seq_fill, seq_ret = hop_routes(owner, cross, hub, held, start, ret)
    fills = _hop_seconds(start[1], seq_fill[1], src[1], cross_link[1], fc, fi, lat)
    returns = _hop_seconds(ret[0], seq_ret[0], src[0], cross_link[0], rc, ri, lat)
    return fills.view(*lead, L), returns.view(*lead, L)


def moves_seconds(counts_4XG: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[X]``: seconds of the moves counted per GPU (int ``[4, X, G]``, as
    :meth:`Topology.moves_per_gpu` counts them: across nodes sent, received, over NVLink sent,
    received) by the cost model's rule: per GPU the busier of sending and receiving on each
    link, the busiest GPU."""
    cs, cr, is_, ir = counts_4XG.to(torch.float64)
    return (torch.maximum(cs, cr) * config.migration_s_per_expert
            + torch.maximum(is_, ir) * config.intra_migration_s_per_expert).amax(-1)


def migration_seconds_L(placement_LE: torch.Tensor, previous_LE: torch.Tensor, topo: Topology,
                        config) -> torch.Tensor:
    """float64 ``[L]``: each layer's experts whose owner GPU changed, moved as if alone.
    The cost model moves all layers at once (one maximum over GPUs of the sums), so the sum
    of these bounds its time from above."""
    if topo.num_gpus == 0 or placement_LE.shape[0] == 0:
        return torch.zeros(placement_LE.shape[0], dtype=torch.float64)
    return moves_seconds(topo.moves_per_gpu(previous_LE, placement_LE), config)


def migration_seconds(placement_LE: torch.Tensor, previous_LE: torch.Tensor, topo: Topology, config) -> float:
    """Seconds to move every expert whose owner GPU changed, all layers at once (the cost
    model's rule)."""
    if placement_LE.shape[0] == 0:
        return 0.0
    return float(moves_seconds(topo.moves_per_gpu(previous_LE, placement_LE).sum(1), config))


def step_seconds(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> float:
    """The plan's priced step: expert compute, all-to-all, replicas and collective latency
    summed over micro-batches and layers, plus the migration from ``plan.previous_placement_LE``
    (none when ``None``). On count-only loads this is the cost model's ``step_s`` minus
    attention and dense layers (``tests/test_relibra_choose.py``)."""
    total = float((moe_seconds_ML(plan, loads_MLSE, config) + replica_seconds_ML(plan, config)).sum())
    if plan.previous_placement_LE is not None:
        total += migration_seconds(plan.placement_LE, plan.previous_placement_LE, plan.topology, config)
    return total
