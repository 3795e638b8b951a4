"""Relays: tokens a GPU hands to another GPU of its node before the hierarchical exchange.

Legend (shape suffixes): M micro-batches, L MoE layers, B rows (micro-batch, layer), S source
ranks (= G), G GPUs (node-major), N nodes, g GPUs per node, T tokens, K top-k.

Under hierarchical dispatch (:mod:`relibra_torch.distributed.hierarchical`) every GPU sends
its own tokens' rows to the other nodes and the GPU with the same local index receives them,
so a node's inter-node rows sit on its GPUs in proportion to their tokens and routing. With
variable-length RL samples the ranks' token counts differ (1.19x max / mean per micro-batch on
the default trace), and the busiest GPU's NIC sets the exchange's time. A **relay** moves
some of a GPU's tokens (hidden vector, gates and destination slots, one NVLink row each) to
another GPU of its node, which exchanges them as its own and sends their combined output
back over NVLink: the node's inter-node rows spread over all of its NICs, sender and
receiver side alike, at the price of the NVLink rows and four more collectives per layer and
micro-batch (forward: the rows with their routes in one packed exchange, the returned
outputs; one each in backward).

Relays are planned ahead from the replayed counts (the plan's ``relay_MLGg``: tokens GPU
``r`` hands to the GPU of its node with local index ``p``), so every rank knows every size
without talking; which tokens go follows one rule (:func:`relay_token_index`), used by the
layer and by the simulator's exact count. The planner's rule (:func:`plan_relays`): per
node, the GPUs estimated to send more inter-node rows than the node's mean hand the excess,
converted to tokens at their own rows per token, to the GPUs below the mean, in local-index
order; kept per (micro-batch, layer) only where the all-to-all it prices, relay rows and
latency included, is faster (:func:`relibra_torch.planning.relay_choice.add_relays`).
"""

from __future__ import annotations

import torch

from .topology import Topology

__all__ = ["RELAY_COLLECTIVES", "check_relays", "exec_ranks", "plan_relays", "relay_rows",
           "relay_sizes", "relay_token_index", "relayed_counts"]

#: Collectives a relay adds to one layer's exchange per micro-batch: forward the rows with
#: their routes (one packed exchange) and the returned outputs; backward one each
#: (``distributed.relay``).
RELAY_COLLECTIVES = 4


def relay_token_index(num_tokens: int, relay_g: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx_k, peer_k)`` int64: the tokens a GPU relays, ``k = relay_g.sum()`` of its
    ``num_tokens`` evenly spaced (``i * T // k``: a sample of the micro-batch, not its last
    sequence), and the local index of the GPU each goes to (the first ``relay_g[0]`` to local
    GPU 0, and so on). Raises ``ValueError`` when ``k > num_tokens``."""
    relay_g = relay_g.to(torch.int64).cpu()
    k = int(relay_g.sum())
    if k > num_tokens:
        raise ValueError(f"the plan relays {k} tokens but the rank has {num_tokens}: the routing does not "
                         f"match the plan's counts")
    idx = torch.arange(k, dtype=torch.int64) * num_tokens // max(k, 1)
    peer = torch.repeat_interleave(torch.arange(relay_g.numel()), relay_g)
    return idx.to(device), peer.to(device)


def relay_sizes(relay_Gg: torch.Tensor, rank: int, gpus_per_node: int) -> tuple[list[int], list[int]]:
    """``(send, recv)``: rows ``rank`` sends to / receives from every EP rank in the relay
    all-to-all (zero outside its node), from the layer's ``relay_Gg`` ``[G, g]``."""
    g = gpus_per_node
    G = relay_Gg.shape[0]
    node = rank // g
    send, recv = [0] * G, [0] * G
    for p in range(g):
        send[node * g + p] = int(relay_Gg[rank, p])
        recv[node * g + p] = int(relay_Gg[node * g + p, rank % g])
    return send, recv


