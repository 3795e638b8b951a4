"""DeepSeek EPLB's published algorithm, re-implemented on our step-plan type.

The algorithm (github.com/deepseek-ai/EPLB): given a per-expert load estimate,
(1) hierarchical policy when the node count divides the number of expert groups: pack
expert groups onto nodes with balanced packing, replicate experts inside each node by
repeatedly giving one more replica to the expert with the highest load per replica, then
pack each node's physical experts onto its GPUs with balanced packing; (2) otherwise the
global policy: the same with one group and one node. Balanced packing is greedy: items in
decreasing weight, each to the lightest pack that still has room (equal items per pack).

Mapping to our plan: the ``G * J`` physical slots are EPLB's physical experts (``J = El + replica_slots``,
so EPLB's redundant experts use exactly relibra's replica-slot memory). Slots are the same
for every micro-batch of the step, and an expert's tokens are split evenly between its
instances (remainder to the first instances in slot order). Two replicas of one expert that
EPLB packs onto the same GPU are merged (the second slot stays empty): they would only
share the GPU anyway. Parameters must live somewhere: each expert is owned by one GPU that
holds an instance when that GPU has native room (keeping the previous owner when it
qualifies), otherwise by a GPU with room, preferring the instance's node; slots whose GPU
does not own the expert are fills.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU,
El native experts per GPU, P physical experts (``G * J``), R rows of a batched problem (independent problems).
"""

from __future__ import annotations

import torch

from ..checks import check_int
from .base import Planner, check_loads
from .plan import StepPlan
from .topology import Topology

__all__ = ["EPLBPlanner", "balanced_packing", "eplb_plan", "eplb_slots", "replicate_experts"]


