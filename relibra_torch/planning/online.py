"""Online per-micro-batch replication planners: what a run-time balancer decides from the
exact loads of each layer and micro-batch (no replay, no reordering).

Both start from the static placement (expert ``e`` owned by GPU ``e // El``, never moved)
and fill the ``R`` replica slots of each GPU anew for every micro-batch and layer, from
that micro-batch's exact per-expert loads. Tokens are then split between an expert's
instances by the project's one rule (:func:`relibra_torch.planning.token_split`), like
every other planner. Latency and weight traffic are paid by the cost model: planning on
the critical path of every layer (:attr:`OnlinePlanner.plan_latency_s`), replica fills and
gradient returns as for every system.

* ``online-node`` (MoonEP-like, github.com/MoonshotAI/MoonEP): replication inside each
  node only. Every GPU of the node gets the node's mean load as its target; repeatedly the
  most overloaded GPU (home) fills the roomiest GPU's whole deficit (the home may overshoot
  and become a receiver later); then each home hands its exports out, the largest
  remaining destination quota taking the home's expert with the most remaining tokens.
  MoonEP gives every GPU ``E / G`` prefetch slots so that a destination can hold experts
  of one home; here a destination has the project's ``R`` replica slots, and a quota that
  needs more slots than are free stays at home.
* ``online-global`` (UltraEP-like, github.com/Dots-Infra/UltraEP): quota replication
  anywhere in the EP group. A binary search finds the smallest per-GPU threshold ``T`` for
  which a greedy export succeeds: sources in decreasing load, each source's experts in
  decreasing load, each export to the GPU with the most slack (a free slot, not holding
  the expert, taking at least ``min_replica_tokens``), of ``min(need, slack, available)``
  tokens, the owner keeping at least one token. UltraEP confines replication to the NVLink
  domain, which on rack-scale nodes is the whole EP group; on 8-GPU nodes the fills of
  this planner cross nodes and the cost model prices them at inter-node bandwidth.

Vectorised over every (micro-batch, layer[, node]) at once; integer arithmetic only, so
the same loads give the same plan on any machine.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, N nodes,
g GPUs per node, El native experts per GPU, R replica slots per GPU, J = El + R,
B batched problems, D GPUs of one balancing domain, K = D * El experts of a domain.
"""

from __future__ import annotations

import torch

from ..checks import check_choice, check_int, check_number
from .base import Planner, check_loads
from .plan import StepPlan
from .topology import Topology

__all__ = ["ONLINE_SCOPES", "OnlinePlanner", "online_global_plan", "online_node_plan"]

ONLINE_SCOPES = ("node", "global")

# UltraEP's ULTRA_EP_QUOTA_MIN_TOKENS_PER_REPLICA default (README, "Replication planning").
DEFAULT_MIN_REPLICA_TOKENS = 1024


