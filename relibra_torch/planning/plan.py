"""The step plan that every planner returns and every consumer executes.

Legend (shape suffixes):
    M micro-batches of the step, L MoE layers, S source ranks (= G), E logical experts,
    G EP ranks (GPUs, node-major), J = El + replica_slots slots per GPU (El native),
    P = G * J physical slots (flattened (gpu, slot)), N nodes.

A *physical native slot* is ``p = gpu * El + local`` in ``[0, E)``; the placement maps every
logical expert to one (a bijection per layer): the expert's parameters and optimizer state
live there. Each GPU runs ``J`` *slots* per micro-batch and layer: slot ``j < El`` of a plan
built by the relibra or static planner holds the GPU's own native expert ``j``; slots
``j >= El`` are replica slots. Any slot may hold any expert (``slot_expert``): when the slot's
GPU is not the expert's owner, its weights are copied in from the owner (and gradients
sent back) — that is a *fill*. ``-1`` marks an empty slot.

``slot_tokens`` is the number of tokens (token-expert pairs) each slot processes; for every
(m, l, e) the slots holding ``e`` carry exactly the expert's load summed over sources. How a
source rank's tokens for ``e`` are split between ``e``'s instances is not stored: it follows
from the counts by one deterministic rule (:func:`token_split`), so every rank derives the
same all-to-all sizes without talking.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from .relay import check_relays
from .topology import Topology

__all__ = ["StepPlan", "token_split", "validate_plan", "plan_digest"]


@dataclass
class StepPlan:
    """Placement for the step plus per-micro-batch slot contents and token quotas.

    Attributes:
        topology: the cluster the plan is for.
        placement_LE: int64 ``[L, E]``, physical native slot of every logical expert.
        slot_expert_MLGJ: int64 ``[M, L, G, J]``, logical expert in each slot, ``-1`` empty.
        slot_tokens_MLGJ: int64 ``[M, L, G, J]``, tokens each slot processes.
        planner: name of the planner that produced it (for reports).
        previous_placement_LE: int64 ``[L, E]`` the placement before this step, if the
            planner knew it (used to count migrated experts); ``None`` means unknown.
        relay_MLGg: optional int64 ``[M, L, G, g]``: tokens GPU ``r`` hands to the GPU of its
            node with local index ``p`` before a hierarchical exchange (``planning.relay``).
    """

    topology: Topology
    placement_LE: torch.Tensor
    slot_expert_MLGJ: torch.Tensor
    slot_tokens_MLGJ: torch.Tensor
    planner: str = ""
    previous_placement_LE: torch.Tensor | None = None
    relay_MLGg: torch.Tensor | None = None

    @property
    def num_micro_batches(self) -> int:
        return self.slot_expert_MLGJ.shape[0]

    @property
    def num_layers(self) -> int:
        return self.placement_LE.shape[0]

    def owner_gpu_LE(self) -> torch.Tensor:
        """``[L, E]`` int64: the GPU that owns each logical expert's parameters."""
        return self.placement_LE // self.topology.experts_per_gpu

    def native_experts_LGl(self) -> torch.Tensor:
        """``[L, G, El]`` int64: logical expert stored in each native slot (inverse placement)."""
        L, E = self.placement_LE.shape
        inverse_LE = torch.empty_like(self.placement_LE)
        inverse_LE.scatter_(1, self.placement_LE, torch.arange(E).expand(L, E))
        return inverse_LE.view(L, self.topology.num_gpus, self.topology.experts_per_gpu)

    def relays(self) -> torch.Tensor:
        """int64 ``[M, L, G, g]``: :attr:`relay_MLGg`, zeros where the plan has none."""
        return self.relay_MLGg if self.relay_MLGg is not None else torch.zeros(*self.slot_expert_MLGJ.shape[:2], self.topology.num_gpus, self.topology.gpus_per_node,
                           dtype=torch.int64)

    def micro_batch(self, m: int) -> "StepPlan":
        """The plan restricted to micro-batch ``m`` (``M = 1``)."""
        return self.micro_batches(m, m + 1)

    def micro_batches(self, start: int, stop: int) -> "StepPlan":
        """The plan restricted to micro-batches ``[start, stop)`` (views)."""
        return StepPlan(self.topology, self.placement_LE, self.slot_expert_MLGJ[start:stop],
                        self.slot_tokens_MLGJ[start:stop], self.planner, self.previous_placement_LE,
                        None if self.relay_MLGg is None else self.relay_MLGg[start:stop])

    def layers(self, layers: torch.Tensor) -> "StepPlan":
        """The plan restricted to ``layers`` (int64 indices or bool mask ``[L]``), in that order."""
        prev = None if self.previous_placement_LE is None else self.previous_placement_LE[layers]
        return StepPlan(self.topology, self.placement_LE[layers], self.slot_expert_MLGJ[:, layers],
                        self.slot_tokens_MLGJ[:, layers], self.planner, prev,
                        None if self.relay_MLGg is None else self.relay_MLGg[:, layers])

    def with_layers(self, layers: torch.Tensor, part: "StepPlan") -> "StepPlan":
        """A copy with ``part``'s placement, slots and quotas in ``layers`` (int64 ``[L']``,
        ``part`` having ``L'`` layers in that order); the rest and the previous placement kept."""
        out = StepPlan(self.topology, self.placement_LE.clone(), self.slot_expert_MLGJ.clone(),
                       self.slot_tokens_MLGJ.clone(), self.planner, self.previous_placement_LE)
        out.placement_LE[layers] = part.placement_LE
        out.slot_expert_MLGJ[:, layers] = part.slot_expert_MLGJ
        out.slot_tokens_MLGJ[:, layers] = part.slot_tokens_MLGJ
        if self.relay_MLGg is not None or part.relay_MLGg is not None:
            out.relay_MLGg = self.relays().clone()
            out.relay_MLGg[:, layers] = part.relays()
        return out


