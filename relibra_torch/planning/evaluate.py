"""Measure what a step plan does with a step's loads.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU,
N nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .lis import lis
from .plan import StepPlan, token_split
from .residency import Residencies, residencies

__all__ = ["PlanMetrics", "evaluate", "imbalance"]


def imbalance(gpu_load_MLG: torch.Tensor) -> torch.Tensor:
    """float64 ``[M, L]``: max over GPUs / mean over GPUs of ``gpu_load_MLG`` (1.0 if empty)."""
    load = gpu_load_MLG.to(torch.float64)
    mean_ML = load.mean(-1)
    return torch.where(mean_ML > 0, load.max(-1).values / mean_ML.clamp(min=1e-12),
                       torch.ones_like(mean_ML))


@dataclass
class PlanMetrics:
    """Per micro-batch and layer figures of a plan on given loads (all tensors int64 unless noted).

    Attributes:
        gpu_load_MLG: expert tokens (token-expert pairs) each GPU processes.
        imbalance_ML: float64, max over GPUs / mean over GPUs (1.0 = perfect).
        lower_bound_ML: ``ceil(total / G)``, the best max GPU load any plan can reach.
        node_lower_bound_ML: ``max_n ceil(node_load_n / g)`` under the plan's placement: the
            best max load reachable with replication inside nodes only.
        cross_send_MLG / cross_recv_MLG: tokens a GPU sends to / receives from other nodes.
        intra_send_MLG / intra_recv_MLG: tokens a GPU sends to / receives from other GPUs of
            its node (tokens kept on their own GPU count in neither).
        fill_MLGJ: bool, the slot holds an expert owned by another GPU (weights copied in,
            gradients sent back).
        fill_cross_node_MLGJ: bool, such a fill whose owner is on another node.
        fill_start_MLGJ: bool, a replica residency's weights arrive here (its first
            micro-batch with tokens; ``planning.residency``): the fills the layer executes.
        grad_return_MLGJ: bool, a residency's accumulated gradient goes home in this
            micro-batch's backward (its last micro-batch with tokens).
        residency: the whole :class:`~relibra_torch.planning.residency.Residencies`
            (active slots, held buffers, owners; refetch schedules).
        migrated_L: experts whose owner GPU changed from ``previous_placement_LE`` (0 if the
            plan has none).
        migrated_cross_node_L: of those, experts that changed node.
        lis_ML: float64 Load-Imbalance Score of the loads (max expert / equal share, summed
            over source ranks; ``nan`` for an empty micro-batch): the same for every plan.
        relay_send_MLG / relay_recv_MLG: hierarchical dispatch with relays (``planning.relay``):
            tokens a GPU hands to / takes from GPUs of its node before the exchange; else ``None``.
    """

    gpu_load_MLG: torch.Tensor
    imbalance_ML: torch.Tensor
    lower_bound_ML: torch.Tensor
    node_lower_bound_ML: torch.Tensor
    cross_send_MLG: torch.Tensor
    cross_recv_MLG: torch.Tensor
    intra_send_MLG: torch.Tensor
    intra_recv_MLG: torch.Tensor
    fill_MLGJ: torch.Tensor
    fill_cross_node_MLGJ: torch.Tensor
    fill_start_MLGJ: torch.Tensor
    grad_return_MLGJ: torch.Tensor
    migrated_L: torch.Tensor
    migrated_cross_node_L: torch.Tensor
    lis_ML: torch.Tensor
    residency: Residencies | None = None
    relay_send_MLG: torch.Tensor | None = None
    relay_recv_MLG: torch.Tensor | None = None


def evaluate(plan: StepPlan, loads_MLSE: torch.Tensor) -> PlanMetrics:
    """Evaluate ``plan`` on ``loads_MLSE`` (int ``[M, L, S, E]``, ``S = G``).

    The token routing follows :func:`relibra_torch.planning.token_split`, exactly as the
    layer executes it, so the predicted GPU loads equal the executed ones.
    """
    topo = plan.topology
    M, L, S, E = loads_MLSE.shape
    G, g = topo.num_gpus, topo.gpus_per_node
    if S != G:
        raise ValueError(f"loads_MLSE has {S} source ranks but the topology has {G} GPUs")
    gpu_load_MLG = plan.slot_tokens_MLGJ.sum(-1)
    imbalance_ML = imbalance(gpu_load_MLG)
    total_ML = loads_MLSE.to(torch.int64).sum((2, 3))
    lower_bound_ML = (total_ML + G - 1) // G

    owner_gpu_LE = plan.owner_gpu_LE()
    owner_node_LE = owner_gpu_LE // g
    node_LN_onehot = torch.nn.functional.one_hot(owner_node_LE, topo.num_nodes).to(torch.int64)
    node_load_MLN = torch.einsum("mle,len->mln", loads_MLSE.to(torch.int64).sum(2), node_LN_onehot)
    node_lower_bound_ML = ((node_load_MLN + g - 1) // g).max(-1).values

    node_G = topo.node_of_gpu()
    same_node_SG = node_G.unsqueeze(1) == node_G.unsqueeze(0)
    same_gpu_SG = torch.eye(G, dtype=torch.bool)
    cross_send, cross_recv, intra_send, intra_recv = [], [], [], []
    for m in range(M):  # one micro-batch at a time keeps the [L, S, G, J] split small
        split_LSG = token_split(plan.micro_batch(m), loads_MLSE[m : m + 1])[0].sum(-1)
        cross_LSG = split_LSG * ~same_node_SG
        intra_LSG = split_LSG * (same_node_SG & ~same_gpu_SG)
        cross_send.append(cross_LSG.sum(2))
        cross_recv.append(cross_LSG.sum(1))
        intra_send.append(intra_LSG.sum(2))
        intra_recv.append(intra_LSG.sum(1))

    res = residencies(plan)

    if plan.previous_placement_LE is None:
        migrated_L = torch.zeros(L, dtype=torch.int64)
        migrated_cross_L = torch.zeros(L, dtype=torch.int64)
    else:
        prev_owner_LE = plan.previous_placement_LE // topo.experts_per_gpu
        migrated_L = (prev_owner_LE != owner_gpu_LE).sum(1)
        migrated_cross_L = (prev_owner_LE // g != owner_node_LE).sum(1)

    return PlanMetrics(
        gpu_load_MLG=gpu_load_MLG,
        imbalance_ML=imbalance_ML,
        lower_bound_ML=lower_bound_ML,
        node_lower_bound_ML=node_lower_bound_ML,
        cross_send_MLG=torch.stack(cross_send),
        cross_recv_MLG=torch.stack(cross_recv),
        intra_send_MLG=torch.stack(intra_send),
        intra_recv_MLG=torch.stack(intra_recv),
        fill_MLGJ=res.fill_MLGJ,
        fill_cross_node_MLGJ=res.cross_node_MLGJ,
        fill_start_MLGJ=res.fill_start_MLGJ,
        grad_return_MLGJ=res.grad_return_MLGJ,
        migrated_L=migrated_L,
        migrated_cross_node_L=migrated_cross_L,
        lis_ML=lis(loads_MLSE.sum(2)),
        residency=res,
    )
