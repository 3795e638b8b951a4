"""DeepSeek EPLB's published algorithm, re-implemented on our step-plan type.

The algorithm (github.com/deepseek-ai/EPLB, ``rebalance_experts``): given a per-expert load
estimate, (1) hierarchical policy when the node count divides the number of expert groups:
pack expert groups onto nodes with balanced packing, replicate experts inside each node by
repeatedly giving one more replica to the expert with the highest load per replica, then
pack each node's physical experts onto its GPUs with balanced packing; (2) otherwise the
global policy: the same with one group and one node. Balanced packing is greedy: items in
decreasing weight, each to the lightest pack that still has room (equal items per pack).

Mapping to our plan: the ``G * J`` physical slots are EPLB's physical experts (``J = El +
replica_slots``, so EPLB's redundant experts use exactly relibra's replica-slot memory); the table of
them is the *replica table* ``[L, G, J]``. Every physical replica of an expert with ``n``
replicas takes ``1/n`` of its tokens, which is what the packing assumed (DeepSeek's
semantics; the remainder of ``load / n`` goes to the first replicas in slot order). Two
replicas of one expert on the same GPU become one slot carrying both quotas (the plan
format holds one instance of an expert per GPU; the quota carries the 2/n). The old
variant, ``split="instance"``, splits evenly over GPU instances instead (kept to compare).

Migration: the table is relabelled (nodes, and GPUs inside nodes, permuted) so that the
most experts stay with their owner, never moving more than the unrelabelled table would,
and owners are chosen to keep them (:mod:`relibra_torch.planning.eplb_layout`).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU,
El native experts per GPU, P physical experts (``G * J``), R rows of a batched problem (independent problems).
"""

from __future__ import annotations

import torch

from ..checks import check_choice, check_int
from .base import Planner, check_loads
from .eplb_layout import assign_owners, relabel_replicas
from .plan import StepPlan
from .topology import Topology

EPLB_SPLITS = ("replica", "instance")

__all__ = ["EPLB_SPLITS", "EPLBPlanner", "balanced_packing", "eplb_plan", "eplb_replica_table", "eplb_slots",
           "even_split_quotas", "replicate_experts"]