def _cum_floor(weights, cum_weights, total, share):
    """Integer split of ``share`` over items in proportion to ``weights``: the floor of the
    cumulative proportional share, differenced. Exact (sums to ``share``), non-negative,
    deterministic; ``total`` is the sum of ``weights`` in the item's group (0: nothing)."""
    safe = total.clamp(min=1)
    end = cum_weights * share // safe
    start = (cum_weights - weights) * share // safe
    return torch.where(total > 0, end - start, torch.zeros_like(end))


def token_split(plan: StepPlan, loads_MLSE: torch.Tensor) -> torch.Tensor:
    """Split every (source rank, expert) token count between the expert's instances.

    The rule keeps traffic inside a node where it can and spreads the rest evenly. For each
    (m, l, e), with ``D_n`` the expert's tokens on the sources of node ``n`` and ``Q_n`` the
    quotas of its instances on node ``n``:

    1. **Local first.** Node ``n`` keeps ``min(D_n, Q_n)`` tokens on its own instances; a
       node with more tokens than capacity has a surplus ``D_n - Q_n``, one with more
       capacity a deficit ``Q_n - D_n`` (a token crosses nodes only when its node cannot take
       it).
    2. **Even shares.** Inside a node, every source sends the node's surplus in proportion to
       its tokens, and every instance receives the node's deficit in proportion to its quota
       (floor of the cumulative share, so integers that sum exactly): cross-node send and
       receive follow tokens and compute instead of piling onto the first rank or instance.
    3. **Even receive.** Where an expert has several instances in a node, remote tokens move
       from the instance on the node's busiest-receiving GPU to one on a GPU that receives
       less, and as many local tokens back (:func:`_even_receive`): each GPU's cross-node
       receive comes out even, not only each expert's.
    4. **Matching.** Local tokens go to the node's instances, and surplus tokens to the
       deficit instances, in order: sources by rank, instances by slot (``gpu``, then ``j``),
       each taking consecutive runs (interval overlap).

    The result gives each source's quota at each slot; the layer (``assign_slots``) hands a
    source's tokens for ``e`` to the slots in slot order, each up to that quota, so every
    rank derives all exchange sizes from the gathered counts alone. EPLB and online plans go
    through the same rule.

    Args:
        plan: the step plan (``M`` micro-batches).
        loads_MLSE: int ``[M, L, S, E]`` token counts per source rank.

    Returns:
        int64 ``[M, L, S, G, J]``: tokens source ``s`` sends to slot ``(g, j)``.
    """
    native = _native_split(plan, loads_MLSE)
    if native is not None:
        return native
    # (micro-batch, layer) rows without a replica take the shortcut too (each row is split
    # alone): a step where the planner copied in a few rows splits only those in full
    El = plan.topology.experts_per_gpu
    copies_ML = (plan.slot_expert_MLGJ[..., El:] >= 0).flatten(2).any(-1)
    if bool(copies_ML.all()):
        return general_split(plan, loads_MLSE)
    native = _native_split(_rows(plan, ~copies_ML), loads_MLSE[~copies_ML].unsqueeze(0))
    if native is None:
        return general_split(plan, loads_MLSE)
    M, L, S, _ = loads_MLSE.shape
    out = torch.empty(M, L, S, *plan.slot_expert_MLGJ.shape[2:], dtype=torch.int64)
    out[~copies_ML] = native[0]
    out[copies_ML] = general_split(_rows(plan, copies_ML), loads_MLSE[copies_ML].unsqueeze(0))[0]
    return out