def balanced_packing(weight_RI: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy balanced packing of ``I`` items into ``num_packs`` packs of ``I / num_packs`` items.

    Args:
        weight_RI: float ``[R, I]`` item weights, ``R`` independent problems.
    Returns:
        ``(pack_RI, rank_RI)`` int64: each item's pack and its position inside the pack.
    """
    R, I = weight_RI.shape
    per_pack = I // num_packs
    order_RI = weight_RI.sort(dim=1, descending=True, stable=True).indices
    pack_RI = torch.empty(R, I, dtype=torch.int64)
    rank_RI = torch.empty(R, I, dtype=torch.int64)
    pack_weight_R_packs = torch.zeros(R, num_packs, dtype=weight_RI.dtype)
    pack_count_R_packs = torch.zeros(R, num_packs, dtype=torch.int64)
    rows = torch.arange(R)
    for i in range(I):
        item_R = order_RI[:, i]
        masked = pack_weight_R_packs.masked_fill(pack_count_R_packs >= per_pack, float("inf"))
        pack_R = masked.argmin(dim=1)
        pack_RI[rows, item_R] = pack_R
        rank_RI[rows, item_R] = pack_count_R_packs[rows, pack_R]
        pack_weight_R_packs[rows, pack_R] += weight_RI[rows, item_R]
        pack_count_R_packs[rows, pack_R] += 1
    return pack_RI, rank_RI


def replicate_experts(weight_RE: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``num_physical - E`` extra replicas, each to the expert with the highest load per replica.

    Returns:
        ``(phy2log_RP, count_RE)``: logical expert of every physical expert (the first ``E``
        are the experts themselves) and each expert's number of instances.
    """
    R, E = weight_RE.shape
    phy2log_RP = torch.arange(num_physical).expand(R, -1).clone()
    count_RE = torch.ones(R, E, dtype=torch.int64)
    rows = torch.arange(R)
    for p in range(E, num_physical):
        hottest_R = (weight_RE / count_RE).argmax(dim=1)
        phy2log_RP[:, p] = hottest_R
        count_RE[rows, hottest_R] += 1
    return phy2log_RP, count_RE


def eplb_slots(weight_LE: torch.Tensor, topology: Topology, num_groups: int = 1) -> torch.Tensor:
    """EPLB's physical-expert layout: logical expert of every slot, ``[L, G, J]`` int64.

    Args:
        weight_LE: float ``[L, E]`` estimated load per expert.
        num_groups: expert groups of the model (DeepSeek-V3: 8); the hierarchical policy is
            used when ``num_nodes`` divides it, the global policy otherwise.
    """
    L, E = weight_LE.shape
    G, J = topology.num_gpus, topology.slots_per_gpu
    check_int("num_groups", num_groups, 1)
    if E % num_groups:
        raise ValueError(f"num_groups = {num_groups}; allowed: a divisor of num_experts = {E}")
    if num_groups % topology.num_nodes == 0:
        nodes, groups = topology.num_nodes, num_groups
    else:  # global policy: one node holding everything, one group
        nodes, groups = 1, 1
    weight_LE = weight_LE.to(torch.float64)
    group_size = E // groups
    # 1. groups -> nodes
    group_pack_LK, group_rank_LK = balanced_packing(
        weight_LE.view(L, groups, group_size).sum(-1), nodes)
    groups_per_node = groups // nodes
    log2mlog_LE = ((group_pack_LK * groups_per_node + group_rank_LK) * group_size).unsqueeze(-1) \
        + torch.arange(group_size)
    log2mlog_LE = log2mlog_LE.view(L, E)
    mlog2log_LE = torch.empty_like(log2mlog_LE).scatter_(1, log2mlog_LE, torch.arange(E).expand(L, E))
    # 2. replicas inside each node
    experts_per_node = E // nodes
    phy_per_node = G * J // nodes
    w_mlog = weight_LE.gather(1, mlog2log_LE).view(L * nodes, experts_per_node)
    phy2mlog_RP, count_RE = replicate_experts(w_mlog, phy_per_node)
    # 3. physical experts -> GPUs of the node
    w_phy_RP = (w_mlog / count_RE).gather(1, phy2mlog_RP)
    gpus_per_node = G // nodes
    pack_RP, rank_RP = balanced_packing(w_phy_RP, gpus_per_node)
    slot_RP = pack_RP * J + rank_RP
    slot2phy_RP = torch.empty_like(slot_RP).scatter_(1, slot_RP, torch.arange(phy_per_node).expand_as(slot_RP))
    slot2mlog_RP = phy2mlog_RP.gather(1, slot2phy_RP)
    node_offset = (torch.arange(L * nodes) % nodes * experts_per_node).unsqueeze(1)
    slot2mlog_LP = (slot2mlog_RP + node_offset).view(L, G * J)
    return mlog2log_LE.gather(1, slot2mlog_LP).view(L, G, J)


def _dedupe_and_own(slots_LGJ: torch.Tensor, topology: Topology,
                    previous_placement_LE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge same-GPU duplicates and choose each expert's owner GPU (see module docstring)."""
    L, G, J = slots_LGJ.shape
    E, El, g = topology.num_experts, topology.experts_per_gpu, topology.gpus_per_node
    slots = slots_LGJ.tolist()
    prev_owner = (previous_placement_LE // El).tolist()
    placement = []
    for l in range(L):
        hosts: list[list[int]] = [[] for _ in range(E)]
        for gpu in range(G):
            seen = set()
            for j in range(J):
                e = slots[l][gpu][j]
                if e in seen:
                    slots[l][gpu][j] = -1
                else:
                    seen.add(e)
                    hosts[e].append(gpu)
        room = [El] * G
        owner = [-1] * E
        # Experts with fewer instances first: they have the fewest choices.
        for e in sorted(range(E), key=lambda e: (len(hosts[e]), e)):
            cands = [gpu for gpu in hosts[e] if room[gpu] > 0]
            if cands:
                gpu = prev_owner[l][e] if prev_owner[l][e] in cands else cands[0]
                owner[e] = gpu
                room[gpu] -= 1
        for e in range(E):
            if owner[e] < 0:
                node = hosts[e][0] // g
                free = [gpu for gpu in range(G) if room[gpu] > 0]
                same = [gpu for gpu in free if gpu // g == node]
                gpu = (same or free)[0]
                owner[e] = gpu
                room[gpu] -= 1
        next_local = [0] * G
        place = [0] * E
        for e in range(E):
            place[e] = owner[e] * El + next_local[owner[e]]
            next_local[owner[e]] += 1
        placement.append(place)
    return torch.tensor(slots, dtype=torch.int64), torch.tensor(placement, dtype=torch.int64)


def even_split_quotas(slot_expert_MLGJ: torch.Tensor, load_MLE: torch.Tensor) -> torch.Tensor:
    """Split each expert's load evenly over its instances (remainder to the first in slot order).

    Args:
        slot_expert_MLGJ: int64 ``[M, L, G, J]``; load_MLE: int64 ``[M, L, E]``.
    Returns:
        int64 ``[M, L, G, J]`` quotas.
    """
    M, L, G, J = slot_expert_MLGJ.shape
    E = load_MLE.shape[-1]
    se = slot_expert_MLGJ.reshape(M, L, G * J)
    valid = se >= 0
    safe = se.clamp(min=0)
    count_MLE = torch.zeros(M, L, E, dtype=torch.int64).scatter_add_(2, safe, valid.to(torch.int64))
    # instance index of every slot among its expert's instances, in slot order
    key = safe * (G * J) + torch.arange(G * J)
    order = key.argsort(dim=2)
    ones_sorted = valid.to(torch.int64).gather(2, order)
    running = ones_sorted.cumsum(2)
    before_MLE = count_MLE.cumsum(2) - count_MLE
    idx_sorted = running - 1 - before_MLE.gather(2, safe.gather(2, order))
    instance = torch.empty_like(idx_sorted).scatter_(2, order, idx_sorted)
    cnt = count_MLE.gather(2, safe).clamp(min=1)
    load = load_MLE.gather(2, safe)
    quota = load // cnt + (instance < load % cnt).to(torch.int64)
    return (quota * valid).view(M, L, G, J)


def eplb_plan(loads_MLSE: torch.Tensor, topology: Topology, weight_LE: torch.Tensor,
              previous_placement_LE: torch.Tensor | None = None, num_groups: int = 1,
              name: str = "eplb") -> StepPlan:
    """EPLB plan for a step: slots from ``weight_LE`` (load estimate), quotas from the true loads.

    Args:
        loads_MLSE: int ``[M, L, S, E]`` the step's loads (what actually runs).
        weight_LE: float ``[L, E]`` the load estimate EPLB plans from (history or oracle).
        previous_placement_LE: int64 ``[L, E]`` current owners (static if ``None``).
    """
    check_loads(loads_MLSE, topology)
    M, L, _, E = loads_MLSE.shape
    if tuple(weight_LE.shape) != (L, E):
        raise ValueError(f"weight_LE has shape {tuple(weight_LE.shape)}, expected [{L}, {E}]")
    if previous_placement_LE is None:
        previous_placement_LE = topology.static_placement(L)
    slots_LGJ = eplb_slots(weight_LE, topology, num_groups)
    slots_LGJ, placement_LE = _dedupe_and_own(slots_LGJ, topology, previous_placement_LE)
    slot_expert_MLGJ = slots_LGJ.unsqueeze(0).expand(M, -1, -1, -1).contiguous()
    quotas = even_split_quotas(slot_expert_MLGJ, loads_MLSE.to(torch.int64).sum(2))
    return StepPlan(topology, placement_LE, slot_expert_MLGJ, quotas, name, previous_placement_LE.clone())


class EPLBPlanner(Planner):
    """EPLB planned from history (``oracle=False``) or from the step's true loads (``oracle=True``).

    History is the mean aggregate load ``[L, E]`` of the last ``window`` committed steps. With
    no history yet (first step), EPLB has nothing to go on and plans from a uniform estimate.
    """

    def __init__(self, topology: Topology, oracle: bool = False, window: int = 8, num_groups: int = 1):
        super().__init__(topology)
        check_int("window", window, 1)
        self.oracle, self.window, self.num_groups = oracle, window, num_groups
        self.name = "eplb-oracle" if oracle else "eplb"
        self.history: list[torch.Tensor] = []

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        L = loads_MLSE.shape[1]
        prev = self.previous_placement(L)
        if self.oracle:
            weight_LE = loads_MLSE.to(torch.float64).sum((0, 2))
        elif self.history:
            weight_LE = torch.stack(self.history[-self.window:]).mean(0)
        else:
            weight_LE = torch.ones(L, self.topology.num_experts, dtype=torch.float64)
        return eplb_plan(loads_MLSE, self.topology, weight_LE, prev, self.num_groups, self.name)

    def commit(self, plan: StepPlan, loads_MLSE: torch.Tensor) -> None:
        super().commit(plan, loads_MLSE)
        self.history.append(loads_MLSE.to(torch.float64).sum((0, 2)))
        self.history = self.history[-self.window:]
