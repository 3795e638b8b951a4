"""Baselines fed the same replay as relibra: what remains of relibra's lead without its
per-micro-batch planning.

* ``eplb-node-demand``: DeepSeek EPLB with the step's own loads (eplb-oracle) on
  ``R - R // 2`` redundant slots per GPU, plus relibra's step-long traffic replicas on the
  other ``R // 2``: per layer and node, the ``g * (R // 2)`` remote experts (no EPLB
  instance on the node) with the most demand from the node's tokens over the step whose
  saved inter-node traffic beats one cross-node fill, heaviest first to the node's GPU with
  the least step load (:func:`relibra_torch.planning.traffic.step_replicas`, the same
  rule and prices as relibra's step-long option). Each takes exactly its node's tokens for
  the expert in every micro-batch and is filled once per step (the cost model charges the
  residency like relibra's). Traffic slots left empty (too few remote experts pay) get
  EPLB's usual redundant experts: one more replica of the expert with the most step load
  per instance not on that GPU, lightest GPU first. The rest of each expert's load is
  split evenly per EPLB physical replica (DeepSeek's semantics); tokens then follow the
  shared :func:`~relibra_torch.planning.token_split`. No per-micro-batch planning: the
  slots are fixed for the step.
* ``online-global-planned``: the UltraEP-like per-micro-batch quota solver of
  ``online-global`` run ahead of the step from the replayed loads, so no planning latency
  sits on the critical path (:attr:`plan_latency_s` = 0).

Legend: M micro-batches, L layers, S source ranks, E experts, N nodes, g GPUs per node,
G GPUs, El native experts per GPU, R replica slots per GPU, J = El + R, r = R // 2 traffic
slots per GPU, Je = El + R - r slots of EPLB's table.
"""

from __future__ import annotations

import torch

from ..checks import check_int, check_number
from .base import Planner, check_loads
from .eplb import even_split_quotas, eplb_replica_table, merge_same_gpu
from .eplb_layout import assign_owners
from .online import DEFAULT_MIN_REPLICA_TOKENS, OnlinePlanner
from .plan import StepPlan
from .topology import Topology
from .traffic import step_replicas  # relibra's step-long traffic set, shared on purpose

__all__ = ["EPLBNodeDemandPlanner", "PlannedOnlinePlanner", "eplb_node_demand_plan", "node_demand_replicas"]


def _leftover_eplb(table_LGJ: torch.Tensor, weight_LE: torch.Tensor, gpu_load_LG: torch.Tensor,
                   topology: Topology) -> torch.Tensor:
    """Fill the ``-1`` slots of ``table_LGJ`` with EPLB's usual redundant experts: per slot,
    lightest GPU first (step load, ties to the lower GPU), the expert with the most load per
    instance (ties to the lower id) that the GPU does not hold yet."""
    L, G, J = table_LGJ.shape
    E = topology.num_experts
    out = table_LGJ.clone()
    if not bool((out < 0).any()):
        return out
    for l in range(L):
        count = torch.zeros(E + 1, dtype=torch.int64).scatter_add_(
            0, out[l].flatten() + 1, torch.ones(G * J, dtype=torch.int64))[1:].tolist()
        weight, load = weight_LE[l].tolist(), gpu_load_LG[l].tolist()
        while True:
            free = [q for q in range(G) if bool((out[l, q] < 0).any())]
            if not free:
                break
            q = min(free, key=lambda p: (load[p], p))
            held = set(out[l, q].tolist())
            cands = [e for e in range(E) if e not in held]
            j = int((out[l, q] < 0).nonzero()[0])
            if not cands:               # the GPU holds every expert: nothing to add
                out[l, q, j] = -1
                break
            e = max(cands, key=lambda x: (weight[x] / count[x], -x))
            out[l, q, j] = e
            count[e] += 1
            load[q] += weight[e] / count[e]
    return out