def _rows(plan: StepPlan, rows_ML: torch.Tensor) -> StepPlan:
    """The plan's (micro-batch, layer) rows ``rows_ML`` (bool ``[M, L]``) as one micro-batch
    of ``L'`` rows, which the rule splits exactly as in place."""
    M, L, E = *rows_ML.shape, plan.placement_LE.shape[1]
    return StepPlan(plan.topology, plan.placement_LE.expand(M, L, E)[rows_ML],
                    plan.slot_expert_MLGJ[rows_ML].unsqueeze(0), plan.slot_tokens_MLGJ[rows_ML].unsqueeze(0),
                    plan.planner)


def _native_split(plan: StepPlan, loads_MLSE: torch.Tensor) -> torch.Tensor | None:
    """:func:`token_split` of a plan without replicas, or ``None`` for any other plan: every
    expert has one instance (its native slot, a permutation), which takes all its tokens, so
    each source sends its whole count there; what the general rule gives too, in a few ops
    (a static step, or one where relibra's planner kept every copy out)."""
    topo = plan.topology
    M, L, S, E = loads_MLSE.shape
    G, J, El = topo.num_gpus, topo.slots_per_gpu, topo.experts_per_gpu
    if bool((plan.slot_expert_MLGJ[..., El:] >= 0).any()):
        return None
    loads_MLSE = loads_MLSE.to(torch.int64)
    e_MLX = plan.slot_expert_MLGJ[..., :El].reshape(M, L, G * El)
    if not torch.equal(plan.slot_tokens_MLGJ[..., :El].reshape(M, L, G * El), loads_MLSE.sum(2).gather(2, e_MLX)):
        return None  # quotas that are not the experts' loads: the general rule says what happens
    out = torch.zeros(M, L, S, G, J, dtype=torch.int64)
    out[..., :El] = loads_MLSE.gather(3, e_MLX.unsqueeze(2).expand(M, L, S, G * El)).view(M, L, S, G, El)
    return out


