"""relibra's own price of a plan: the simulator's step cost, as far as a planner can know it.

The terms follow :mod:`relibra_torch.sim.cost` (which the planner may not import) with the
weights of :class:`~relibra_torch.planning.relibra.ReLibraConfig` (the simulator builds them
with ``CostModel.reorder_weights()``, so the per-unit prices are the cost model's):

* expert compute: ``compute_s_per_token`` x the busiest GPU's tokens (fwd + bwd);
* all-to-all: ``max_G(cross_node_s_per_token * max(cross_send, cross_recv) +
  intra_node_s_per_token * max(intra_send, intra_recv))`` (dispatch + combine, fwd + bwd:
  the cost model's per-GPU rule), with tokens routed by
  :func:`~relibra_torch.planning.plan.token_split` as the layer routes them. Under
  hierarchical dispatch the cross-node units are tokens, one per (token, remote node),
  estimated from counts (:func:`hierarchical_counts`), and NVLink carries the fan-out;
* replica fills: per residency (a filled slot whose expert differs from the previous
  micro-batch's, as ``evaluate`` counts them), ``max_G(cross_replica_fill_s_per_expert *
  max(sent, received) + replica_fill_s_per_expert * max(sent, received))`` over inter-node
  and NVLink fills (an owner feeding several replicas sends several copies);
* migration, once per step: the same rule with ``migration_s_per_expert`` (another node)
  and ``intra_migration_s_per_expert`` (another GPU of the node).

Not priced: attention and dense layers (the same for every plan), the overlap of fills
with attention (``--overlap-replication``: the planner prices fills fully, which can only
make it copy less), and run-time planning latency.

Legend: M micro-batches, L layers (or stacked candidate x layer rows), S source ranks,
E experts, N nodes, G GPUs, g GPUs per node, J slots per GPU, El native experts per GPU.
"""

from __future__ import annotations

import torch

from .plan import StepPlan, token_split
from .topology import Topology

__all__ = ["a2a_seconds_ML", "compute_seconds_ML", "fill_seconds_ML", "hierarchical_counts",
           "migration_seconds", "migration_seconds_L", "moe_seconds_ML"]


