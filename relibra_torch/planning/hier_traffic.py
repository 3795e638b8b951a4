"""Traffic replicas valued in hierarchical dispatch's rows, not in pairs.

Under hierarchical dispatch (DeepEP's normal mode) a token crosses to a remote node once,
however many of its experts sit there, so keeping one expert's pairs of node ``n`` at home
(a traffic replica on ``n``, :mod:`relibra_torch.planning.traffic`) saves only the tokens
for which that expert was the *last* reason to visit the owner's node. Valuing a replica by
its pairs (flat dispatch's unit) overstates it by about the token's other experts there
and ranks candidates by demand alone; this module values it by the rows it removes, with
the simulator's own count-level estimate of rows (:mod:`relibra_torch.planning.hier_estimate`,
shared with ``sim.dispatch``), so the planner optimises the quantity the cost model charges.

What the estimate is: per source rank ``s`` and remote node ``o``, the chance that a token
of ``s`` needs ``o`` is ``1 - min(P_indep, P_draws)`` clipped to ``[max_e p_e, sum_e p_e]``
(``p_e``: ``s``'s pairs of the node's experts over its tokens). ``P_indep`` treats the
source's experts as chosen independently per token, ``P_draws`` as ``K`` draws without
replacement from the source's marginal; both are functions of per-source counts, which
replay gives, and neither uses co-activation (count-only traces have none). With per-token
routing the simulator counts rows exactly and this is an estimate of them.

A node's replica of ``e`` moves its sources' pairs of ``e`` from ``e``'s owner node to the
source's own node (``token_split`` keeps local tokens first), so for each source only the
owner node's term changes: its mass ``Q`` and square sum drop by ``e``'s, its product loses
``e``'s factor, its clip bounds lose ``p_e``; every other node's ``rho`` is unchanged (the
sum of squares over all nodes is). :func:`rows_saved` evaluates that leave-one-out change
for every (source, expert) at once, exactly (``tests/test_hier_traffic.py`` checks it
against recomputing ``approx_need``); :func:`greedy_row_replicas` picks each node's traffic
set one replica at a time, each time the candidate that saves the most seconds net of its
fill, then re-evaluates (a replica's saving depends on which others the node already
serves locally).

Legend: M micro-batches, L layers (or M * L rows), S source ranks, E experts, N nodes,
g GPUs per node, B traffic slots per node.
"""

from __future__ import annotations

import torch

__all__ = ["node_rows", "rows_saved", "source_rows", "greedy_row_replicas", "greedy_nic_replicas", "link_objective", "set_rows_saved"]

_TINY = 1e-12


def _shares(loads_LSE: torch.Tensor, tokens_S: torch.Tensor, top_k: int):
    """``(p_LSE, T_LS)``: each (source, expert) pair count over the source's tokens, as
    ``hier_estimate.approx_need_columns`` forms it, and the tokens (float64; ``tokens_S``
    is ``[S]``, or ``[L, S]`` when the rows are (micro-batch, layer) pairs)."""
    L, S, _ = loads_LSE.shape
    T = tokens_S.to(torch.float64).expand(L, S) if tokens_S.dim() == 1 else tokens_S.to(torch.float64)
    T_div = torch.where(T > 0, T.clamp(min=1.0), torch.full_like(T, float("inf")))
    p = (loads_LSE.to(torch.float64) / T_div.unsqueeze(-1)).clamp_(0.0, 1.0)
    return p, T


def _piece_LSE(local_LNE: torch.Tensor, owner_node_LE: torch.Tensor, g: int) -> torch.Tensor:
    """int64 ``[L, S, E]``: the node each source's pairs of each expert go to (its own node
    where that node serves the expert locally, else the owner's)."""
    L, N, E = local_LNE.shape
    S = N * g
    node_S = torch.arange(S) // g
    local_LSE = local_LNE[:, node_S, :]
    return torch.where(local_LSE, node_S.view(1, S, 1).expand(L, S, E), owner_node_LE.view(L, 1, E).expand(L, S, E))