def general_split(plan: StepPlan, loads_MLSE: torch.Tensor) -> torch.Tensor:
    """:func:`token_split` for any plan (its docstring's four steps), without the shortcut
    for plans without replicas (the same result there). Each (micro-batch, layer) is split
    alone: rows stacked in ``M`` or ``L`` give each row's own split."""
    topo = plan.topology
    M, L, S, E = loads_MLSE.shape
    G, J, g = topo.num_gpus, topo.slots_per_gpu, topo.gpus_per_node
    N, X = topo.num_nodes, G * J
    loads_MLSE = loads_MLSE.to(torch.int64)
    expert_MLX = plan.slot_expert_MLGJ.reshape(M, L, X)
    valid_MLX = expert_MLX >= 0
    e_MLX = expert_MLX.clamp(min=0)
    quota_MLX = plan.slot_tokens_MLGJ.reshape(M, L, X) * valid_MLX
    node_X = torch.arange(X) // (J * g)
    node_S = torch.arange(S) // g

    # Per (node, expert): demand D, capacity Q, kept locally, surplus, deficit.
    demand_MLNE = loads_MLSE.view(M, L, N, g, E).sum(3)
    group_MLX = node_X * E + e_MLX  # (node, expert) group of every slot
    cap_MLNE = torch.zeros(M, L, N * E, dtype=torch.int64).scatter_add_(2, group_MLX, quota_MLX).view(M, L, N, E)
    local_MLNE = torch.minimum(demand_MLNE, cap_MLNE)
    surplus_MLNE, deficit_MLNE = demand_MLNE - local_MLNE, cap_MLNE - local_MLNE
    if not bool(surplus_MLNE.any()) and not bool(deficit_MLNE.any()):
        # every node's instances take exactly its own tokens (always on one node, where the
        # quotas sum to the loads): nothing crosses nodes, so steps 1-3 move nothing and the
        # split is step 4's matching of each node's sources to its instances alone
        return (_matching(loads_MLSE, quota_MLX, group_MLX, e_MLX, node_S, node_X, N, True)
                * valid_MLX.unsqueeze(2)).view(M, L, S, G, J)

    # Sources: surplus shares in proportion to tokens (cumulative over the node's ranks).
    cum_MLSE = loads_MLSE.view(M, L, N, g, E).cumsum(3).view(M, L, S, E)
    remote_MLSE = _cum_floor(loads_MLSE, cum_MLSE, demand_MLNE[:, :, node_S], surplus_MLNE[:, :, node_S])
    keep_MLSE = loads_MLSE - remote_MLSE

    # Instances: deficit shares in proportion to quota (cumulative over the group's slots in slot order)
    cum_in_group_MLX = _cum_in_group(quota_MLX, group_MLX, N * E)
    cap_X = cap_MLNE.view(M, L, N * E).gather(2, group_MLX)
    deficit_X = deficit_MLNE.view(M, L, N * E).gather(2, group_MLX)
    take_remote_MLX = _cum_floor(quota_MLX, cum_in_group_MLX, cap_X, deficit_X)
    take_remote_MLX = _even_receive(take_remote_MLX, quota_MLX, e_MLX, valid_MLX, topo)
    take_local_MLX = quota_MLX - take_remote_MLX

    split_MLSX = (_matching(keep_MLSE, take_local_MLX, group_MLX, e_MLX, node_S, node_X, N, True)
                  + _matching(remote_MLSE, take_remote_MLX, group_MLX, e_MLX, node_S, node_X, N, False))
    split_MLSX = split_MLSX * valid_MLX.unsqueeze(2)
    return split_MLSX.view(M, L, S, G, J)


def _cum_in_group(amount_MLX: torch.Tensor, group_MLX: torch.Tensor, groups: int) -> torch.Tensor:
    """int64 ``[M, L, X]``: each slot's ``amount_MLX`` summed over the slots of its group
    (``group_MLX``, ``0..groups-1``) up to and including itself, in slot order."""
    M, L, X = amount_MLX.shape
    order = (group_MLX * X + torch.arange(X)).argsort(dim=2)   # a group's slots contiguous, in slot order
    cum = amount_MLX.gather(2, order).cumsum(2)
    tot = torch.zeros(M, L, groups, dtype=torch.int64).scatter_add_(2, group_MLX, amount_MLX)
    cum = cum - (tot.cumsum(2) - tot).gather(2, group_MLX.gather(2, order))
    return torch.empty_like(cum).scatter_(2, order, cum)