def node_demand_replicas(loads_MLSE: torch.Tensor, topology: Topology, previous_placement_LE: torch.Tensor,
                         num_groups: int = 1, cross_node_s_per_token: float = 3.3e-7,
                         cross_replica_fill_s_per_expert: float = 0.0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EPLB-oracle's table on ``R - R // 2`` redundant slots and the step-long traffic set.

    Returns:
        ``(table_LGJe, placement_LE, traffic_LGr, traffic_q_MLGr)``: EPLB's replica table
        (``Je = El + R - R // 2``), its placement, the node-demand replica of each traffic
        slot (``-1``: none paid) and its quota per micro-batch (the node's tokens for it).
    """
    M, L, S, E = loads_MLSE.shape
    N, g, G, R = topology.num_nodes, topology.gpus_per_node, topology.num_gpus, topology.replica_slots
    r = R // 2 if N > 1 else 0
    eplb_topo = Topology(N, g, E, R - r)
    loads = loads_MLSE.to(torch.int64)
    weight_LE = loads.to(torch.float64).sum((0, 2))
    table_LGJe = eplb_replica_table(weight_LE, eplb_topo, previous_placement_LE, num_groups)
    placement_LE = assign_owners(table_LGJe, eplb_topo, previous_placement_LE)
    Je = table_LGJe.shape[-1]
    # remote: no EPLB instance on the node
    on_node_LNE = torch.zeros(L, N, E + 1, dtype=torch.bool).scatter_(
        2, (table_LGJe.reshape(L, N, g * Je) + 1), True)[..., 1:]
    remote_MLNE = loads.view(M, L, N, g, E).sum(3).masked_fill(on_node_LNE.unsqueeze(0), 0)
    traffic_e_MLGr, traffic_q_MLGr = step_replicas(remote_MLNE, _eplb_gpu_load_LG(table_LGJe, weight_LE),
                                                    topology, r, cross_node_s_per_token / g,
                                                    cross_replica_fill_s_per_expert)
    traffic_LGr = traffic_e_MLGr[0] if M else torch.full((L, G, r), -1, dtype=torch.int64)
    return table_LGJe, placement_LE, traffic_LGr, traffic_q_MLGr


def _eplb_gpu_load_LG(table_LGJ: torch.Tensor, weight_LE: torch.Tensor) -> torch.Tensor:
    """float64 ``[L, G]``: EPLB's step load per GPU (each physical replica ``1/n`` of its expert)."""
    L, G, J = table_LGJ.shape
    E = weight_LE.shape[1]
    count_LE = torch.zeros(L, E + 1, dtype=torch.int64).scatter_add_(
        1, table_LGJ.reshape(L, -1) + 1, torch.ones(L, G * J, dtype=torch.int64))[:, 1:]
    per_rep_LE = weight_LE / count_LE.clamp(min=1)
    return per_rep_LE.gather(1, table_LGJ.reshape(L, -1).clamp(min=0)).view(L, G, J).sum(-1)


def eplb_node_demand_plan(loads_MLSE: torch.Tensor, topology: Topology,
                          previous_placement_LE: torch.Tensor | None = None, num_groups: int = 1,
                          cross_node_s_per_token: float = 3.3e-7,
                          cross_replica_fill_s_per_expert: float = 0.0,
                          name: str = "eplb-node-demand") -> StepPlan:
    """eplb-oracle plus step-long node-demand traffic replicas (see the module docstring).

    Args:
        loads_MLSE: int ``[M, L, S, E]`` the step's loads (replayed).
        previous_placement_LE: int64 ``[L, E]`` the placement in force (static if ``None``).
        num_groups: expert groups for EPLB's hierarchical policy.
        cross_node_s_per_token: seconds one pair crossing nodes costs (dispatch + combine,
            forward + backward); a traffic replica saves this ``/ g`` per pair it keeps home.
        cross_replica_fill_s_per_expert: seconds of one cross-node fill (weights in,
            gradients back); a traffic replica must save more over the step.
    Returns:
        :class:`StepPlan` whose slots ``J - R // 2 .. J - 1`` of every GPU hold the traffic
        replicas (:func:`node_demand_replicas`, constant over the step) or, where none
        paid, EPLB's leftover redundant experts; the first ``J - R // 2`` are EPLB's table.
    """
    check_loads(loads_MLSE, topology)
    check_int("num_groups", num_groups, 1)
    check_number("cross_node_s_per_token", cross_node_s_per_token, 0.0)
    check_number("cross_replica_fill_s_per_expert", cross_replica_fill_s_per_expert, 0.0)
    M, L, S, E = loads_MLSE.shape
    G = topology.num_gpus
    if previous_placement_LE is None:
        previous_placement_LE = topology.static_placement(L)
    loads = loads_MLSE.to(torch.int64)
    weight_LE = loads.to(torch.float64).sum((0, 2))
    table_LGJe, placement_LE, traffic_LGr, traffic_q_MLGr = node_demand_replicas(
        loads, topology, previous_placement_LE, num_groups, cross_node_s_per_token,
        cross_replica_fill_s_per_expert)
    Je = table_LGJe.shape[-1]
    # EPLB's usual redundant experts in the traffic slots no replica paid for
    is_traffic_LGJ = torch.cat([torch.zeros_like(table_LGJe, dtype=torch.bool), traffic_LGr >= 0], -1)
    step_load_LG = _eplb_gpu_load_LG(table_LGJe, weight_LE) + traffic_q_MLGr.sum((0, 3)).to(torch.float64)
    filled_LGJ = _leftover_eplb(torch.cat([table_LGJe, traffic_LGr], -1), weight_LE, step_load_LG, topology)
    eplb_LGJ = filled_LGJ.masked_fill(is_traffic_LGJ, -1)
    # quotas: traffic replicas take their node's demand; the rest is split per EPLB replica
    J = filled_LGJ.shape[-1]
    traffic_q_MLGJ = torch.cat([torch.zeros(M, L, G, Je, dtype=torch.int64), traffic_q_MLGr], -1)
    traffic_e_LGJ = torch.cat([torch.full_like(table_LGJe, -1), traffic_LGr], -1)
    taken_MLE = torch.zeros(M, L, E + 1, dtype=torch.int64).scatter_add_(
        2, (traffic_e_LGJ + 1).view(1, L, G * J).expand(M, L, G * J).contiguous(),
        traffic_q_MLGJ.view(M, L, G * J))[..., 1:]
    rest_MLE = loads.sum(2) - taken_MLE
    slots_LGJ, first_LGJ = merge_same_gpu(eplb_LGJ)
    per_replica = even_split_quotas(eplb_LGJ.expand(M, -1, -1, -1).contiguous(), rest_MLE)
    quotas = torch.zeros_like(per_replica).scatter_add_(3, first_LGJ.expand(M, -1, -1, -1).contiguous(),
                                                        per_replica)
    slot_expert_LGJ = torch.where(is_traffic_LGJ, traffic_e_LGJ, slots_LGJ)
    quota_MLGJ = torch.where(is_traffic_LGJ, traffic_q_MLGJ, quotas * (slots_LGJ >= 0))
    return StepPlan(topology, placement_LE, slot_expert_LGJ.expand(M, -1, -1, -1).contiguous(),
                    quota_MLGJ.contiguous(), name, previous_placement_LE.clone())


class EPLBNodeDemandPlanner(Planner):
    """``eplb-node-demand``: planned every step from the step's replayed loads; remembers
    the placement in force (migration is counted from it). Every stage (EPLB's table, the
    node-demand set, the leftover slots, the quotas) works per layer, so EP ranks can each
    plan a share of the layers (``splits_layers``)."""

    name = "eplb-node-demand"
    splits_layers = True

    def __init__(self, topology: Topology, num_groups: int = 1, cross_node_s_per_token: float = 3.3e-7,
                 cross_replica_fill_s_per_expert: float = 0.0):
        super().__init__(topology)
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.cross_node_s_per_token = check_number("cross_node_s_per_token", cross_node_s_per_token, 0.0)
        self.cross_replica_fill_s_per_expert = check_number(
            "cross_replica_fill_s_per_expert", cross_replica_fill_s_per_expert, 0.0)

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        return self.plan_layers(loads_MLSE, list(range(loads_MLSE.shape[1])))

    def plan_layers(self, loads_MLSE: torch.Tensor, layers: list[int]) -> StepPlan:
        check_loads(loads_MLSE, self.topology)
        layers = list(layers)
        return eplb_node_demand_plan(loads_MLSE[:, layers], self.topology,
                                     self.previous_placement(loads_MLSE.shape[1])[layers], self.num_groups,
                                     self.cross_node_s_per_token, self.cross_replica_fill_s_per_expert,
                                     self.name)


class PlannedOnlinePlanner(OnlinePlanner):
    """``online-global-planned``: online-global's solver on the replayed loads before the
    step; nothing on the critical path (``plan_latency_s = 0``)."""

    def __init__(self, topology: Topology, min_replica_tokens: int = DEFAULT_MIN_REPLICA_TOKENS):
        super().__init__(topology, scope="global", plan_latency_s=0.0, min_replica_tokens=min_replica_tokens)
        self.name = "online-global-planned"