def balanced_packing(weight_RI: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy balanced packing of ``I`` items into ``num_packs`` packs of at most
    ``ceil(I / num_packs)`` items (exactly ``I / num_packs`` when it divides, as EPLB's
    packings do): heaviest item first to the lightest pack with room, ties to the lower index.

    Args:
        weight_RI: float ``[R, I]`` item weights, ``R`` independent problems.
    Returns:
        ``(pack_RI, rank_RI)`` int64: each item's pack and its position inside the pack.
    """
    R, I = weight_RI.shape
    per_pack = -(-I // num_packs)
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


def eplb_replica_table(weight_LE: torch.Tensor, topology: Topology,
                       previous_placement_LE: torch.Tensor | None = None, num_groups: int = 1,
                       relabel: bool = True, current_LGJ: torch.Tensor | None = None) -> torch.Tensor:
    """EPLB's replica table for ``weight_LE``, relabelled to keep experts where they are.

    Args:
        weight_LE: float ``[L, E]`` load estimate.
        previous_placement_LE: int64 ``[L, E]`` placement in force (static if ``None``).
        relabel: permute nodes and GPUs (:func:`~relibra_torch.planning.eplb_layout.relabel_replicas`);
            per layer, the relabelled table is kept only if its owners move fewer experts
            than the unrelabelled one's (so relabeling never moves more).
        current_LGJ: int64 ``[L, G, J]`` the table in force (``-1`` rows: unknown), or ``None``.
            Where EPLB's new table is the same up to a relabeling of nodes and of GPUs inside
            nodes, and the table in force moves no more experts, it is kept: the relabeling
            maximises experts kept by their owner, not experts kept, so it can move experts
            that the table in force would leave (identical loads must move nothing).
    Returns:
        int64 ``[L, G, J]`` expert of every physical replica.
    """
    L = weight_LE.shape[0]
    if previous_placement_LE is None:
        previous_placement_LE = topology.static_placement(L)
    table_LGJ = eplb_slots(weight_LE, topology, num_groups)
    if not relabel:
        return table_LGJ
    El = topology.experts_per_gpu
    old_gpu_LE = previous_placement_LE // El

    def moved_L(candidate_LGJ: torch.Tensor) -> torch.Tensor:
        return (assign_owners(candidate_LGJ, topology, previous_placement_LE) // El != old_gpu_LE).sum(1)

    relabelled_LGJ = relabel_replicas(table_LGJ, topology, previous_placement_LE)
    moved_new_L, moved_old_L = moved_L(relabelled_LGJ), moved_L(table_LGJ)
    table_LGJ = torch.where((moved_new_L < moved_old_L).view(L, 1, 1), relabelled_LGJ, table_LGJ)
    if current_LGJ is None:
        return table_LGJ
    same_L = torch.tensor([bool((cur >= 0).all()) and _layout_key(cur, topology) == _layout_key(new, topology)
                           for cur, new in zip(current_LGJ, table_LGJ)])
    if not bool(same_L.any()):
        return table_LGJ
    keep_L = same_L & (moved_L(torch.where(same_L.view(L, 1, 1), current_LGJ, table_LGJ))
                       <= torch.minimum(moved_new_L, moved_old_L))
    return torch.where(keep_L.view(L, 1, 1), current_LGJ, table_LGJ)


def _layout_key(table_GJ: torch.Tensor, topology: Topology) -> list:
    """A ``[G, J]`` table's form up to a permutation of nodes and of GPUs inside each node."""
    rows = [sorted(row) for row in table_GJ.tolist()]
    g = topology.gpus_per_node
    return sorted(sorted(rows[n * g:(n + 1) * g]) for n in range(topology.num_nodes))


def merge_same_gpu(table_LGJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge replicas of one expert that share a GPU into the first of their slots.

    Returns:
        ``(slots_LGJ, first_LGJ)``: the table with later duplicates set to ``-1``, and for
        every slot the slot (on the same GPU) its quota goes to.
    """
    L, G, J = table_LGJ.shape
    same = table_LGJ.unsqueeze(-1) == table_LGJ.unsqueeze(-2)            # [L, G, j, j']
    earlier = torch.ones(J, J, dtype=torch.bool).tril(-1)                 # j' < j
    first_LGJ = (same & torch.ones(J, J, dtype=torch.bool).tril()).to(torch.int64).argmax(-1)
    duplicate = (same & earlier).any(-1)
    return table_LGJ.masked_fill(duplicate, -1), first_LGJ


def eplb_plan(loads_MLSE: torch.Tensor, topology: Topology, weight_LE: torch.Tensor | None = None,
              previous_placement_LE: torch.Tensor | None = None, num_groups: int = 1,
              name: str = "eplb", split: str = "replica", table_LGJ: torch.Tensor | None = None,
              relabel: bool = True) -> StepPlan:
    """EPLB plan for a step: replica table from ``weight_LE`` (load estimate), quotas from
    the true loads.

    Args:
        loads_MLSE: int ``[M, L, S, E]`` the step's loads (what actually runs).
        weight_LE: float ``[L, E]`` the load estimate EPLB plans from (history or oracle);
            ignored when ``table_LGJ`` is given.
        previous_placement_LE: int64 ``[L, E]`` current owners (static if ``None``).
        split: ``"replica"`` (each physical replica ``1/n`` of its expert's tokens,
            DeepSeek's semantics) or ``"instance"`` (even over the GPUs holding it).
        table_LGJ: int64 ``[L, G, J]`` a replica table to reuse (EPLB between rebalances).
    """
    check_loads(loads_MLSE, topology)
    check_choice("split", split, EPLB_SPLITS)
    M, L, _, E = loads_MLSE.shape
    if previous_placement_LE is None:
        previous_placement_LE = topology.static_placement(L)
    if table_LGJ is None:
        if weight_LE is None or tuple(weight_LE.shape) != (L, E):
            raise ValueError(f"weight_LE has shape {None if weight_LE is None else tuple(weight_LE.shape)}, "
                             f"expected [{L}, {E}]")
        table_LGJ = eplb_replica_table(weight_LE, topology, previous_placement_LE, num_groups, relabel)
    placement_LE = assign_owners(table_LGJ, topology, previous_placement_LE)
    slots_LGJ, first_LGJ = merge_same_gpu(table_LGJ)
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    if split == "replica":
        per_replica = even_split_quotas(table_LGJ.expand(M, -1, -1, -1).contiguous(), load_MLE)
        quotas = torch.zeros_like(per_replica).scatter_add_(3, first_LGJ.expand(M, -1, -1, -1), per_replica)
    else:
        quotas = even_split_quotas(slots_LGJ.expand(M, -1, -1, -1).contiguous(), load_MLE)
    slot_expert_MLGJ = slots_LGJ.unsqueeze(0).expand(M, -1, -1, -1).contiguous()
    return StepPlan(topology, placement_LE, slot_expert_MLGJ, quotas, name, previous_placement_LE.clone())


class EPLBPlanner(Planner):
    """EPLB planned from history (``oracle=False``) or from the step's true loads (``oracle=True``).

    History is the mean aggregate load ``[L, E]`` of the last ``window`` committed steps. With
    no history yet (first step), EPLB has nothing to go on and plans from a uniform estimate;
    it rebalances as soon as it has history, then every ``interval`` steps, and keeps its
    replica table in between (vLLM's ``step_interval``, SGLang's
    ``--eplb-rebalance-num-iterations``). The oracle plans every step on that step's loads.

    Every layer is planned from that layer's loads, history, placement and table alone (as
    DeepSeek's ``rebalance_experts`` does), and whether a step rebalances depends on step
    counts only, so EP ranks can each plan a share of the layers (``splits_layers``).

    Attributes:
        replicas_LGJ: ``[L, G, J]`` the replica table of the last committed plan (``None``
            before); under split planning in the hook a rank holds only the rows of the
            layers it plans (the others ``-1``), hence ``rank_local_state``.
    """

    splits_layers = True
    rank_local_state = ("replicas_LGJ", "_planned_rows")

    def __init__(self, topology: Topology, oracle: bool = False, window: int = 8, num_groups: int = 1,
                 interval: int = 1, split: str = "replica", relabel: bool = True):
        super().__init__(topology)
        self.window = check_int("window", window, 1)
        self.interval = check_int("interval", interval, 1)
        self.num_groups = check_int("num_groups", num_groups, 1)
        self.split = check_choice("split", split, EPLB_SPLITS)
        self.oracle, self.relabel = oracle, relabel
        self.name = ("eplb-oracle" if oracle else "eplb") + ("-instance" if split == "instance" else "")
        self.history: list[torch.Tensor] = []
        self.replicas_LGJ: torch.Tensor | None = None
        self.steps_since_rebalance = 0     # steps run on the current table
        self._blind = True                 # the current table was planned without history
        self._planned_rows: dict[int, torch.Tensor] = {}   # layer -> [G, J] table planned this step

    def rebalances(self) -> bool:
        """Whether the next :meth:`plan` computes a new replica table (the same for every layer)."""
        if self.oracle or self.replicas_LGJ is None:
            return True
        return (self._blind and bool(self.history)) or self.steps_since_rebalance >= self.interval

    def replica_table(self, loads_MLSE: torch.Tensor, layers: list[int] | None = None) -> torch.Tensor:
        """The replica table ``[L', G, J]`` of ``layers`` (default all) the next plan uses
        (new at a rebalance, else the current)."""
        L = loads_MLSE.shape[1]
        layers = list(range(L)) if layers is None else list(layers)
        if not self.rebalances():
            table_LGJ = self.replicas_LGJ[layers]
            missing = [l for l, row in zip(layers, table_LGJ) if bool((row < 0).any())]
            if missing:
                raise ValueError(f"{self.name} has no replica table for layers {missing}: this planner "
                                 "planned other layers under split planning; plan each layer on the same "
                                 "rank (planning.base.layer_share) or start a new planner")
            return table_LGJ
        if self.oracle:
            weight_LE = loads_MLSE[:, layers].to(torch.float64).sum((0, 2))
        elif self.history:  # means of integer counts: exact per layer, whatever the slice
            weight_LE = torch.stack(self.history[-self.window:])[:, layers].mean(0)
        else:
            weight_LE = torch.ones(len(layers), self.topology.num_experts, dtype=torch.float64)
        current_LGJ = None if self.replicas_LGJ is None else self.replicas_LGJ[layers]
        return eplb_replica_table(weight_LE, self.topology, self.previous_placement(L)[layers],
                                  self.num_groups, self.relabel, current_LGJ)

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        return self.plan_layers(loads_MLSE, list(range(loads_MLSE.shape[1])))

    def plan_layers(self, loads_MLSE: torch.Tensor, layers: list[int]) -> StepPlan:
        """Plan only ``layers`` (``L'``): exactly :meth:`plan` restricted to them. Records
        their tables for :meth:`commit` (shares planned one after the other add up)."""
        check_loads(loads_MLSE, self.topology)
        layers = list(layers)
        table_LGJ = self.replica_table(loads_MLSE, layers)
        self._planned_rows.update(zip(layers, table_LGJ))
        return eplb_plan(loads_MLSE[:, layers], self.topology, None,
                         self.previous_placement(loads_MLSE.shape[1])[layers], self.num_groups, self.name,
                         self.split, table_LGJ=table_LGJ)

    def commit(self, plan: StepPlan, loads_MLSE: torch.Tensor) -> None:
        rebalanced, blind = self.rebalances(), not self.oracle and not self.history  # as planned
        super().commit(plan, loads_MLSE)
        self.history.append(loads_MLSE.to(torch.float64).sum((0, 2)))
        self.history = self.history[-self.window:]
        if self.replicas_LGJ is None:
            G, J = self.topology.num_gpus, self.topology.slots_per_gpu
            table_LGJ = torch.full((loads_MLSE.shape[1], G, J), -1, dtype=torch.int64)
        else:
            table_LGJ = self.replicas_LGJ.clone()
        for l, row in self._planned_rows.items():
            table_LGJ[l] = row
        self.replicas_LGJ, self._planned_rows = table_LGJ, {}
        if rebalanced:
            self.steps_since_rebalance, self._blind = 0, blind
        self.steps_since_rebalance += 1