def _matching(amount_MLSE: torch.Tensor, amount_MLX: torch.Tensor, group_MLX: torch.Tensor, e_MLX: torch.Tensor,
              node_S: torch.Tensor, node_X: torch.Tensor, N: int, same_node: bool) -> torch.Tensor:
    """int64 ``[M, L, S, X]``: :func:`token_split`'s step 4. Sources' amounts of each expert
    (``amount_MLSE``) laid end to end in rank order, its instances' amounts (``amount_MLX``) in
    slot order, each source sending to each instance the overlap of their intervals; with
    ``same_node`` within each node (the node's ranks against the node's slots of the expert,
    ``group_MLX`` = node * E + expert per slot), else across the whole cluster."""
    M, L, S, E = amount_MLSE.shape
    X, g = amount_MLX.shape[2], S // N
    # intervals: cumulative over ranks and over the expert's slots in slot order (within each node when same_node)
    src_end = amount_MLSE.view(M, L, N, g, E).cumsum(3).view(M, L, S, E) if same_node else amount_MLSE.cumsum(2)
    src_start = src_end - amount_MLSE
    dst_end = _cum_in_group(amount_MLX, group_MLX if same_node else e_MLX, N * E if same_node else E)
    dst_start = dst_end - amount_MLX
    idx = e_MLX.unsqueeze(2).expand(M, L, S, X)
    # the overlap of the source's and the instance's half-open intervals
    out = (torch.minimum(src_end.gather(3, idx), dst_end.unsqueeze(2))
           - torch.maximum(src_start.gather(3, idx), dst_start.unsqueeze(2))).clamp(min=0)
    if same_node and N > 1:
        out = out * (node_S.view(S, 1) == node_X.view(1, X))
    return out