def _aggregates(p_LSE: torch.Tensor, piece_LSE: torch.Tensor, N: int, top_k: int) -> dict:
    """Per (source, node) sums the estimate needs: log-product of ``1 - p`` over ``p < 1``
    and the count of ``p == 1``, mass ``Q`` (unclipped), square sum of ``r = p / K``, the
    sum and the two largest ``p``."""
    L, S, E = p_LSE.shape
    r = p_LSE / top_k
    one = p_LSE >= 1.0
    logs = torch.where(one, 0.0, torch.log1p(-p_LSE.clamp(max=1.0 - 1e-300)))

    def add(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(L, S, N, dtype=torch.float64).scatter_add_(2, piece_LSE, x.to(torch.float64))

    by_piece = torch.zeros(L, S, N, E, dtype=torch.float64).scatter_(
        2, piece_LSE.unsqueeze(2), p_LSE.unsqueeze(2))
    top2 = by_piece.topk(min(2, E), dim=-1).values
    if top2.shape[-1] < 2:
        top2 = torch.cat([top2, torch.zeros_like(top2)], -1)
    return {"log": add(logs), "ones": add(one), "Q": add(r), "sq": add(r * r), "sum": add(p_LSE),
            "max1": top2[..., 0], "max2": top2[..., 1]}


def _need(log, ones, Q, sq, sq_total, pmax, psum, top_k: int) -> torch.Tensor:
    """The estimate's chance of needing a node (any matching shapes; ``hier_estimate``'s rule)."""
    none_indep = torch.where(ones > 0, 0.0, log.exp())
    mass = Q.clamp(max=1.0)
    rest = (1.0 - mass).clamp(min=_TINY)
    rho = ((sq_total - sq) / rest).clamp(min=0.0)
    none_draws = torch.ones_like(mass)
    for i in range(top_k):
        left = (1.0 - i * rho).clamp(min=_TINY)
        none_draws = none_draws * (1.0 - mass / left).clamp(0.0, 1.0)
    need = 1.0 - torch.minimum(none_indep, none_draws)
    return torch.minimum(torch.maximum(need, pmax), psum)


def node_rows(loads_LSE: torch.Tensor, tokens_S: torch.Tensor, owner_node_LE: torch.Tensor,
              local_LNE: torch.Tensor, top_k: int, g: int) -> torch.Tensor:
    """float64 ``[L, N]``: estimated cross-node rows node ``n``'s sources send (the
    ``(token, remote node)`` copies), when node ``n`` serves the experts of ``local_LNE``
    locally (their pairs stay home) and every other pair goes to its expert's owner node."""
    L, N, E = local_LNE.shape
    p, T = _shares(loads_LSE, tokens_S, top_k)
    piece = _piece_LSE(local_LNE, owner_node_LE, g)
    a = _aggregates(p, piece, N, top_k)
    sq_total = a["sq"].sum(-1, keepdim=True)
    need = _need(a["log"], a["ones"], a["Q"], a["sq"], sq_total, a["max1"], a["sum"], top_k) * T.unsqueeze(-1)
    own = torch.nn.functional.one_hot(torch.arange(N * g) // g, N).bool()
    return need.masked_fill(own.unsqueeze(0), 0.0).sum(-1).view(L, N, g).sum(-1)


def rows_saved(loads_LSE: torch.Tensor, tokens_S: torch.Tensor, owner_node_LE: torch.Tensor,
               local_LNE: torch.Tensor, top_k: int, g: int) -> torch.Tensor:
    """float64 ``[L, N, E]``: the estimated cross-node rows node ``n``'s sources stop
    sending (and the owner node's landing GPUs stop receiving) if node ``n`` also served
    expert ``e`` locally; 0 where ``e`` is already served there."""
    L, N, E = local_LNE.shape
    return source_rows(loads_LSE, tokens_S, owner_node_LE, local_LNE, top_k, g)[1].view(L, N, g, E).sum(2)


def source_rows(loads_LSE: torch.Tensor, tokens_S: torch.Tensor, owner_node_LE: torch.Tensor,
                local_LNE: torch.Tensor, top_k: int, g: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(need_LSN, saved_LSE)`` float64: estimated tokens of source ``s`` that cross to
    remote node ``n`` (0 for its own), and the rows source ``s`` stops sending to ``e``'s
    owner node if its own node also served ``e`` locally (0 where it already does)."""
    L, N, E = local_LNE.shape
    S = N * g
    p, T = _shares(loads_LSE, tokens_S, top_k)
    piece = _piece_LSE(local_LNE, owner_node_LE, g)
    a = _aggregates(p, piece, N, top_k)
    sq_total = a["sq"].sum(-1, keepdim=True)
    full = _need(a["log"], a["ones"], a["Q"], a["sq"], sq_total, a["max1"], a["sum"], top_k)   # [L, S, N]

    def at(x: torch.Tensor) -> torch.Tensor:  # each (s, e)'s value at e's piece
        return x.gather(2, piece)

    r = p / top_k
    one = p >= 1.0
    log_wo = torch.where(one, at(a["log"]), at(a["log"]) - torch.log1p(-p.clamp(max=1.0 - 1e-300)))
    ones_wo = at(a["ones"]) - one.to(torch.float64)
    max_wo = torch.where(p >= at(a["max1"]), at(a["max2"]), at(a["max1"]))
    wo = _need(log_wo, ones_wo, at(a["Q"]) - r, at(a["sq"]) - r * r, sq_total, max_wo,
               at(a["sum"]) - p, top_k)
    saved = (at(full) - wo) * T.unsqueeze(-1)
    node_S = torch.arange(S) // g
    remote = piece != node_S.view(1, S, 1)          # pairs that cross today
    saved = saved.masked_fill(~remote, 0.0).clamp(min=0.0)
    own = torch.nn.functional.one_hot(node_S, N).bool()
    return (full * T.unsqueeze(-1)).masked_fill(own.unsqueeze(0), 0.0), saved


def greedy_row_replicas(loads_MLSE: torch.Tensor, tokens_MS: torch.Tensor, owner_node_LE: torch.Tensor, B: int,
                        g: int, top_k: int, token_s: float, fill_LNE: torch.Tensor) -> torch.Tensor:
    """int64 ``[L, N, B]``: each node's traffic replicas, one set for the ``M`` micro-batches
    given (``M = 1``: one micro-batch's), in the order picked (``-1``: none).

    Each pick is the remote expert whose rows saved over the micro-batches
    (:func:`rows_saved`, given the node's earlier picks) times ``token_s`` minus its fill
    ``fill_LNE`` (seconds; 0 for a replica already resident) is largest and positive; ties
    go to the lower expert id. A node stops at its first pick that does not pay.
    """
    M, L, S, E = loads_MLSE.shape
    N = fill_LNE.shape[1]
    loads = loads_MLSE.reshape(M * L, S, E)
    tokens = tokens_MS.unsqueeze(1).expand(M, L, S).reshape(M * L, S)
    owner = owner_node_LE.unsqueeze(0).expand(M, L, E).reshape(M * L, E)
    native = torch.nn.functional.one_hot(owner_node_LE, N).permute(0, 2, 1).bool().contiguous()   # [L, N, E]
    local = native.clone()
    chosen = torch.full((L, N, B), -1, dtype=torch.int64)
    demand_LNE = loads_MLSE.to(torch.int64).sum(0).view(L, N, g, E).sum(2)
    open_LN = torch.ones(L, N, dtype=torch.bool)
    for b in range(B):
        local_rows = local.unsqueeze(0).expand(M, L, N, E).reshape(M * L, N, E)
        saved = rows_saved(loads, tokens, owner, local_rows, top_k, g).view(M, L, N, E).sum(0)
        value = (saved * token_s - fill_LNE).masked_fill(local | (demand_LNE <= 0), -1.0)
        best = (-value).argsort(dim=2, stable=True)[..., 0]                      # [L, N]
        take = open_LN & (value.gather(2, best.unsqueeze(-1)).squeeze(-1) > 0)
        if not bool(take.any()):
            break
        chosen[..., b] = torch.where(take, best, -1)
        local.scatter_(2, best.unsqueeze(-1), take.unsqueeze(-1) | local.gather(2, best.unsqueeze(-1)))
        open_LN &= take
    return chosen


def set_rows_saved(loads_MLSE: torch.Tensor, tokens_MS: torch.Tensor, owner_node_LE: torch.Tensor,
                   expert_MLGr: torch.Tensor, g: int, top_k: int) -> torch.Tensor:
    """float64 ``[M, L, N]``: estimated cross-node rows each node's sources stop sending
    when its GPUs' traffic slots ``expert_MLGr`` (``-1``: empty) serve their experts locally
    (quota: the node's demand), against the owners alone."""
    M, L, S, E = loads_MLSE.shape
    G, r = expert_MLGr.shape[2:]
    N = G // g
    loads = loads_MLSE.reshape(M * L, S, E)
    tokens = tokens_MS.unsqueeze(1).expand(M, L, S).reshape(M * L, S)
    owner = owner_node_LE.unsqueeze(0).expand(M, L, E).reshape(M * L, E)
    native = torch.nn.functional.one_hot(owner, N).permute(0, 2, 1).bool()
    held = native.clone()
    e = expert_MLGr.reshape(M * L, N, g * r)
    held.scatter_(2, e.clamp(min=0), (e >= 0) | held.gather(2, e.clamp(min=0)))
    saved = node_rows(loads, tokens, owner, native, top_k, g) - node_rows(loads, tokens, owner, held, top_k, g)
    return saved.view(M, L, N)


def _landing_recv(need_LSN: torch.Tensor, g: int) -> torch.Tensor:
    """float64 ``[L, G]``: cross-node rows each GPU receives (GPU ``(o, i)`` lands the rows
    of every source ``(n, i)`` bound for node ``o``)."""
    L, S, N = need_LSN.shape
    # need[l, (n, i), o] -> recv[l, (o, i)]: sum over n
    return need_LSN.view(L, N, g, N).sum(1).permute(0, 2, 1).reshape(L, N * g)


def _links(link_LG: torch.Tensor) -> torch.Tensor:
    """Half the busiest link plus half the mean link: the busiest sets the exchange, the
    mean breaks its ties (a copy that relieves one of two equally busy GPUs is a step
    towards relieving both), in the same units."""
    return 0.5 * (link_LG.max(-1).values + link_LG.mean(-1))


def _fill_links(new_LNE: torch.Tensor, owner_gpu_LE: torch.Tensor, g: int) -> torch.Tensor:
    """int64 ``[L]``: fills the busiest link carries when each node's new replicas go to
    distinct GPUs (``ceil(new / g)`` per receiver) and each owner sends its expert's."""
    L, N, E = new_LNE.shape
    recv = (new_LNE.sum(-1) + g - 1) // g
    send = torch.zeros(L, N * g, dtype=torch.int64).scatter_add_(1, owner_gpu_LE, new_LNE.sum(1))
    return torch.maximum(recv.max(-1).values, send.max(-1).values)


def greedy_nic_replicas(loads_MLSE: torch.Tensor, tokens_MS: torch.Tensor, owner_gpu_LE: torch.Tensor,
                        node_load_MLN: torch.Tensor, B: int, g: int, top_k: int, row_s: float, pair_s: float,
                        fill_s: float, held_LNE: torch.Tensor) -> torch.Tensor:
    """int64 ``[L, N, B]``: each node's traffic replicas, one set for the ``M`` micro-batches
    given (``M = 1``: one micro-batch's), in the order picked (``-1``: none), chosen for the
    busiest links rather than for each node's total.

    Objective per layer (seconds), summed over the micro-batches: ``row_s`` times the
    cross-node rows ``max(send, receive)`` of the busiest GPU (:func:`_links`; estimated,
    :func:`source_rows`; receive at the landing GPU, the source's local index on the remote
    node), plus ``pair_s`` times the busiest node's pairs over ``g`` (balancing spreads a
    node's load over its GPUs); plus, once, ``fill_s`` per fill on the busiest fill link
    (:func:`_fill_links`; a replica resident in ``held_LNE`` is not filled again). A
    replica of ``e`` on node ``n`` removes the rows ``n``'s sources send to ``e``'s owner
    node for ``e`` alone (at the sending and the landing GPUs) and moves ``n``'s pairs of
    ``e`` from the owner's node to ``n``. Each round every node with a free slot takes its
    candidate that lowers the link and load terms most (none that does not; resident ones
    first at equal gain); one copy rarely moves the busiest link by a fill's worth but a set
    can, so each layer keeps the prefix of rounds with the lowest objective, fills
    included. Ties go to the lower id.
    """
    M, L, S, E = loads_MLSE.shape
    N = node_load_MLN.shape[-1]
    G, R = N * g, M * L
    loads = loads_MLSE.to(torch.int64).reshape(R, S, E)
    tokens = tokens_MS.unsqueeze(1).expand(M, L, S).reshape(R, S)
    d = loads.view(R, N, g, E).sum(2).to(torch.float64)                                   # [R, N, E]
    demand_LNE = d.view(M, L, N, E).sum(0)
    o_LE = owner_gpu_LE // g
    o_RE = o_LE.unsqueeze(0).expand(M, L, E).reshape(R, E)
    local = torch.nn.functional.one_hot(o_LE, N).permute(0, 2, 1).bool().contiguous()    # [L, N, E]
    nl = node_load_MLN.to(torch.float64).reshape(R, N).clone()
    chosen = torch.full((L, N, B), -1, dtype=torch.int64)
    round_LNB = torch.full((L, N, B), B, dtype=torch.int64)
    new_LNE = torch.zeros(L, N, E, dtype=torch.int64)
    cost_LK = torch.full((L, B + 1), float("inf"), dtype=torch.float64)
    arN = torch.arange(N)
    not_no = (arN.view(1, 1, 1, N) != arN.view(1, N, 1, 1)) & (arN.view(1, 1, 1, N) != o_RE.view(R, 1, E, 1))
    o_idx = (o_RE.view(R, 1, E, 1) * g + torch.arange(g).view(1, 1, 1, g)).expand(R, N, E, g).reshape(R, -1)
    for k in range(B + 1):
        local_R = local.unsqueeze(0).expand(M, L, N, E).reshape(R, N, E)
        need, saved_RSE = source_rows(loads, tokens, o_RE, local_R, top_k, g)
        send, recv = need.sum(-1), _landing_recv(need, g)
        link = torch.maximum(send, recv)                                                   # [R, G]
        base_R = row_s * _links(link) + pair_s * nl.max(-1).values / g
        cost_LK[:, k] = base_R.view(M, L).sum(0) + fill_s * _fill_links(new_LNE, owner_gpu_LE, g).to(torch.float64)
        if k == B:
            break
        # candidate (n, e): node n's GPUs send less; the owner node's GPUs receive less
        sv = saved_RSE.view(R, N, g, E).permute(0, 1, 3, 2)                               # [R, N, E, g]
        new_n = torch.maximum(send.view(R, N, 1, g) - sv, recv.view(R, N, 1, g))
        new_o = torch.maximum(send.gather(1, o_idx).view(R, N, E, g), recv.gather(1, o_idx).view(R, N, E, g) - sv)
        node_max = link.view(R, N, g).max(-1).values
        rest = torch.where(not_no, node_max.view(R, 1, 1, N), float("-inf")).max(-1).values    # [R, N, E]
        node_sum = link.view(R, N, g).sum(-1)
        old = node_sum.view(R, N, 1) + node_sum.gather(1, o_RE).view(R, 1, E)
        mx = torch.maximum(rest, torch.maximum(new_n.max(-1).values, new_o.max(-1).values))
        mean = (link.sum(-1).view(R, 1, 1) - old + new_n.sum(-1) + new_o.sum(-1)) / G
        nl_n, nl_o = nl.view(R, N, 1) + d, nl.gather(1, o_RE).view(R, 1, E) - d
        others = torch.where(not_no, nl.view(R, 1, 1, N), float("-inf")).max(-1).values
        after = row_s * 0.5 * (mx + mean) + pair_s * torch.maximum(torch.maximum(nl_n, nl_o), others) / g
        gain = (base_R.view(R, 1, 1) - after).view(M, L, N, E).sum(0)                     # [L, N, E]
        full = (chosen >= 0).all(-1)
        bad = local | (demand_LNE <= 0) | full.unsqueeze(-1) | (gain <= 0)
        # net of the fill where it lengthens the busiest fill link (a resident replica: none)
        sends = torch.zeros(L, G, dtype=torch.int64).scatter_add_(1, owner_gpu_LE, new_LNE.sum(1))
        top = _fill_links(new_LNE, owner_gpu_LE, g).view(L, 1, 1)
        longer = (sends.gather(1, owner_gpu_LE).view(L, 1, E) + 1 > top) | (top == 0)
        key = (gain - torch.where(longer & ~held_LNE, fill_s, 0.0)).masked_fill(bad, float("-inf"))
        best = (-key).argsort(dim=2, stable=True)[..., 0]                                 # [L, N]
        take = key.gather(2, best.unsqueeze(-1)).squeeze(-1) > float("-inf")
        if not bool(take.any()):
            cost_LK[:, k + 1:] = float("inf")
            break
        l_t, n_t = take.nonzero(as_tuple=True)
        e_t = best[l_t, n_t]
        slot = (chosen[l_t, n_t] >= 0).sum(-1)
        chosen[l_t, n_t, slot] = e_t
        round_LNB[l_t, n_t, slot] = k
        local[l_t, n_t, e_t] = True
        new_LNE[l_t, n_t, e_t] = (~held_LNE[l_t, n_t, e_t]).to(torch.int64)
        nl3 = nl.view(M, L, N)
        moved = d.view(M, L, N, E)[:, l_t, n_t, e_t]                                       # [M, picks]
        nl3[:, l_t, n_t] += moved
        nl3[:, l_t, o_LE[l_t, e_t]] -= moved
    # keep the cheapest prefix of rounds per layer: copies that pay only together are kept
    keep_L = cost_LK.argmin(1)                    # first minimum: fewest rounds at that price
    return chosen.masked_fill(round_LNB >= keep_L.view(L, 1, 1), -1)


def link_objective(loads_LSE: torch.Tensor, tokens_S: torch.Tensor, owner_node_LE: torch.Tensor,
                   expert_LGr: torch.Tensor, node_load_LN: torch.Tensor, g: int, top_k: int, row_s: float,
                   pair_s: float) -> torch.Tensor:
    """float64 ``[L]``: :func:`greedy_nic_replicas`' link and load terms with the traffic
    slots ``expert_LGr`` (``-1``: empty) serving their node's demand locally (fills left
    to the caller)."""
    L, S, E = loads_LSE.shape
    N = node_load_LN.shape[1]
    native = torch.nn.functional.one_hot(owner_node_LE, N).permute(0, 2, 1).bool().contiguous()
    local = native.clone()
    e = expert_LGr.reshape(L, N, -1)
    local.scatter_(2, e.clamp(min=0), (e >= 0) | local.gather(2, e.clamp(min=0)))
    d = (loads_LSE.to(torch.int64).view(L, N, g, E).sum(2) * (local & ~native)).to(torch.float64)   # [L, N, E]
    moved_out = torch.zeros(L, N, dtype=torch.float64).scatter_add_(1, owner_node_LE, d.sum(1))
    nl = node_load_LN.to(torch.float64) + d.sum(-1) - moved_out
    need = source_rows(loads_LSE, tokens_S, owner_node_LE, local, top_k, g)[0]
    link = torch.maximum(need.sum(-1), _landing_recv(need, g))
    return row_s * _links(link) + pair_s * nl.max(-1).values / g