def exec_ranks(source_T: torch.Tensor, relay_Sg: torch.Tensor, gpus_per_node: int) -> torch.Tensor:
    """int64 ``[T]``: the rank that exchanges each token, from ``source_T`` (every source's
    tokens contiguous, in the layer's order) and one layer's relays ``[S, g]``."""
    out = source_T.clone()
    S = relay_Sg.shape[0]
    counts = torch.bincount(source_T, minlength=S)
    starts = counts.cumsum(0) - counts
    for s in relay_Sg.sum(1).nonzero().flatten().tolist():
        idx, peer = relay_token_index(int(counts[s]), relay_Sg[s])
        out[int(starts[s]) + idx] = (s // gpus_per_node) * gpus_per_node + peer
    return out


def plan_relays(cross_BSN: torch.Tensor, tokens_BS: torch.Tensor, gpus_per_node: int) -> torch.Tensor:
    """int64 ``[B, S, g]``: relays that bring every GPU of a node to about the node's mean
    inter-node rows (the module docstring's rule).

    Args:
        cross_BSN: float ``[B, S, N]`` (estimated) tokens of source ``s`` that need remote node ``n``.
        tokens_BS: int ``[B, S]`` tokens of each source (the most it can relay).
    """
    B, S, N = cross_BSN.shape
    g = gpus_per_node
    C = cross_BSN.to(torch.float64).sum(-1).view(B, S // g, g)
    mean = C.mean(-1, keepdim=True)
    exc, dfc = (C - mean).clamp(min=0), (mean - C).clamp(min=0)
    end_e, end_d = exc.cumsum(-1), dfc.cumsum(-1)
    # rows heavy GPU r hands to light GPU p: overlap of their intervals on the excess axis
    lo = torch.maximum((end_e - exc).unsqueeze(-1), (end_d - dfc).unsqueeze(-2))
    rows = (torch.minimum(end_e.unsqueeze(-1), end_d.unsqueeze(-2)) - lo).clamp(min=0)   # [B, N', r, p]
    per_token = C / tokens_BS.to(torch.float64).view(B, S // g, g).clamp(min=1)
    tok = torch.where(per_token.unsqueeze(-1) > 0, rows / per_token.clamp(min=1e-12).unsqueeze(-1),
                      torch.zeros_like(rows)).floor().to(torch.int64)
    tok = tok * (1 - torch.eye(g, dtype=torch.int64))
    return tok.view(B, S, g)


def relayed_counts(copies_BSG: torch.Tensor, cross_BSN: torch.Tensor, relay_BSg: torch.Tensor,
                   tokens_BS: torch.Tensor, gpus_per_node: int) -> tuple[torch.Tensor, ...]:
    """The count-level estimate with relays: ``(copies, cross, relay_send_BG, relay_recv_BG)``.

    A relayed token keeps its remote nodes and GPUs, so a share ``f = relay / T_s`` of source
    ``s``'s expected rows (``cross``) and (token, GPU) copies moves to the GPU it goes to
    (exact in expectation when the relayed tokens are a sample of ``s``'s: the rule spaces
    them evenly). Relay rows: one per token each way."""
    B, S, G = copies_BSG.shape
    g = gpus_per_node
    n = S // g
    f = relay_BSg.to(torch.float64) / tokens_BS.to(torch.float64).clamp(min=1).unsqueeze(-1)   # [B, S, g]
    W = f.view(B, n, g, g) + torch.diag_embed((1.0 - f.sum(-1)).view(B, n, g))                # [B, n, r, p]

    def move(x_BSX: torch.Tensor) -> torch.Tensor:  # rows of source r handed to p, per node block
        x = x_BSX.to(torch.float64).view(B, n, g, -1)
        return torch.einsum("bnrx,bnrp->bnpx", x, W).reshape(B, S, -1)

    send, recv = relay_rows(relay_BSg.to(torch.float64))
    return move(copies_BSG), move(cross_BSN), send, recv


def relay_rows(relay_BSg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send_BS, recv_BS)``: tokens each GPU hands to / takes from GPUs of its node (one
    NVLink row each way; combine returns as many)."""
    B, S, g = relay_BSg.shape
    return relay_BSg.sum(-1), relay_BSg.view(B, S // g, g, g).sum(2).reshape(B, S)


def check_relays(relay_MLGg: torch.Tensor | None, shape: tuple[int, int], topology: Topology) -> None:
    """Raise ``ValueError`` unless ``relay_MLGg`` is ``None`` or int64 ``[M, L, G, g]``,
    non-negative, with no relay to the GPU itself, and none on a one-node topology."""
    if relay_MLGg is None:
        return
    G, g = topology.num_gpus, topology.gpus_per_node
    want = (*shape, G, g)
    if relay_MLGg.dtype != torch.int64 or tuple(relay_MLGg.shape) != want:
        raise ValueError(f"relay_MLGg has shape {tuple(relay_MLGg.shape)} and dtype {relay_MLGg.dtype}, "
                         f"expected int64 {list(want)}")
    if (relay_MLGg < 0).any():
        raise ValueError("relay_MLGg has negative token counts")
    if relay_MLGg[..., torch.arange(G), torch.arange(G) % g].any():
        raise ValueError("relay_MLGg relays tokens from a GPU to itself")
    if topology.num_nodes == 1 and relay_MLGg.any():
        raise ValueError("relay_MLGg relays tokens on one node: relays spread inter-node rows and there are "
                         "none (the lower bound assumes no relays there); leave relay_MLGg None")
