"""Relays on the layer: tokens handed to another GPU of the node before the hierarchical
exchange, and their outputs handed back after combine (``planning.relay`` plans them).

Legend (shape suffixes): T this rank's tokens, K top-k, D model dim, G EP ranks, g GPUs per
node, k tokens this rank relays, r tokens it takes, T' = T - k + r tokens it exchanges.

Every rank knows every size from the plan's ``relay_Gg`` ``[G, g]`` (tokens rank ``q`` hands
to the GPU of its node with local index ``p``), so the relay is one all-to-all over the EP
group with zero sizes outside each node (the rows with their routes: fp32 gates with
autograd and int32 destination slots, packed side by side), and one back after combine. Which tokens go follows
``planning.relay.relay_token_index`` (evenly spaced, in local-index order), the rule the
simulator counts with. The taking rank exchanges its own tokens first, then the ones it took
in source-rank order; a relayed token keeps the slots its source assigned (its quotas).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..planning.relay import relay_sizes, relay_token_index
from ..planning.topology import Topology
from .collectives import all_to_all_autograd
from .hierarchical import ExchangeCounts, exchange_rows

__all__ = ["RelayBack", "relay_combine", "relay_dispatch"]


@dataclass
class RelayBack:
    """What :func:`relay_combine` needs: ``keep_T`` (int64 tokens exchanged here, in order),
    ``sent_k`` (int64 tokens handed away, in send order), the sizes each way, the group."""

    keep_T: torch.Tensor
    sent_k: torch.Tensor
    sizes: tuple[list[int], list[int]]
    num_tokens: int
    group: dist.ProcessGroup


def relay_dispatch(x_TD: torch.Tensor, dest_TK: torch.Tensor, gates_TK: torch.Tensor, relay_Gg: torch.Tensor,
                   topology: Topology, rank: int, group: dist.ProcessGroup, counts: ExchangeCounts
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RelayBack]:
    """``(x_T'D, dest_T'K, gates_T'K, back)``: the tokens this rank exchanges after the relay.

    Args:
        x_TD, dest_TK, gates_TK: this rank's tokens, their destination slots (``X`` for pads)
            and gates (fp32, autograd).
        relay_Gg: int64 ``[G, g]`` the layer's relays; counts: rows and collectives are added.
    """
    T = dest_TK.shape[0]
    dev = x_TD.device
    send, recv = relay_sizes(relay_Gg, rank, topology.gpus_per_node)
    sent_k, _ = relay_token_index(T, relay_Gg[rank], dev)
    keep = torch.ones(T, dtype=torch.bool, device=dev)
    keep[sent_k] = False
    keep_T = keep.nonzero().flatten()
    x_r, gates_r, dest_r = exchange_rows(x_TD.index_select(0, sent_k), gates_TK.index_select(0, sent_k),
                                         dest_TK.index_select(0, sent_k), send, recv, group, counts)
    counts.relay_rows, counts.relay_recv_rows = sum(send), sum(recv)
    x_ex = torch.cat([x_TD.index_select(0, keep_T), x_r])
    gates_ex = torch.cat([gates_TK.index_select(0, keep_T).float(), gates_r])
    dest_ex = torch.cat([dest_TK.index_select(0, keep_T), dest_r])
    return x_ex, dest_ex, gates_ex, RelayBack(keep_T, sent_k, (send, recv), T, group)


def relay_combine(y_exD: torch.Tensor, back: RelayBack, counts: ExchangeCounts) -> torch.Tensor:
    """``[T, D]``: the combined outputs of this rank's own tokens, the relayed ones handed back."""
    n_keep = back.keep_T.numel()
    send, recv = back.sizes
    y_back = all_to_all_autograd(y_exD[n_keep:], recv, send, back.group)
    counts.exchanged(y_back)
    out = y_exD.new_zeros(back.num_tokens, y_exD.shape[1])
    return out.index_copy(0, back.keep_T, y_exD[:n_keep]).index_copy(0, back.sent_k, y_back)