def _domain_loads(loads_MLSE: torch.Tensor, topology: Topology, D: int) -> torch.Tensor:
    """int64 ``[B, D, El]`` native loads of each domain of ``D`` GPUs under static placement."""
    M, L, _, E = loads_MLSE.shape
    El = topology.experts_per_gpu
    load_MLE = loads_MLSE.to(torch.int64).sum(2)
    return load_MLE.reshape(M * L * (topology.num_gpus // D), D, El)


def _to_plan(loads_MLSE: torch.Tensor, topology: Topology, native_left_BDl: torch.Tensor,
             rep_expert_BDR: torch.Tensor, rep_quota_BDR: torch.Tensor, name: str) -> StepPlan:
    """Assemble a :class:`StepPlan` from per-domain results (replica experts domain-local)."""
    M, L, _, E = loads_MLSE.shape
    G, El, R, J = topology.num_gpus, topology.experts_per_gpu, topology.replica_slots, topology.slots_per_gpu
    B, D, _ = native_left_BDl.shape
    offset_B1 = (torch.arange(B) % (G // D) * D * El).view(B, 1, 1)
    rep_global = torch.where(rep_expert_BDR >= 0, rep_expert_BDR + offset_B1, rep_expert_BDR)
    natives = torch.arange(E).view(1, G, El).expand(M * L, G, El).reshape(B, D, El)
    slot_expert = torch.cat([natives, rep_global[..., :R]], -1).reshape(M, L, G, J)
    slot_tokens = torch.cat([native_left_BDl, rep_quota_BDR[..., :R]], -1).reshape(M, L, G, J)
    placement_LE = topology.static_placement(L)
    return StepPlan(topology, placement_LE, slot_expert.contiguous(), slot_tokens.contiguous(), name,
                    placement_LE.clone())


def online_node_plan(loads_MLSE: torch.Tensor, topology: Topology, name: str = "online-node") -> StepPlan:
    """MoonEP-like per-micro-batch replication inside each node (see the module docstring)."""
    check_loads(loads_MLSE, topology)
    g, El, R = topology.gpus_per_node, topology.experts_per_gpu, topology.replica_slots
    load_Bgl = _domain_loads(loads_MLSE, topology, g)
    B = load_Bgl.shape[0]
    rows = torch.arange(B)
    rank_load = load_Bgl.sum(-1)
    total = rank_load.sum(-1, keepdim=True)
    target = total // g + (torch.arange(g) < total % g).to(torch.int64)       # node mean, exactly
    balance = rank_load - target
    # 1. receive quotas: the most overloaded home fills the roomiest receiver entirely
    z_Bgg = torch.zeros(B, g, g, dtype=torch.int64)                            # [home, dest]
    for _ in range(g):
        h, u = balance.argmax(-1), balance.argmin(-1)
        active = balance[rows, h] > 0
        if not active.any():
            break
        move = -balance[rows, u] * active
        z_Bgg[rows, h, u] += move
        balance[rows, h] -= move
        balance[rows, u] += move
    # 2. each home's quotas -> (expert, destination) segments, one replica slot each
    left = load_Bgl.clone()
    rep_expert = torch.full((B, g, max(R, 1)), -1, dtype=torch.int64)
    rep_quota = torch.zeros(B, g, max(R, 1), dtype=torch.int64)
    used = torch.zeros(B, g, dtype=torch.int64)
    for h in range(g):
        quota = z_Bgg[:, h].clone()
        for _ in range(g + El):                      # each round empties a quota or an expert
            d = quota.argmax(-1)
            q = quota[rows, d]
            if not (q > 0).any():
                break
            i = left[:, h].argmax(-1)
            rem = left[rows, h, i]
            blocked = (used[rows, d] >= R) | (rem == 0)          # no free slot / nothing left
            quota[rows, d] = torch.where(blocked, 0, q)          # that quota stays at home
            active = (q > 0) & ~blocked
            take = torch.minimum(rem, q) * active
            r, dd = rows[active], d[active]
            rep_expert[r, dd, used[r, dd]] = h * El + i[active]
            rep_quota[r, dd, used[r, dd]] = take[active]
            used[r, dd] += 1
            left[rows, h, i] -= take
            quota[rows, d] -= take
    return _to_plan(loads_MLSE, topology, left, rep_expert, rep_quota, name)


def _quota_oracle(load_BDl: torch.Tensor, threshold_B: torch.Tensor, R: int, min_tokens: int,
                  dynamic_floor: bool = False):
    """UltraEP's greedy export at per-GPU threshold ``T``.

    With ``dynamic_floor`` (UltraEP's fast path) an export must take at least
    ``ceil(need / candidate GPUs)`` tokens instead of ``min_tokens``.

    One flat loop for all rows: each row walks its (source, expert) pairs in order (sources
    in decreasing load, their experts in decreasing load) and makes at most one export per
    round, so the rounds are bounded by exports + pairs visited, not by ``D * El * D``. A
    source whose experts run out before its excess does makes the threshold infeasible.

    Returns:
        ``(feasible_B, rep_expert_BDR, rep_quota_BDR, exported_BK)``, experts domain-local.
    """
    B, D, El = load_BDl.shape
    K = D * El
    rows = torch.arange(B)
    load_BK = load_BDl.reshape(B, K)
    rank_load = load_BDl.sum(-1)
    threshold = threshold_B.unsqueeze(1)
    excess = (rank_load - threshold).clamp(min=0)
    slack = (threshold - rank_load).clamp(min=0)
    rep_expert = torch.full((B, D, max(R, 1)), -1, dtype=torch.int64)
    rep_quota = torch.zeros(B, D, max(R, 1), dtype=torch.int64)
    used = torch.zeros(B, D, dtype=torch.int64)
    exported = torch.zeros(B, K, dtype=torch.int64)
    src_order = rank_load.argsort(dim=-1, descending=True, stable=True)
    # pair p = o * El + pos: the pos-th largest expert of the o-th largest source
    expert_BK = (src_order.unsqueeze(-1) * El + load_BDl.argsort(dim=-1, descending=True, stable=True)
                 .gather(1, src_order.unsqueeze(-1).expand(B, D, El))).reshape(B, K)
    need_BD = excess.gather(1, src_order)                      # per source, in walk order
    floor = max(min_tokens, 1)
    feasible = excess.sum(-1) <= slack.sum(-1)
    pair = torch.zeros(B, dtype=torch.int64)
    if R == 0:                                                 # no slot: only T >= every load works
        feasible &= need_BD[:, 0] == 0
    active = feasible & (need_BD[:, 0] > 0)
    need = need_BD[:, 0].clone()
    k = expert_BK[:, 0]
    avail = load_BK[rows, k] - (load_BK[rows, k] > 0).to(torch.int64)      # the owner keeps one
    gpu_D = torch.arange(D)
    while active.any():
        src = k // El
        holding = (rep_expert == k.view(B, 1, 1)).any(-1) | (gpu_D == src.unsqueeze(1))
        q_BD = torch.minimum(torch.minimum(need.unsqueeze(1), slack), avail.unsqueeze(1))
        if dynamic_floor:
            cand = (used < R) & ~holding & (q_BD > 0)
            count = cand.sum(-1).clamp(min=1)
            ok = cand & (q_BD >= ((need + count - 1) // count).clamp(min=1).unsqueeze(1))
        else:
            ok = (used < R) & ~holding & (q_BD >= floor)
        has = ok.any(-1) & active
        target = slack.masked_fill(~ok, -1).argmax(-1)          # most slack, lowest GPU on ties
        q = q_BD.gather(1, target.unsqueeze(1)).squeeze(1) * has
        r, t = rows[has], target[has]
        slot = used[r, t]
        rep_expert[r, t, slot] = k[has]
        rep_quota[r, t, slot] = q[has]
        used[r, t] += 1
        slack[rows, target] -= q
        exported[rows, k] += q
        need, avail = need - q, avail - q
        # advance: source satisfied -> next source; expert exhausted or no target -> next expert
        next_source = active & (need == 0)
        next_expert = active & ~next_source & (~has | (avail == 0))
        last_expert = pair % El == El - 1
        failed = next_expert & last_expert
        feasible &= ~failed
        o_next = torch.where(next_source, pair // El + 1, pair // El)
        pair = torch.where(next_source, o_next * El, torch.where(next_expert, pair + 1, pair))
        in_range = o_next < D
        new_need = need_BD.gather(1, o_next.clamp(max=D - 1).unsqueeze(1)).squeeze(1)
        active = active & ~failed & (~next_source | (in_range & (new_need > 0)))
        need = torch.where(next_source, new_need, need)
        moved = next_source | next_expert
        k = torch.where(moved, expert_BK.gather(1, pair.clamp(max=K - 1).unsqueeze(1)).squeeze(1), k)
        fresh = load_BK.gather(1, k.unsqueeze(1)).squeeze(1)
        avail = torch.where(moved, fresh - (fresh > 0).to(torch.int64), avail)
    return feasible, rep_expert, rep_quota, exported


def _threshold_search(load_BDl: torch.Tensor, R: int, min_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """UltraEP's search for the threshold ``T`` of every row (``placement.cu``, stage 1).

    1. Fast path: ``T = ceil(1.01 * ceil(mean))`` (``ULTRA_EP_QUOTA_ORACLE_EPS``), with the
       dynamic floor, retried twice at ``+ceil(max / 100)``.
    2. Otherwise, with the fixed floor: ``T = ceil(mean)``, then rounds of four probes
       spread over ``(lo, hi]`` (four warps), keeping the first feasible probe as ``hi``.
       ``hi`` starts at the busiest GPU's load, which is always feasible (no excess).

    Returns:
        ``(threshold_B, dynamic_B)``: the threshold and whether the fast path found it.
    """
    B, D, _ = load_BDl.shape
    rank_load = load_BDl.sum(-1)
    lo = (rank_load.sum(-1) + D - 1) // D
    hi = torch.maximum(rank_load.max(-1).values, lo)
    done = torch.zeros(B, dtype=torch.bool)
    threshold = torch.minimum((lo * 101 + 99) // 100, hi)
    step = ((hi + 99) // 100).clamp(min=1)
    for _ in range(3):
        rows = (~done).nonzero().flatten()
        if rows.numel() == 0:
            break
        ok = _quota_oracle(load_BDl[rows], threshold[rows], R, min_tokens, dynamic_floor=True)[0]
        done[rows[ok]] = True
        bad = rows[~ok]
        threshold[bad] = torch.minimum(hi[bad], threshold[bad] + step[bad])
    dynamic = done.clone()
    rows = (~done).nonzero().flatten()
    if rows.numel():
        ok = _quota_oracle(load_BDl[rows], lo[rows], R, min_tokens)[0]
        done[rows[ok]] = True
        threshold[rows[ok]] = lo[rows[ok]]
        lo[rows[~ok]] = torch.minimum(lo[rows[~ok]] + 1, hi[rows[~ok]])
    W = 4                                                       # UltraEP's QUOTA_SOLVER_WARPS
    while True:
        rows = (~done & (lo < hi)).nonzero().flatten()
        if rows.numel() == 0:
            break
        l, h = lo[rows], hi[rows]
        span = h - l
        w = torch.arange(W)
        small = (span <= W).unsqueeze(1)
        probes = torch.where(small, l.unsqueeze(1) + w, l.unsqueeze(1) + span.unsqueeze(1) * (w + 1) // (W + 1))
        valid = ~small | (probes < h.unsqueeze(1))
        n = rows.numel()
        ok = _quota_oracle(load_BDl[rows].repeat_interleave(W, 0), probes.flatten(), R,
                           min_tokens)[0].view(n, W) & valid
        first = ok.to(torch.int64).argmax(-1)
        has = ok.any(-1)
        pick = probes.gather(1, first.unsqueeze(1)).squeeze(1)
        prev = probes.gather(1, (first - 1).clamp(min=0).unsqueeze(1)).squeeze(1) + 1
        new_hi = torch.where(has, pick, h)
        new_lo = torch.where(has, torch.where(small.squeeze(1), pick, torch.where(first > 0, prev, l)),
                             torch.where(small.squeeze(1), h, probes[:, -1] + 1))
        hi[rows], lo[rows] = new_hi, torch.minimum(new_lo, new_hi)
    rest = ~done
    threshold[rest] = hi[rest]
    return threshold, dynamic


def online_global_plan(loads_MLSE: torch.Tensor, topology: Topology,
                       min_replica_tokens: int = DEFAULT_MIN_REPLICA_TOKENS,
                       name: str = "online-global") -> StepPlan:
    """UltraEP-like quota replication anywhere in the EP group (see the module docstring)."""
    check_loads(loads_MLSE, topology)
    check_int("min_replica_tokens", min_replica_tokens, 0)
    G, El, R = topology.num_gpus, topology.experts_per_gpu, topology.replica_slots
    load_BDl = _domain_loads(loads_MLSE, topology, G)
    threshold, dynamic = _threshold_search(load_BDl, R, min_replica_tokens)
    B = load_BDl.shape[0]
    rep_expert = torch.full((B, G, max(R, 1)), -1, dtype=torch.int64)
    rep_quota = torch.zeros(B, G, max(R, 1), dtype=torch.int64)
    exported = torch.zeros(B, G * El, dtype=torch.int64)
    for flag in (True, False):
        rows = (dynamic == flag).nonzero().flatten()
        if rows.numel():
            ok, rep_expert[rows], rep_quota[rows], exported[rows] = _quota_oracle(
                load_BDl[rows], threshold[rows], R, min_replica_tokens, dynamic_floor=flag)
            assert bool(ok.all()), "the threshold search returned an infeasible threshold"
    left = load_BDl - exported.view_as(load_BDl)
    return _to_plan(loads_MLSE, topology, left, rep_expert, rep_quota, name)


class OnlinePlanner(Planner):
    """A run-time balancer (``scope="node"``: online-node, ``"global"``: online-global).

    Stateless between steps (placement stays static). :attr:`plan_latency_s` is what the
    simulator charges on the critical path of every layer and micro-batch (forward; the
    backward reuses the plan).
    """

    def __init__(self, topology: Topology, scope: str = "global", plan_latency_s: float = 67e-6,
                 min_replica_tokens: int = DEFAULT_MIN_REPLICA_TOKENS):
        super().__init__(topology)
        self.scope = check_choice("scope", scope, ONLINE_SCOPES)
        self.plan_latency_s = check_number("plan_latency_s", plan_latency_s, 0.0)
        self.min_replica_tokens = check_int("min_replica_tokens", min_replica_tokens, 0)
        self.name = f"online-{scope}"

    def plan(self, loads_MLSE: torch.Tensor) -> StepPlan:
        if self.scope == "node":
            return online_node_plan(loads_MLSE, self.topology, self.name)
        return online_global_plan(loads_MLSE, self.topology, self.min_replica_tokens, self.name)