def compute_seconds_ML(slot_tokens_MLGJ: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: expert compute of the busiest GPU, forward + backward."""
    return slot_tokens_MLGJ.sum(-1).max(-1).values.to(torch.float64) * config.compute_s_per_token


def hierarchical_counts(split_LSGJ: torch.Tensor, slot_expert_LGJ: torch.Tensor, tokens_LS: torch.Tensor,
                        top_k: int, topo: Topology) -> tuple[torch.Tensor, ...]:
    """Per-GPU ``(cross_send, cross_recv, intra_send, intra_recv)`` float64 ``[L, G]`` of one
    micro-batch under hierarchical dispatch, the cross-node ones in tokens.

    A source's token needs remote node ``n`` with probability ``1 - min(P_indep, P_draws)``
    clipped to ``[max_e p_e, sum_e p_e]`` (``p_e``: the share of its tokens whose pairs of
    expert ``e`` go to ``n``): the count-level estimate of :mod:`relibra_torch.sim.dispatch`,
    restated here because planning may not import the simulator. A token lands on the GPU
    of the remote node with its source's local index and fans out over NVLink to the GPUs
    of its pairs.
    """
    L, S, G, J = split_LSGJ.shape
    N, g, E = topo.num_nodes, topo.gpus_per_node, topo.num_experts
    e_LX = slot_expert_LGJ.reshape(L, G * J)
    node_X = torch.arange(G * J) // (J * g)
    flow = torch.zeros(L, S, N * E, dtype=torch.float64)
    flow.scatter_add_(2, (node_X * E + e_LX.clamp(min=0)).unsqueeze(1).expand(L, S, G * J),
                      (split_LSGJ.reshape(L, S, G * J) * (e_LX >= 0).unsqueeze(1)).to(torch.float64))
    T = tokens_LS.to(torch.float64).view(L, S, 1)
    # Only (node, expert) columns with an instance carry flow (at most G * J of N * E): the
    # per-column work runs on those alone, summed per node by scatter.
    used_LC = flow.ne(0).any(1)
    width = max(int(used_LC.sum(1).max()), 1) if L else 1
    col_LK = (~used_LC).to(torch.int8).argsort(dim=1, stable=True)[:, :width]
    live_LK = used_LC.gather(1, col_LK)
    p = (flow.gather(2, col_LK.unsqueeze(1).expand(L, S, width)) / T.clamp(min=1.0)).clamp(0.0, 1.0)
    p = p * live_LK.unsqueeze(1)
    node_LSK = (col_LK // E).unsqueeze(1).expand(L, S, width)

    def per_node(x_LSK: torch.Tensor) -> torch.Tensor:
        return torch.zeros(L, S, N, dtype=torch.float64).scatter_add_(2, node_LSK, x_LSK)

    none_indep = per_node(torch.log1p(-p)).exp()
    # K successive draws without replacement with draw probabilities p / K (see sim.dispatch)
    r = p / top_k
    mass = per_node(r).clamp(max=1.0)
    sq = per_node(r * r)
    rho = ((sq.sum(-1, keepdim=True) - sq) / (1.0 - mass).clamp(min=1e-12)).clamp(min=0.0)
    none_draws = torch.ones_like(mass)
    for i in range(top_k):
        none_draws = none_draws * (1.0 - mass / (1.0 - i * rho).clamp(min=1e-12)).clamp(0.0, 1.0)
    need = 1.0 - torch.minimum(none_indep, none_draws)
    p_max = torch.zeros(L, S, N, dtype=torch.float64).scatter_reduce_(2, node_LSK, p, "amax")
    need = torch.minimum(torch.maximum(need, p_max), per_node(p))
    node_S = torch.arange(S) // g
    own_SN = torch.nn.functional.one_hot(node_S, N).bool()
    cross_LSN = (need * T).masked_fill(own_SN.unsqueeze(0), 0.0)
    split_LSG = split_LSGJ.sum(-1).to(torch.float64)
    local_S = torch.arange(S) % g
    cross_send = cross_LSN.sum(-1)
    land_SN = torch.arange(N).view(1, N) * g + local_S.view(S, 1)
    cross_recv = torch.zeros(L, G, dtype=torch.float64).scatter_add_(
        1, land_SN.reshape(1, S * N).expand(L, S * N), cross_LSN.reshape(L, S * N))
    dst_G = torch.arange(G)
    same_node = node_S.view(S, 1) == (dst_G // g).view(1, G)
    local = split_LSG * (same_node & (torch.arange(S).view(S, 1) != dst_G.view(1, G)))
    land_SG = (dst_G // g).view(1, G) * g + local_S.view(S, 1)
    fwd = split_LSG * (~same_node & (land_SG != dst_G.view(1, G)))
    intra_send = local.sum(2).scatter_add_(1, land_SG.reshape(1, S * G).expand(L, S * G), fwd.reshape(L, S * G))
    intra_recv = local.sum(1) + fwd.sum(1)
    return cross_send, cross_recv, intra_send, intra_recv


def a2a_seconds_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: dispatch + combine, forward + backward, under ``config.dispatch``.

    ``config.top_k`` (0: unknown) gives each source's tokens under hierarchical dispatch;
    unknown, the cross-node units stay pairs (flat's count, an upper bound on tokens).
    """
    topo = plan.topology
    M, L, S, E = loads_MLSE.shape
    G, g = topo.num_gpus, topo.gpus_per_node
    node_G = torch.arange(G) // g
    same_node = node_G.view(G, 1) == node_G.view(1, G)
    same_gpu = torch.eye(G, dtype=torch.bool)
    hier = config.dispatch == "hierarchical" and config.top_k > 0 and topo.num_nodes > 1
    out = torch.empty(M, L, dtype=torch.float64)
    for m in range(M):  # one micro-batch at a time keeps the [L, S, G, J] split small
        split_LSGJ = token_split(plan.micro_batch(m), loads_MLSE[m:m + 1])[0]
        if hier:
            tokens_LS = loads_MLSE[m].to(torch.int64).sum(-1).to(torch.float64) / config.top_k
            cs, cr, is_, ir = hierarchical_counts(split_LSGJ, plan.slot_expert_MLGJ[m], tokens_LS,
                                                  config.top_k, topo)
        else:
            split_LSG = split_LSGJ.sum(-1)
            cross, intra = split_LSG * ~same_node, split_LSG * (same_node & ~same_gpu)
            cs, cr, is_, ir = cross.sum(2), cross.sum(1), intra.sum(2), intra.sum(1)
        per_gpu = (torch.maximum(cs, cr).to(torch.float64) * config.cross_node_s_per_token
                   + torch.maximum(is_, ir).to(torch.float64) * config.intra_node_s_per_token)
        out[m] = per_gpu.max(-1).values
    return out


def moe_seconds_ML(plan: StepPlan, loads_MLSE: torch.Tensor, config) -> torch.Tensor:
    """float64 ``[M, L]``: expert compute + all-to-all (fills and migration apart)."""
    return compute_seconds_ML(plan.slot_tokens_MLGJ, config) + a2a_seconds_ML(plan, loads_MLSE, config)


def fill_seconds_ML(slot_expert_MLGJ: torch.Tensor, before_MLGJ: torch.Tensor, owner_gpu_LE: torch.Tensor,
                    topo: Topology, config) -> torch.Tensor:
    """float64 ``[M, L]``: replica fills (weights in, gradients back) of the slots whose
    expert is not owned by their GPU and differs from ``before_MLGJ`` (the slot's content in
    the micro-batch before; ``-2`` for none, e.g. at the step's first micro-batch)."""
    M, L, G, J = slot_expert_MLGJ.shape
    E = owner_gpu_LE.shape[1]
    g = topo.gpus_per_node
    se = slot_expert_MLGJ
    owner = owner_gpu_LE.view(1, L, 1, E).expand(M, L, G, E).gather(3, se.clamp(min=0))
    gpu = torch.arange(G).view(1, 1, G, 1)
    new = (se >= 0) & (owner != gpu) & (se != before_MLGJ)
    cross = new & (owner // g != gpu // g)
    intra = new & ~cross
    out = torch.zeros(M, L, G, dtype=torch.float64)
    for mask, price in ((cross, config.cross_replica_fill_s_per_expert), (intra, config.replica_fill_s_per_expert)):
        if price <= 0:
            continue
        recv = mask.sum(-1)
        sent = torch.zeros(M, L, G, dtype=torch.int64).scatter_add_(
            2, owner.reshape(M, L, G * J), mask.reshape(M, L, G * J).to(torch.int64))
        out += torch.maximum(recv, sent).to(torch.float64) * price
    return out.max(-1).values


def migration_seconds_L(placement_LE: torch.Tensor, previous_LE: torch.Tensor, topo: Topology,
                        config) -> torch.Tensor:
    """float64 ``[L]``: seconds to move each layer's experts whose owner GPU changed, as if
    that layer moved alone. The cost model moves all layers at once (one maximum over GPUs
    of the sums), so the sum of these is at least its time: pricing per layer is
    conservative, and lets each layer decide alone (``Planner.splits_layers``)."""
    El, g, G = topo.experts_per_gpu, topo.gpus_per_node, topo.num_gpus
    L = placement_LE.shape[0]
    old, new = previous_LE // El, placement_LE // El
    moved = old != new
    cross = moved & (old // g != new // g)
    per_gpu = torch.zeros(L, G, dtype=torch.float64)
    for mask, price in ((cross, config.migration_s_per_expert), (moved & ~cross, config.intra_migration_s_per_expert)):
        sent = torch.zeros(L, G, dtype=torch.int64).scatter_add_(1, old, mask.to(torch.int64))
        recv = torch.zeros(L, G, dtype=torch.int64).scatter_add_(1, new, mask.to(torch.int64))
        per_gpu += torch.maximum(sent, recv).to(torch.float64) * price
    return per_gpu.max(-1).values if G else torch.zeros(L, dtype=torch.float64)


def migration_seconds(placement_LE: torch.Tensor, previous_LE: torch.Tensor, topo: Topology, config) -> float:
    """Seconds to move every expert whose owner GPU changed, all layers at once (the cost
    model's rule)."""
    El, g, G = topo.experts_per_gpu, topo.gpus_per_node, topo.num_gpus
    old, new = previous_LE // El, placement_LE // El
    moved = old != new
    cross = moved & (old // g != new // g)
    per_gpu = torch.zeros(G, dtype=torch.float64)
    for mask, price in ((cross, config.migration_s_per_expert), (moved & ~cross, config.intra_migration_s_per_expert)):
        sent = torch.bincount(old[mask], minlength=G)
        recv = torch.bincount(new[mask], minlength=G)
        per_gpu += torch.maximum(sent, recv).to(torch.float64) * price
    return float(per_gpu.max()) if G else 0.0