def _even_receive(remote_MLX: torch.Tensor, quota_MLX: torch.Tensor, e_MLX: torch.Tensor,
                  valid_MLX: torch.Tensor, topo: Topology) -> torch.Tensor:
    """Move cross-node tokens between instances of one expert inside a node so that the
    node's busiest-receiving GPU receives less.

    Proportional deficit shares give every instance of an expert the same remote fraction,
    so a GPU whose experts the other nodes want receives more than its node-mates at equal
    load. Per round and (m, l, node): take the GPU with the most cross-node receive, and among
    the pairs (its instance ``x`` of expert ``e``, an instance ``y`` of ``e`` on another GPU of
    the node) move the largest ``t = min(remote_x, local_y, gap // 2)`` remote tokens from ``x``
    to ``y`` and as many local ones back (``gap``: the two GPUs' receive difference). Quotas,
    each (node, expert)'s remote total and the fewest-crossings property are unchanged; the
    node's maximum never rises and the sum of squared receives falls with every move, so it
    stops; ``g * J`` rounds bound the work (a few suffice in practice). Integer arithmetic
    and first-index ties: identical on every rank.

    Args:
        remote_MLX: int64 ``[M, L, X]`` cross-node tokens each slot receives (X = G * J).
        quota_MLX: int64 ``[M, L, X]`` slot quotas (0 for empty slots).
        e_MLX, valid_MLX: the slot's expert (clamped to >= 0) and whether it holds one.

    Returns:
        int64 ``[M, L, X]``: the new cross-node tokens per slot.
    """
    M, L, X = remote_MLX.shape
    G, J, g, N, E = topo.num_gpus, topo.slots_per_gpu, topo.gpus_per_node, topo.num_nodes, topo.num_experts
    if g < 2 or N < 2 or M * L == 0:
        return remote_MLX
    gpu_X = torch.arange(X) // J
    # slot of expert e on GPU q, -1 if none (column E collects empty slots and stays -1)
    inst_MLQ = torch.full((M, L, G * (E + 1)), -1, dtype=torch.int64)
    key_MLX = gpu_X * (E + 1) + torch.where(valid_MLX, e_MLX, E)
    inst_MLQ.scatter_(2, key_MLX, torch.arange(X).expand(M, L, X).contiguous())
    inst_MLQ.view(M, L, G, E + 1)[..., E] = -1
    # the rounds in numpy: integers only (the same values), with torch's per-call cost on
    # these small tensors most of the split's time; rows (m, l) flattened, R = M L
    R, P = M * L, M * L * N
    remote = remote_MLX.clone()
    remote_n = remote.view(R, X).numpy()
    quota_n, e_n = quota_MLX.reshape(R, X).numpy(), torch.where(valid_MLX, e_MLX, E).reshape(R, X).numpy()
    inst_n = inst_MLQ.view(-1).numpy()
    row_X = (np.arange(R) * X).reshape(R, 1)                 # flat offset of each row's slots
    row_Q = (np.arange(R) * (G * (E + 1))).reshape(R, 1, 1, 1)
    node_gpus_N1g = (np.arange(N).reshape(N, 1) * g + np.arange(g)).reshape(N, 1, g) * (E + 1)
    node_base_N = np.arange(N) * g
    rows_P = np.arange(P)
    base_P = np.repeat(np.arange(R) * X, N)
    for _ in range(g * J):
        recv_RNg = remote_n.reshape(R, N, g, J).sum(-1)          # each GPU's slots are contiguous
        hi_RN = recv_RNg.argmax(-1)                                        # busiest GPU (local index)
        xs_RNJ = ((node_base_N + hi_RN)[..., None]) * J + np.arange(J)
        xs = xs_RNJ.reshape(R, N * J)
        e_hi = e_n.reshape(-1)[row_X + xs].reshape(R, N, J, 1)
        ys_RNJg = inst_n[row_Q + node_gpus_N1g + e_hi]                     # [R, N, J, g]
        ys = np.maximum(ys_RNJg, 0).reshape(R, -1)
        local_y = (quota_n.reshape(-1)[row_X + ys] - remote_n.reshape(-1)[row_X + ys]).reshape(R, N, J, g)
        gap_RNg = (np.take_along_axis(recv_RNg, hi_RN[..., None], -1) - recv_RNg) // 2
        t_RNJg = np.minimum(np.minimum(remote_n.reshape(-1)[row_X + xs].reshape(R, N, J, 1), local_y),
                            gap_RNg[:, :, None, :])
        t_PW = np.maximum(np.where(ys_RNJg >= 0, t_RNJg, 0), 0).reshape(P, J * g)
        best_P = t_PW.argmax(1)
        t_P = t_PW[rows_P, best_P]
        if not (t_P > 0).any():
            break
        # the rows that move: each in its own (m, l, node) slot set, so no slot twice (a
        # fancy-indexed += keeps one write per slot); a move's y holds an instance
        move = t_P > 0
        at_P, best, t = base_P[move], best_P[move], t_P[move]
        flat = remote_n.reshape(-1)
        flat[at_P + xs_RNJ.reshape(P, J)[move, best // g]] -= t
        flat[at_P + ys_RNJg.reshape(P, J * g)[move, best]] += t
    return remote


def _fail(msg: str) -> None:
    raise ValueError(f"invalid step plan: {msg}")


def validate_plan(plan: StepPlan, loads_MLSE: torch.Tensor | None = None,
                  intra_node_replicas: bool = False) -> None:
    """Check a plan's invariants; raise ``ValueError`` naming the first violation.

    Checks: shapes and dtypes match the topology; the placement is a bijection onto the
    ``E`` native slots; native slots ``j < El`` hold the GPU's native experts or are
    overridden consistently (any expert, but at most one instance of an expert per GPU);
    every expert has at least one instance; empty slots carry no tokens; quotas are
    non-negative; with ``loads_MLSE``, every expert's quotas sum to its load. With
    ``intra_node_replicas``, every slot holding an expert not owned by its GPU lies in the
    owner's node (relibra's replication rule), and native slots hold the native experts.
    """
    topo = plan.topology
    L, E = plan.placement_LE.shape if plan.placement_LE.dim() == 2 else (None, None)
    if plan.placement_LE.dim() != 2 or E != topo.num_experts:
        _fail(f"placement_LE has shape {tuple(plan.placement_LE.shape)}, expected [L, {topo.num_experts}]")
    G, J, El = topo.num_gpus, topo.slots_per_gpu, topo.experts_per_gpu
    for name in ("placement_LE", "slot_expert_MLGJ", "slot_tokens_MLGJ"):
        t = getattr(plan, name)
        if t.dtype != torch.int64:
            _fail(f"{name} has dtype {t.dtype}, expected torch.int64")
    if plan.slot_expert_MLGJ.dim() != 4 or tuple(plan.slot_expert_MLGJ.shape[1:]) != (L, G, J):
        _fail(f"slot_expert_MLGJ has shape {tuple(plan.slot_expert_MLGJ.shape)}, expected [M, {L}, {G}, {J}]")
    if plan.slot_tokens_MLGJ.shape != plan.slot_expert_MLGJ.shape:
        _fail(f"slot_tokens_MLGJ has shape {tuple(plan.slot_tokens_MLGJ.shape)}, expected "
              f"{tuple(plan.slot_expert_MLGJ.shape)}")
    sorted_LE = plan.placement_LE.sort(dim=1).values
    if not torch.equal(sorted_LE, torch.arange(E).expand(L, E)):
        bad = int((sorted_LE != torch.arange(E)).any(dim=1).nonzero()[0])
        _fail(f"placement_LE[{bad}] is not a permutation of 0..{E - 1}")
    M = plan.slot_expert_MLGJ.shape[0]
    se = plan.slot_expert_MLGJ
    if (se < -1).any() or (se >= E).any():
        _fail(f"slot_expert_MLGJ has values outside [-1, {E - 1}]")
    if (plan.slot_tokens_MLGJ < 0).any():
        _fail("slot_tokens_MLGJ has negative quotas")
    if ((se < 0) & (plan.slot_tokens_MLGJ != 0)).any():
        _fail("an empty slot (-1) carries tokens")
    check_relays(plan.relay_MLGg, (M, L), topo)
    # At most one instance of an expert per GPU: sort each GPU's slots and look for repeats.
    s_sorted = se.sort(dim=-1).values
    dup = (s_sorted[..., 1:] == s_sorted[..., :-1]) & (s_sorted[..., 1:] >= 0)
    if dup.any():
        m, l, g, _ = dup.nonzero()[0].tolist()
        _fail(f"micro-batch {m}, layer {l}: GPU {g} holds two instances of one expert")
    count_MLE = torch.zeros(M, L, E + 1, dtype=torch.int64)
    count_MLE.scatter_add_(2, (se + 1).view(M, L, G * J), torch.ones_like(se).view(M, L, G * J))
    if (count_MLE[..., 1:] == 0).any():
        m, l, e = (count_MLE[..., 1:] == 0).nonzero()[0].tolist()
        _fail(f"micro-batch {m}, layer {l}: expert {e} has no instance")
    if intra_node_replicas:
        native_LGl = plan.native_experts_LGl()
        if not torch.equal(se[..., :El], native_LGl.expand(M, L, G, El)):
            _fail("native slots (j < experts_per_gpu) do not hold the placement's experts")
        owner_node_LE = plan.owner_gpu_LE() // topo.gpus_per_node
        rep = se[..., El:]
        owner_node = owner_node_LE.unsqueeze(0).unsqueeze(2).expand(M, L, G, E).gather(
            3, rep.clamp(min=0))
        slot_node = topo.node_of_gpu().view(1, 1, G, 1)
        if ((rep >= 0) & (owner_node != slot_node)).any():
            _fail("a replica slot holds an expert owned by another node")
    if loads_MLSE is not None:
        if loads_MLSE.dim() != 4 or tuple(loads_MLSE.shape) != (M, L, G, E):
            _fail(f"loads_MLSE has shape {tuple(loads_MLSE.shape)}, expected [{M}, {L}, {G}, {E}]")
        quota_MLE = torch.zeros(M, L, E + 1, dtype=torch.int64)
        quota_MLE.scatter_add_(2, (se + 1).view(M, L, G * J), plan.slot_tokens_MLGJ.view(M, L, G * J))
        load_MLE = loads_MLSE.to(torch.int64).sum(2)
        if not torch.equal(quota_MLE[..., 1:], load_MLE):
            m, l, e = (quota_MLE[..., 1:] != load_MLE).nonzero()[0].tolist()
            _fail(f"micro-batch {m}, layer {l}, expert {e}: slot quotas sum to "
                  f"{int(quota_MLE[m, l, e + 1])} but the expert's load is {int(load_MLE[m, l, e])}")


def plan_digest(plan: StepPlan) -> str:
    """A short hash of the plan's tensors, for cross-rank agreement checks."""
    h = hashlib.sha256()
    h.update(repr(plan.topology).encode())
    relay = () if plan.relay_MLGg is None else (plan.relay_MLGg,)
    for t in (plan.placement_LE, plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ, *relay):
        h.update(str(tuple(t.shape)).encode())
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
