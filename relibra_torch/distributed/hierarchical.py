"""Hierarchical token exchange (DeepEP's normal mode): one copy per (token, node), then per
(token, GPU).

Legend (shape suffixes): T tokens of this rank, K top-k, D model dim, G EP ranks
(node-major), N nodes, g GPUs per node, J slots per GPU, X = G * J slots, Ia stage-A rows
(token, node) this rank sends, Ir stage-A rows it receives, Ib stage-B rows it sends, Rb
stage-B rows it receives, P (token, k) pairs it computes.

Dispatch, on EP rank ``r`` (node ``n_r``, local index ``i_r``):

* **stage A (inter-node)**: every token goes to every node that holds one of its pairs'
  slots *once*, landing on the GPU of that node with the source's local index ``i_r``
  (its own node: itself, no copy). The row carries the token's hidden vector and, per
  ``k``, the gate and the slot inside that node (``-1`` when pair ``k`` goes elsewhere).
* **stage B (NVLink)**: the landing GPU forwards each row it holds once to every GPU of
  its node that holds one of the row's slots (itself: no copy). So a token of ``r`` bound
  for GPUs of its own node goes to each of them directly, once.
* the destination expands the row into its pairs (one expert row each); the engine groups
  and computes them as in flat mode.

Combine is the reverse. The destination sums the gated outputs of a row's pairs in fp32
(DeepEP leaves this to the caller before its combine), sends one row back to the landing
GPU, which sums the rows of every GPU it forwarded to, and sends one row back across; the
source sums the rows of its nodes. The partial sums travel in the tokens' dtype, as
DeepEP's combine does; every sum is accumulated in fp32.

**The unit.** Forward dispatch rows a GPU sends: ``cross_node_rows`` = one per (token,
remote node); ``intra_node_rows`` = one per (row it holds, other GPU of its node holding
one of its slots), i.e. one per (token, destination GPU) when the destination is not the
landing GPU. Combine sends the same rows back. ``relibra_torch.sim.dispatch`` counts the
same units from the same pair-to-slot rule (``planning.pair_slots``).

Sizes: the pair counts of the plan do not tell how many (token, node) rows there are, so
every rank all-gathers ``2 G`` counts first (DeepEP's notify step); then both stages run as
all-to-alls over the EP group, zero-size outside the stage's peers. Every collective is
reached by every rank in the same order (stages with ``N = 1`` or ``g = 1`` are skipped by
all ranks alike).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planning.topology import Topology
from .collectives import all_to_all_autograd, all_to_all_packed

__all__ = ["ExchangeCounts", "HierarchicalExchange", "exchange_rows", "flat_exchange_counts", "hierarchical_combine",
           "hierarchical_dispatch"]


@dataclass
class ExchangeCounts:
    """What one layer call's token exchange made this GPU send, receive and issue.

    Attributes:
        cross_node_rows / intra_node_rows: rows sent in the forward dispatch to GPUs of
            other nodes / to other GPUs of this node (flat: token-expert pairs;
            hierarchical: see the module docstring). Combine sends as many back.
        cross_node_recv_rows / intra_node_recv_rows: the same, received.
        collectives_forward / collectives_backward: collectives of the exchange (size
            exchange, dispatch, combine, relays) in forward and in the backward that follows it
            (fills and the plan check are not included).
        relay_rows / relay_recv_rows: tokens handed to / taken from GPUs of this node before
            the exchange (``distributed.relay``); combine hands as many back.
    """

    cross_node_rows: int = 0
    intra_node_rows: int = 0
    cross_node_recv_rows: int = 0
    intra_node_recv_rows: int = 0
    collectives_forward: int = 0
    collectives_backward: int = 0
    relay_rows: int = 0
    relay_recv_rows: int = 0

    def __add__(self, other: "ExchangeCounts") -> "ExchangeCounts":
        return ExchangeCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def exchanged(self, *outputs: torch.Tensor) -> None:
        """Count one exchange: a forward collective, and a backward one where any of its
        ``outputs`` carries a gradient."""
        self.collectives_forward += 1
        self.collectives_backward += int(any(o.requires_grad for o in outputs))


def flat_exchange_counts(topology: Topology, rank: int, send_sizes: list[int], recv_sizes: list[int],
                         backward: bool) -> ExchangeCounts:
    """:class:`ExchangeCounts` of a flat exchange (one row per pair, two all-to-alls)."""
    g = topology.gpus_per_node
    node = rank // g
    same = [h // g == node and h != rank for h in range(topology.num_gpus)]
    other = [h // g != node for h in range(topology.num_gpus)]
    pick = lambda sizes, mask: int(sum(s for s, m in zip(sizes, mask) if m))  # noqa: E731
    return ExchangeCounts(pick(send_sizes, other), pick(send_sizes, same), pick(recv_sizes, other),
                          pick(recv_sizes, same), 2, 2 if backward else 0)


@dataclass
class HierarchicalExchange:
    """The dispatched pairs of this rank and what combine needs to send them back.

    ``x_PD`` ``[P, D]`` pair rows (autograd), ``slot_P`` int64 local slot ``j`` of each,
    ``gate_P`` fp32 gate of each (autograd); the rest is combine's routing; ``counts`` the
    rows and collectives (combine's are included when it runs).
    """

    x_PD: torch.Tensor
    slot_P: torch.Tensor
    gate_P: torch.Tensor
    row_P: torch.Tensor
    num_rows_b: int
    item_b: torch.Tensor
    num_rows_a: int
    token_a: torch.Tensor
    num_tokens: int
    sizes_a: tuple[list[int], list[int]]
    sizes_b: tuple[list[int], list[int]]
    skip_a: bool
    skip_b: bool
    group: dist.ProcessGroup
    counts: ExchangeCounts

    def group_permutation(self, group_J: torch.Tensor) -> torch.Tensor:
        """int64 ``[P]``: pair order -> grouped order, from each slot's local group ``[J]``
        (native experts first, then fills; stable)."""
        return group_J.to(self.slot_P.device)[self.slot_P].argsort(stable=True)


def _exchange(t: torch.Tensor, send: list[int], recv: list[int], group, counts: ExchangeCounts) -> torch.Tensor:
    out = all_to_all_autograd(t, send, recv, group)
    counts.exchanged(out)
    return out


def exchange_rows(x_RD: torch.Tensor, gates_RK: torch.Tensor, code_RK: torch.Tensor, send: list[int], recv: list[int],
                  group, counts: ExchangeCounts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows with their routes in one exchange: gates fp32 (autograd), slot codes as int32
    (below ``2^31``: the route is ``8 K`` bytes, as DeepEP's top-k weights and indices)."""
    x_rD, gates_rK, code_rK = all_to_all_packed([x_RD, gates_RK.float(), code_RK.to(torch.int32)], send, recv, group)
    counts.exchanged(x_rD, gates_rK)
    return x_rD, gates_rK, code_rK.long()


def _fan_out(code_RK: torch.Tensor, gates_RK: torch.Tensor, width: int, pieces: int):
    """Rows x pieces: one entry per (row, piece) with a code in that piece, piece-major.

    ``code // width`` is a code's piece; returns ``(row_B, piece_B, code_BK, gates_BK)``
    with codes reduced to ``code % width`` (``-1``, gate 0 where pair ``k`` is elsewhere).
    """
    R, K = code_RK.shape
    piece_RK = torch.where(code_RK >= 0, code_RK // width, pieces)
    need = torch.zeros(R, pieces + 1, dtype=torch.bool, device=code_RK.device)
    need.scatter_(1, piece_RK, True)
    idx = need[:, :pieces].t().nonzero()
    piece_B, row_B = idx[:, 0], idx[:, 1]
    match = piece_RK.index_select(0, row_B) == piece_B.unsqueeze(1)
    code_BK = torch.where(match, code_RK.index_select(0, row_B) % width, -1)
    gates_BK = torch.where(match, gates_RK.index_select(0, row_B), torch.zeros((), dtype=gates_RK.dtype,
                                                                                 device=gates_RK.device))
    return row_B, piece_B, code_BK, gates_BK


def hierarchical_dispatch(x_TD: torch.Tensor, dest_TK: torch.Tensor, gates_TK: torch.Tensor,
                          topology: Topology, rank: int, group: dist.ProcessGroup,
                          counts: ExchangeCounts | None = None) -> HierarchicalExchange:
    """Send this rank's pairs to their slots in two stages (see the module docstring).

    Args:
        x_TD: this rank's tokens; gates_TK: their gates (fp32, autograd).
        dest_TK: int64 destination slot ``gpu * J + j`` of every pair, ``X`` for pads
            (``moe.schedule.assign_slots``).
        topology: the EP layout; rank: this EP rank; group: the EP process group.
        counts: the exchange's counts so far (a relay's), or ``None``.
    """
    G, g, N, J = topology.num_gpus, topology.gpus_per_node, topology.num_nodes, topology.slots_per_gpu
    T = dest_TK.shape[0]
    dev = x_TD.device
    counts = ExchangeCounts() if counts is None else counts
    pad = dest_TK >= G * J
    gpu_TK = torch.where(pad, G, dest_TK // J)

    # Notify: every rank's stage-A rows per rank and (token, GPU) copies per GPU.
    need_TG = torch.zeros(T, G + 1, dtype=torch.bool, device=dev).scatter_(1, gpu_TK, True)[:, :G]
    need_TN = need_TG.view(T, N, g).any(-1)
    land_N = torch.arange(N, device=dev) * g + rank % g
    rows_G = torch.zeros(G, dtype=torch.int64, device=dev).index_put_((land_N,), need_TN.sum(0))
    mine = torch.stack([rows_G, need_TG.sum(0)])
    gathered = [torch.empty_like(mine) for _ in range(G)]
    dist.all_gather(gathered, mine, group=group)
    counts.collectives_forward += 1
    all_SxG = torch.stack(gathered).cpu()
    rows_SG, copies_SG = all_SxG[:, 0], all_SxG[:, 1]
    node = rank // g
    peers = torch.arange(G)
    send_a, recv_a = rows_SG[rank].tolist(), rows_SG[:, rank].tolist()
    # Stage B: this rank forwards for every source of its local index; a local GPU l
    # forwards to it for every source of l's local index.
    same_local = (peers.view(G, 1) % g) == (peers.view(1, G) % g)  # [source, landing]
    in_node = (peers // g) == node
    send_b = torch.where(in_node, copies_SG[same_local[:, rank]].sum(0), 0).tolist()
    recv_b = torch.where(in_node, (copies_SG[:, rank].view(G, 1) * same_local).sum(0), 0).tolist()
    counts.cross_node_rows = int(sum(s for s, m in zip(send_a, ~in_node) if m))
    counts.cross_node_recv_rows = int(sum(s for s, m in zip(recv_a, ~in_node) if m))
    counts.intra_node_rows = int(sum(s for h, s in enumerate(send_b) if in_node[h] and h != rank))
    counts.intra_node_recv_rows = int(sum(s for h, s in enumerate(recv_b) if in_node[h] and h != rank))

    # Stage A: one row per (token, node), node-major (= landing-rank order), tokens in order.
    code_TK = torch.where(pad, -1, dest_TK)  # global slot; its node is code // (g * J)
    token_a, node_a, code_a, gates_a = _fan_out(code_TK, gates_TK, g * J, N)
    x_a = x_TD.index_select(0, token_a)
    skip_a = N == 1
    if skip_a:
        x_ra, gates_ra, code_ra = x_a, gates_a.float(), code_a
    else:
        x_ra, gates_ra, code_ra = exchange_rows(x_a, gates_a, code_a, send_a, recv_a, group, counts)

    # Stage B: one row per (held row, GPU of this node with a slot of it), GPU-major.
    item_b, _, code_b, gates_b = _fan_out(code_ra, gates_ra, J, g)
    if item_b.numel() != sum(send_b):
        raise RuntimeError(f"hierarchical dispatch on EP rank {rank}: {item_b.numel()} stage-B rows but the "
                           f"gathered counts say {sum(send_b)} (routing does not match the plan)")
    x_b = x_ra.index_select(0, item_b)
    skip_b = g == 1
    if skip_b:
        x_rb, gates_rb, code_rb = x_b, gates_b.float(), code_b
    else:
        x_rb, gates_rb, code_rb = exchange_rows(x_b, gates_b, code_b, send_b, recv_b, group, counts)

    # Expand the received rows into their pairs (row-major).
    row_P, k_P = (code_rb >= 0).nonzero().unbind(1)
    return HierarchicalExchange(
        x_PD=x_rb.index_select(0, row_P), slot_P=code_rb[row_P, k_P], gate_P=gates_rb[row_P, k_P],
        row_P=row_P, num_rows_b=x_rb.shape[0], item_b=item_b, num_rows_a=x_ra.shape[0], token_a=token_a,
        num_tokens=T, sizes_a=(send_a, recv_a), sizes_b=(send_b, recv_b), skip_a=skip_a, skip_b=skip_b,
        group=group, counts=counts)


def hierarchical_combine(y_PD: torch.Tensor, hx: HierarchicalExchange) -> torch.Tensor:
    """``[T, D]`` gated sum of every token's expert outputs, back through both stages.

    Args:
        y_PD: expert outputs of ``hx``'s pairs, in ``hx.x_PD``'s order.
    Returns:
        the combined rows in ``y_PD``'s dtype (sums accumulated in fp32).
    """
    dt, D, dev = y_PD.dtype, y_PD.shape[1], y_PD.device
    z_PD = y_PD.float() * hx.gate_P.unsqueeze(1)
    acc_b = torch.zeros(hx.num_rows_b, D, dtype=torch.float32, device=dev).index_add(0, hx.row_P, z_PD).to(dt)
    send_b, recv_b = hx.sizes_b
    back_b = acc_b if hx.skip_b else _exchange(acc_b, recv_b, send_b, hx.group, hx.counts)
    acc_a = torch.zeros(hx.num_rows_a, D, dtype=torch.float32, device=dev).index_add(
        0, hx.item_b, back_b.float()).to(dt)
    send_a, recv_a = hx.sizes_a
    back_a = acc_a if hx.skip_a else _exchange(acc_a, recv_a, send_a, hx.group, hx.counts)
    out = torch.zeros(hx.num_tokens, D, dtype=torch.float32, device=dev).index_add(0, hx.token_a, back_a.float())
    return out.to(dt)
