"""Planner invariants (hypothesis), hand-checked examples and error messages.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _rank_fns
from relibra_torch.planning import (
    StepPlan,
    PLANNER_NAMES, EPLBPlanner, ReLibraConfig, ReLibraPlanner, Topology, balanced_packing,
    eplb_plan, evaluate, make_planner, online_global_plan, online_node_plan, plan_digest, relibra_plan,
    replicate, replicate_experts, static_plan, token_split, validate_plan,
)
from relibra_torch.planning.price import step_seconds
from relibra_torch.planning.relibra import reorder
from relibra_torch.testing import run_on_ranks

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    """A topology and loads ``[M, L, S, E]`` with skew, empty experts and empty ranks."""
    nodes = draw(st.integers(1, 3))
    gpus = draw(st.integers(1, 4))
    per_gpu = draw(st.integers(1, 3))
    replicas = draw(st.integers(0, 2))
    topo = Topology(nodes, gpus, nodes * gpus * per_gpu, replicas)
    M, L = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    seed = draw(st.integers(0, 2**31 - 1))
    shape = draw(st.sampled_from(["uniform", "skewed", "one_expert", "zeros"]))
    gen = torch.Generator().manual_seed(seed)
    G, E = topo.num_gpus, topo.num_experts
    if shape == "uniform":
        loads = torch.randint(0, 20, (M, L, G, E), generator=gen)
    elif shape == "skewed":
        loads = (torch.rand(M, L, G, E, generator=gen) ** 6 * 200).long()
    elif shape == "one_expert":
        loads = torch.zeros(M, L, G, E, dtype=torch.int64)
        loads[..., int(torch.randint(0, E, (1,), generator=gen))] = 37
    else:
        loads = torch.zeros(M, L, G, E, dtype=torch.int64)
    return topo, loads


def _plans(topo, loads):
    plans = {
        "static": static_plan(loads, topo),
        "eplb-oracle": eplb_plan(loads, topo, loads.double().sum((0, 2))),
        "eplb-oracle-instance": eplb_plan(loads, topo, loads.double().sum((0, 2)), split="instance"),
        "online-node": online_node_plan(loads, topo),
        "online-global": online_global_plan(loads, topo, min_replica_tokens=1),
        "relibra": relibra_plan(loads, topo),
        "relibra-no-reorder": relibra_plan(loads, topo, config=ReLibraConfig(reorder=False)),
        "relibra-intra": relibra_plan(loads, topo, config=ReLibraConfig(cross_node_replicas=False)),
        "relibra-priced": relibra_plan(loads, topo, config=PRICED),
    }
    return plans


# Qwen3-30B-A3B on H200: fills cost what they cost, so small loads make no replicas.
PRICED = ReLibraConfig(compute_s_per_token=4.8e-8, cross_node_s_per_token=3.6e-7,
                       replica_fill_s_per_expert=5.2e-5, cross_replica_fill_s_per_expert=4.2e-4)


def _check_split(plan, loads):
    """Every (source, expert) count is assigned exactly once, only to instances of it."""
    split_MLSGJ = token_split(plan, loads)
    M, L, S, E = loads.shape
    se = plan.slot_expert_MLGJ
    # tokens landing on a slot holding another expert (or an empty slot)
    per_expert = torch.zeros(M, L, S, E + 1, dtype=torch.int64)
    idx = (se + 1).view(M, L, 1, -1).expand(M, L, S, -1)
    per_expert.scatter_add_(3, idx, split_MLSGJ.view(M, L, S, -1))
    assert torch.equal(per_expert[..., 1:], loads)
    assert per_expert[..., 0].sum() == 0
    # receivers get exactly their quotas
    assert torch.equal(split_MLSGJ.sum(2), plan.slot_tokens_MLGJ)


@SETTINGS
@given(problems())
def test_every_planner_produces_a_valid_plan(problem):
    topo, loads = problem
    for name, plan in _plans(topo, loads).items():
        validate_plan(plan, loads, intra_node_replicas=name in ("static", "relibra-intra", "online-node"))
        _check_split(plan, loads)
        assert plan.slot_expert_MLGJ.shape[-1] == topo.experts_per_gpu + topo.replica_slots


@SETTINGS
@given(problems())
def test_planners_are_deterministic(problem):
    topo, loads = problem
    first = {k: plan_digest(p) for k, p in _plans(topo, loads).items()}
    second = {k: plan_digest(p) for k, p in _plans(topo, loads.clone()).items()}
    assert first == second


def test_a_copy_that_closes_the_gap_beats_one_that_moves_more_remote_tokens():
    """Found by the property test below in a clean-clone CI run: with one replica slot per
    GPU, node 0's busiest GPU gave expert 2 (228 tokens, 199 of them from the other node,
    which the greedy counts twice) instead of expert 1 (312 tokens, exactly its excess), and
    stayed 64 tokens above the node's balance, at a higher price in the planner's own terms."""
    topo = Topology(2, 2, 12, 1)
    loads = torch.tensor([[[[132, 136, 5, 0, 4, 2, 0, 64, 98, 0, 0, 127],
                            [2, 143, 24, 1, 3, 0, 0, 2, 185, 0, 0, 166],
                            [0, 29, 15, 7, 0, 0, 0, 0, 0, 0, 14, 0],
                            [0, 4, 184, 0, 6, 27, 37, 0, 0, 59, 0, 11]]]])
    plan = relibra_plan(loads, topo, config=ReLibraConfig(reorder=False, replica_fill_s_per_expert=0.0,
                                                          cross_node_replicas=False))
    assert evaluate(plan, loads).gpu_load_MLG.tolist() == [[[362, 362, 381, 382]]]


@SETTINGS
@given(problems())
def test_replication_never_raises_the_max_load(problem):
    """Under the same placement, relibra's intra-node replication never makes the busiest GPU
    busier than static's. (Cross-node traffic replicas trade compute for inter-node traffic,
    so they are off here: this is the balancing half's property.)"""
    topo, loads = problem
    static = evaluate(static_plan(loads, topo), loads).gpu_load_MLG.max(-1).values
    plan = relibra_plan(loads, topo, config=ReLibraConfig(reorder=False, replica_fill_s_per_expert=0.0,
                                                          cross_node_replicas=False))
    ours = evaluate(plan, loads)
    assert (ours.gpu_load_MLG.max(-1).values <= static).all()
    # with enough slots the node lower bound is reached exactly
    if topo.replica_slots >= 1 and topo.gpus_per_node <= 2:
        assert torch.equal(ours.gpu_load_MLG.max(-1).values, ours.node_lower_bound_ML)


@SETTINGS
@given(problems())
def test_reordering_never_worsens_its_balance_term(problem):
    """With only the balance term weighted, the chosen placement's summed busiest-node load
    is never above the previous (static) placement's."""
    topo, loads = problem
    cfg = ReLibraConfig(cross_node_s_per_token=0.0, migration_s_per_expert=0.0)
    placement = reorder(loads, topo, topo.static_placement(loads.shape[1]), cfg)
    g, El = topo.gpus_per_node, topo.experts_per_gpu

    def node_max_sum(placement_LE):
        node_LE = placement_LE // El // g
        onehot = torch.nn.functional.one_hot(node_LE, topo.num_nodes)
        return torch.einsum("mle,len->mln", loads.sum(2), onehot).max(-1).values.sum(0)

    assert (node_max_sum(placement) <= node_max_sum(topo.static_placement(loads.shape[1]))).all()


@SETTINGS
@given(problems())
def test_token_split_keeps_traffic_local_and_spreads_the_rest_evenly(problem):
    """Every planner's plan: cross-node tokens are the fewest the quotas allow, each node's
    surplus is shared by its sources in proportion to tokens, no instance receives more
    remote tokens than its quota, and every node's busiest GPU receives no more cross-node
    tokens than under proportional deficit shares (instance x of node n: quota_x * deficit_n
    / Q_n, floored cumulatively)."""
    topo, loads = problem
    N, g, J = topo.num_nodes, topo.gpus_per_node, topo.slots_per_gpu
    for name, plan in _plans(topo, loads).items():
        split = token_split(plan, loads)                                   # [M, L, S, G, J]
        M, L, S, E = loads.shape
        se = plan.slot_expert_MLGJ
        quota = plan.slot_tokens_MLGJ
        node_of_slot = (torch.arange(topo.num_gpus) // g).view(1, 1, 1, -1, 1)
        node_of_src = (torch.arange(S) // g).view(1, 1, -1, 1, 1)
        cross = split * (node_of_slot != node_of_src)
        for m in range(M):
            for l in range(L):
                proportional_G = torch.zeros(topo.num_gpus)
                for e in range(E):
                    inst = se[m, l] == e                                   # [G, J]
                    D = loads[m, l, :, e].view(N, g).sum(1)
                    Q = torch.stack([(quota[m, l] * inst).view(N, g, J)[n].sum() for n in range(N)])
                    fewest = int((D - Q).clamp(min=0).sum())
                    assert int((cross[m, l] * inst).sum()) == fewest, (name, m, l, e)
                    # surplus shares: source s of node n sends ~ tokens_s * surplus_n / D_n
                    sent = (cross[m, l] * inst).sum((1, 2))                 # [S]
                    for s_ in range(S):
                        n = s_ // g
                        share = int(loads[m, l, s_, e]) * int((D[n] - Q[n]).clamp(min=0)) / max(int(D[n]), 1)
                        assert abs(int(sent[s_]) - share) < 1.0 + 1e-9, (name, m, l, e, s_)
                    recv = (cross[m, l] * inst).sum(0)                     # [G, J]
                    assert (recv <= quota[m, l] * inst).all(), (name, m, l, e)
                    for gg, j in inst.nonzero().tolist():
                        n = gg // g
                        q = int(quota[m, l, gg, j])
                        proportional_G[gg] += q * int((Q[n] - D[n]).clamp(min=0)) / max(int(Q[n]), 1)
                recv_G = cross[m, l].sum((0, 2)).to(torch.float64)
                for n in range(N):
                    node = slice(n * g, (n + 1) * g)
                    # floors of the cumulative shares: within one token per instance
                    assert recv_G[node].max() <= proportional_G[node].max() + J + 1e-9, (name, m, l, n)


def _expert_2_on_both_gpus_of_node_1(expert_3):
    """2 nodes x 2 GPUs, 4 experts: expert 2 native on GPU 2 and replicated on GPU 3 (6 tokens
    each; sources send 5, 3, 1, 3 of its tokens), expert 3 on GPU 3 with ``expert_3`` tokens."""
    topo = Topology(2, 2, 4, 1)
    loads = torch.zeros(1, 1, 4, 4, dtype=torch.int64)
    loads[0, 0, :, 2] = torch.tensor([5, 3, 1, 3])
    loads[0, 0, :, 3] = torch.tensor(expert_3)
    plan = static_plan(loads, topo)
    plan.slot_expert_MLGJ[0, 0, 3, 1] = 2
    plan.slot_tokens_MLGJ[0, 0, 2, 0] = 6
    plan.slot_tokens_MLGJ[0, 0, 3, 1] = 6
    validate_plan(plan, loads, intra_node_replicas=True)
    return plan, loads


def test_token_split_evens_each_gpus_cross_node_receive():
    """Node 1 (GPUs 2, 3) holds expert 2 on GPU 2 and expert 3 on GPU 3, with a replica of
    expert 2 on GPU 3. Node 0 sends 8 tokens for expert 2 and 4 for expert 3; node 1 has
    4 of its own for expert 2. Proportional shares give GPU 2 four remote tokens of expert
    2 and GPU 3 four of expert 2 plus four of expert 3 (8 vs 4); evening moves two of
    expert 2's remote tokens to GPU 2 and two local ones back: 6 and 6."""
    plan, loads = _expert_2_on_both_gpus_of_node_1(expert_3=[2, 2, 0, 0])
    split = token_split(plan, loads)[0, 0]                                 # [S, G, J]
    _check_split(plan, loads)
    cross_recv_G = split[:2].sum((0, 2))                                   # node 0's sources
    assert cross_recv_G.tolist() == [0, 0, 6, 6]
    assert split[:2, 2, 0].sum() == 6 and split[:2, 3, 1].sum() == 2       # expert 2's remote
    assert split[2:, 2, 0].sum() == 0 and split[2:, 3, 1].sum() == 4       # its local tokens


def test_token_split_sends_remote_tokens_to_every_instance_in_proportion():
    """Expert 0 on node 1 (native on GPU 2, replica on GPU 3, 6 tokens each); node 0's
    sources have 8 of its tokens, node 1's 4: node 1 keeps its 4, each instance gets 4
    remote + 2 local (the rank-ordered rule gave the first instance all 6 remote ones)."""
    plan, loads = _expert_2_on_both_gpus_of_node_1(expert_3=[0, 0, 0, 0])
    split = token_split(plan, loads)[0, 0]                                 # [S, G, J]
    assert split[:2, 2, 0].sum() == 4 and split[:2, 3, 1].sum() == 4       # remote per instance
    assert split[2:, 2, 0].sum() == 2 and split[2:, 3, 1].sum() == 2       # local per instance
    assert split[:, :2].sum() == 0                                         # nothing stays on node 0


@SETTINGS
@given(problems())
def test_traffic_replicas_take_their_nodes_own_tokens_and_pay(problem):
    """Cross-node replicas (relibra's traffic slots): at most r per GPU, each holds an
    expert owned by another node with exactly its node's tokens for it, never two per node
    of one expert, and per (layer, node) the traffic they save beats their fills (one per
    residency)."""
    from relibra_torch.planning.traffic import traffic_replicas

    topo, loads = problem
    M, L, S, E = loads.shape
    N, g, El, R = topo.num_nodes, topo.gpus_per_node, topo.experts_per_gpu, topo.replica_slots
    placement = topo.static_placement(L)
    r = (R + 1) // 2
    token_s = 3.6e-7 / g
    fill_s = 40 * token_s  # a replica pays from 40 tokens kept home
    exp_MLGr, quota_MLGr = traffic_replicas(loads, topo, placement, r, token_s, fill_s)
    assert exp_MLGr.shape == (M, L, topo.num_gpus, r)
    demand_MLNE = loads.view(M, L, N, g, E).sum(3)
    owner_node_LE = placement // El // g
    for m, l, gpu, j in (exp_MLGr >= 0).nonzero().tolist():
        e, n = int(exp_MLGr[m, l, gpu, j]), gpu // g
        assert owner_node_LE[l, e] != n
        assert quota_MLGr[m, l, gpu, j] == demand_MLNE[m, l, n, e]
        assert int((exp_MLGr[m, l, n * g:(n + 1) * g] == e).sum()) == 1
    assert (quota_MLGr[exp_MLGr < 0] == 0).all()
    for l in range(L):
        for n in range(N):
            e_Mr = exp_MLGr[:, l, n * g:(n + 1) * g].reshape(M, -1)
            saved = float(quota_MLGr[:, l, n * g:(n + 1) * g].sum()) * token_s
            prev = torch.cat([torch.full_like(e_Mr[:1], -1), e_Mr[:-1]])
            fills = int(((e_Mr >= 0) & (e_Mr != prev)).sum())
            assert saved - fills * fill_s >= 0, (l, n, saved, fills)


@SETTINGS
@given(problems(), st.booleans())
def test_cross_node_copies_take_only_their_nodes_tokens_and_split_only_when_it_pays(problem, two_hop):
    """relibra priced: in a node that does not own expert e, e's copies together take at most
    the node's own tokens for e (none cross for it), and a second copy exists only when it
    takes enough tokens to pay for its fill: from the node's first copy over NVLink with
    ``two_hop`` (planning.two_hop; then the first copy keeps a token and covers the others,
    so one copy per node and expert crosses), else from the owner's node. A copy that keeps
    its slot all step is filled once, so the residency-priced plan lets it take the fill's
    worth over the step's M micro-batches (``min_cross_replica_tokens / M`` each), and keeps
    that plan only where the step price is lower."""
    topo, loads = problem
    cfg = dataclasses.replace(PRICED, replica_fill_s_per_expert=2e-7, cross_replica_fill_s_per_expert=2e-6,
                              two_hop=two_hop)
    plan = relibra_plan(loads, topo, config=cfg)
    if two_hop:
        res = evaluate(plan, loads).residency
        direct = res.held_MLGJ & res.cross_node_MLGJ & (res.hub_MLGJ < 0)
        M_, L_, G_, J_ = direct.shape
        key = torch.where(direct, plan.slot_expert_MLGJ, -1).view(M_, L_, topo.num_nodes, -1)
        srt = key.sort(-1).values
        assert not ((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)).any()   # one crossing per node
    validate_plan(plan, loads)
    M, L, S, E = loads.shape
    N, g, El = topo.num_nodes, topo.gpus_per_node, topo.experts_per_gpu
    demand_MLNE = loads.view(M, L, N, g, E).sum(3)
    owner_node_LE = plan.placement_LE // El // g
    se, st = plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ
    for m in range(M):
        for l in range(L):
            for n in range(N):
                node_se = se[m, l, n * g:(n + 1) * g].reshape(-1)
                node_st = st[m, l, n * g:(n + 1) * g].reshape(-1)
                for e in set(node_se.tolist()) - {-1}:
                    if owner_node_LE[l, e] == n:
                        continue
                    quotas = sorted(node_st[node_se == e].tolist())
                    assert sum(quotas) <= demand_MLNE[m, l, n, e]
                    if len(quotas) >= 2:   # at least the fill's worth shared by the step (balance.replicate_step's plan b)
                        assert all(q >= -(-cfg.min_cross_replica_tokens // M) for q in quotas[1:]), quotas


def test_traffic_replicas_keep_a_hot_remote_experts_tokens_home():
    """2 nodes x 2 GPUs, expert 0 owned on node 0 and chosen by every token of node 1: with
    cross-node replicas node 1 keeps its tokens (no cross-node traffic for expert 0), and the
    replica stays in its slot from one micro-batch to the next (one fill)."""
    topo = Topology(2, 2, 4, 2)
    loads = torch.zeros(2, 1, 4, 4, dtype=torch.int64)
    loads[:, 0, :, 0] = 3000            # every rank sends expert 0 3000 tokens
    loads[:, 0, :, 1:] = 10
    cfg = dataclasses.replace(PRICED, reorder=False)
    plan = relibra_plan(loads, topo, config=cfg)
    validate_plan(plan, loads)
    metrics = evaluate(plan, loads)
    no = relibra_plan(loads, topo, config=dataclasses.replace(cfg, cross_node_replicas=False))
    assert int(metrics.cross_send_MLG.sum()) < int(evaluate(no, loads).cross_send_MLG.sum())
    split = token_split(plan, loads)                                       # [M, L, S, G, J]
    holders = [(gpu, j) for gpu, j in (plan.slot_expert_MLGJ[0, 0] == 0).nonzero().tolist() if gpu >= 2]
    assert holders  # node 1 holds copies of expert 0 (the balancing may split the first one)
    for gpu, j in holders:  # resident in both micro-batches: filled once
        assert plan.slot_expert_MLGJ[1, 0, gpu, j] == 0 and not metrics.fill_start_MLGJ[1, 0, gpu, j]
    held = plan.slot_expert_MLGJ[:, 0, 2:] == 0                             # [M, 2, J] node 1's copies
    assert (split[:, 0, 2:, 2:] * held.unsqueeze(1)).sum() == 2 * 6000      # node 1 keeps its tokens
    assert (split[:, 0, :2, 2:] * held.unsqueeze(1)).sum() == 0             # node 0's never come over


def _node_matching_loop(plan, loads):
    """Step 4 of ``token_split`` alone, one (m, l, node, expert) at a time: the node's sources'
    tokens in rank order against the node's instances' quotas in slot order."""
    topo = plan.topology
    M, L, S, E = loads.shape
    G, J, g = topo.num_gpus, topo.slots_per_gpu, topo.gpus_per_node
    out = torch.zeros(M, L, S, G, J, dtype=torch.int64)
    for m in range(M):
        for l in range(L):
            for n in range(topo.num_nodes):
                for e in range(E):
                    src = [(s, int(loads[m, l, s, e])) for s in range(n * g, (n + 1) * g)]
                    dst = [(q, j, int(plan.slot_tokens_MLGJ[m, l, q, j])) for q in range(n * g, (n + 1) * g)
                           for j in range(J) if int(plan.slot_expert_MLGJ[m, l, q, j]) == e]
                    si = di = 0
                    while si < len(src) and di < len(dst):
                        (s, a), (q, j, b) = src[si], dst[di]
                        t = min(a, b)
                        out[m, l, s, q, j] += t
                        src[si], dst[di] = (s, a - t), (q, j, b - t)
                        si, di = si + (a == t), di + (b == t)
    return out


@SETTINGS
@given(problems())
def test_token_split_without_crossing_tokens_is_the_nodes_own_matching(problem):
    """Where every node's instances of an expert take exactly that node's tokens of it (always
    on one node), no token crosses nodes: the split is each node's sources matched to its
    instances in order (the rule's shortcut), as a loop over every (node, expert) gives it."""
    topo, loads = problem
    for name, plan in _plans(topo, loads).items():
        M, L, S, E = loads.shape
        g = topo.gpus_per_node
        node_X = torch.arange(topo.num_gpus * topo.slots_per_gpu) // (g * topo.slots_per_gpu)
        se = plan.slot_expert_MLGJ.reshape(M, L, -1)
        cap = torch.zeros(M, L, topo.num_nodes * (E + 1), dtype=torch.int64).scatter_add_(
            2, node_X * (E + 1) + (se + 1), plan.slot_tokens_MLGJ.reshape(M, L, -1)).view(M, L, -1, E + 1)[..., 1:]
        if torch.equal(cap, loads.view(M, L, topo.num_nodes, g, E).sum(3)):
            assert torch.equal(token_split(plan, loads), _node_matching_loop(plan, loads)), name


def test_token_split_spreads_a_nodes_spare_quota_over_its_instances():
    """Quotas above the node's demand (no token has to cross, but the instances can take more
    than there is): each instance takes the node's tokens less its share of the spare quota, in
    proportion to its quota (the rule's step 2), not the first instances filled to their quotas
    in slot order. Two instances of expert 0, quotas 4 and 4, one source with 4 tokens: 2 and 2."""
    topo = Topology(1, 2, 2, 1)
    loads = torch.tensor([[[[4, 0], [0, 0]]]])                          # [1, 1, 2, 2]
    plan = static_plan(loads, topo)
    plan.slot_expert_MLGJ[0, 0, 1, 1] = 0
    plan.slot_tokens_MLGJ[0, 0, 0, 0] = 4
    plan.slot_tokens_MLGJ[0, 0, 1, 1] = 4
    split = token_split(plan, loads)[0, 0]                              # [S, G, J]
    assert split[0, 0, 0] == 2 and split[0, 1, 1] == 2 and int(split.sum()) == 4


def test_token_split_matches_brute_force():
    topo = Topology(1, 2, 4, 1)
    loads = torch.tensor([[[[3, 0, 1, 2], [2, 5, 0, 0]]]])            # [1, 1, 2, 4]
    plan = static_plan(loads, topo)
    # put a replica of expert 1 on GPU 1 and give it 4 of expert 1's 5 tokens
    plan.slot_expert_MLGJ[0, 0, 1, 2] = 1
    plan.slot_tokens_MLGJ[0, 0, 0, 1] = 1
    plan.slot_tokens_MLGJ[0, 0, 1, 2] = 4
    validate_plan(plan, loads, intra_node_replicas=True)
    split = token_split(plan, loads)[0, 0]                              # [S, G, J]
    # expert 1: source 0 has 0 tokens, source 1 has 5; the native (GPU 0) takes the first
    # token of the stream, the replica the next 4.
    assert split[1, 0, 1] == 1 and split[1, 1, 2] == 4 and split[0, :, :].sum() == 6
    metrics = evaluate(plan, loads)
    assert metrics.gpu_load_MLG.tolist() == [[[6, 7]]]
    assert metrics.fill_MLGJ[0, 0, 1, 2] and metrics.fill_MLGJ.sum() == 1
    # source 1 (GPU 1) sends expert 0 (2 tokens) and 1 token of expert 1 to GPU 0
    assert metrics.intra_send_MLG.tolist() == [[[3, 3]]]


def test_replicate_hand_example():
    """One node of two GPUs, one native expert each, one replica slot: split 10/2 into 6/6."""
    topo = Topology(1, 2, 2, 1)
    loads = torch.tensor([[[[10, 2], [0, 0]]]])
    se, st_ = replicate(loads, topo, topo.static_placement(1))
    assert se.tolist() == [[[[0, -1], [1, 0]]]]
    assert st_.tolist() == [[[[6, 0], [2, 4]]]]


def test_replicate_copies_the_expert_that_also_carries_remote_tokens():
    """Node 0 (GPUs 0, 1) of two: GPU 0 holds expert 0 (10 tokens from node 0's own
    sources) and expert 1 (8 tokens, all from node 1); GPU 1 holds expert 2 (6 local
    tokens). Both experts can move the 6 tokens GPU 1 has room for; copying expert 1 (its
    tokens come from node 1) also moves them off GPU 0's inter-node receive: loads 12/12 and
    cross-node receive 2/6, where copying expert 0 would leave GPU 0 receiving all 8."""
    topo = Topology(2, 2, 8, 1)
    loads = torch.zeros(1, 1, 4, 8, dtype=torch.int64)
    loads[0, 0, 0, 0] = 10
    loads[0, 0, 2, 1] = 8
    loads[0, 0, 1, 2] = 6
    se, st_ = replicate(loads, topo, topo.static_placement(1))
    assert se[0, 0, 1, 2] == 1 and st_[0, 0, 1, 2] == 6                    # expert 1 copied to GPU 1
    assert st_[0, 0, :2].sum(-1).tolist() == [12, 12]
    plan = StepPlan(topo, topo.static_placement(1), se, st_)
    assert evaluate(plan, loads).cross_recv_MLG[0, 0, :2].tolist() == [2, 6]


def test_replicas_only_where_the_fill_pays():
    """A replica must take at least min_replica_tokens tokens; tiny micro-batches get none."""
    topo = Topology(1, 4, 8, 2)
    gen = torch.Generator().manual_seed(5)
    pop = torch.rand(8, generator=gen) ** 3
    big = torch.poisson((pop / pop.sum()).expand(2, 1, 4, 8) * 4000, generator=gen).long()
    tiny = torch.poisson((pop / pop.sum()).expand(2, 1, 4, 8) * 40, generator=gen).long()
    cfg = ReLibraConfig(reorder=False, replica_fill_s_per_expert=4.2e-5)
    threshold = cfg.min_replica_tokens
    assert threshold == 109  # ceil(4.2e-5 s fill / (5.7e-8 + 3.3e-7) s per token), flat across nodes
    # on one node (and under hierarchical dispatch) a moved token saves only its compute
    assert cfg.min_replica_tokens_on(1) == 737 == math.ceil(4.2e-5 / 5.7e-8)
    assert dataclasses.replace(cfg, dispatch="hierarchical").min_replica_tokens == 737
    threshold = cfg.min_replica_tokens_on(topo.num_nodes)
    El, place = topo.experts_per_gpu, topo.static_placement(1)
    for loads, expect_replicas in ((big, True), (tiny, False)):
        # the per-micro-batch rule: each copy takes a fill's worth of tokens
        se, st_ = replicate(loads, topo, place, threshold)
        assert ((st_[..., El:] >= threshold) | (se[..., El:] < 0)).all()
        assert bool((se[..., El:] >= 0).any()) == expect_replicas
        plan = relibra_plan(loads, topo, config=cfg)
        filled = plan.slot_expert_MLGJ[..., El:] >= 0
        assert bool(filled.any()) == expect_replicas
        # relibra also weighs step-long sets, whose copies keep their slots all step (one fill)
        # and whose quotas follow each micro-batch, at the step price: the copies it keeps pay
        # for their fills as a whole, against the per-micro-batch plan and against none
        per_mb = StepPlan(topo, place, se, st_, "relibra", place.clone())
        native = torch.arange(se.shape[-1]) < El
        none = StepPlan(topo, place, torch.where(native, se, -1), torch.where(native, loads.sum(2).gather(
            2, se.clamp(min=0).flatten(2)).view_as(se), 0), "relibra", place.clone())
        assert step_seconds(plan, loads, cfg) <= min(step_seconds(per_mb, loads, cfg),
                                                     step_seconds(none, loads, cfg)) * (1 + 1e-12)
    # free fills (the default): the tiny batch is balanced too
    free = relibra_plan(tiny, topo, config=ReLibraConfig(reorder=False))
    assert (free.slot_expert_MLGJ[..., topo.experts_per_gpu:] >= 0).any()


def test_eplb_building_blocks():
    w = torch.tensor([[9.0, 1.0, 5.0, 5.0, 3.0, 7.0]])
    pack, rank = balanced_packing(w, 2)
    assert torch.bincount(pack[0]).tolist() == [3, 3]
    # LPT: 9->p0, 7->p1, 5->p1, 5->p0, 3->p1, 1->p0 : packs 15 / 15
    sums = torch.zeros(2).scatter_add_(0, pack[0], w[0])
    assert sums.tolist() == [15.0, 15.0]
    assert sorted(rank[0, pack[0] == 0].tolist()) == [0, 1, 2]
    phy2log, count = replicate_experts(torch.tensor([[8.0, 1.0, 3.0]]), 5)
    assert phy2log.tolist() == [[0, 1, 2, 0, 0]] and count.tolist() == [[3, 1, 1]]


def test_eplb_planner_uses_history_and_oracle():
    topo = Topology(2, 2, 8, 1)
    gen = torch.Generator().manual_seed(0)
    loads = torch.randint(0, 5, (2, 1, 4, 8), generator=gen)
    loads[..., 3] += 100
    oracle = EPLBPlanner(topo, oracle=True).plan(loads)
    assert (oracle.slot_expert_MLGJ[0, 0] == 3).sum() > 1          # hot expert replicated
    hist = EPLBPlanner(topo)
    first = hist.plan(loads)                                           # uniform estimate
    assert (first.slot_expert_MLGJ[0, 0] == 3).sum() == 1
    hist.commit(first, loads)
    second = hist.plan(loads)
    assert (second.slot_expert_MLGJ[0, 0] == 3).sum() > 1


def test_relibra_balances_a_skewed_step():
    topo = Topology(2, 4, 16, 2)
    gen = torch.Generator().manual_seed(1)
    pop = torch.rand(16, generator=gen) ** 4
    loads = torch.poisson((pop / pop.sum()).expand(4, 2, 8, 16) * 400, generator=gen).long()
    static = evaluate(static_plan(loads, topo), loads).imbalance_ML.mean()
    # 3,200 tokens a micro-batch: moving an expert (1.3 ms at the default weights) costs
    # more than it saves, so the placement stays and only replication acts ...
    expensive = relibra_plan(loads, topo)
    assert torch.equal(expensive.placement_LE, topo.static_placement(2))
    # ... while cheap migration (and fills) let reordering balance the nodes too.
    cheap = relibra_plan(loads, topo, config=ReLibraConfig(migration_s_per_expert=1e-9,
                                                           replica_fill_s_per_expert=0.0))
    ours = evaluate(cheap, loads)
    assert static > 1.3 and ours.imbalance_ML.mean() < 1.05
    assert (ours.migrated_L > 0).all()


def test_planner_objects_advance_state():
    topo = Topology(2, 2, 8, 1)
    loads = torch.randint(0, 9, (2, 1, 4, 8), generator=torch.Generator().manual_seed(3))
    for name in PLANNER_NAMES:
        planner = make_planner(name, topo)
        plan = planner.plan(loads)
        planner.commit(plan, loads)
        assert torch.equal(planner.previous_placement(1), plan.placement_LE)
    relibra = ReLibraPlanner(topo)
    p1 = relibra.plan(loads)
    relibra.commit(p1, loads)
    p2 = relibra.plan(loads)
    assert torch.equal(p2.previous_placement_LE, p1.placement_LE)


def test_plans_identical_in_two_processes():
    digests = run_on_ranks(_rank_fns.relibra_plan_digest, 2)
    assert digests[0] == digests[1] == _rank_fns.relibra_plan_digest()


@pytest.mark.parametrize("bad, message", [
    (lambda: Topology(0, 2, 4), "num_nodes = 0; allowed: an int >= 1"),
    (lambda: Topology(2, 2, 6), "not divisible"),
    (lambda: Topology(1, 2, 4, -1), "replica_slots = -1; allowed: an int >= 0"),
    (lambda: static_plan(torch.zeros(1, 1, 3, 4, dtype=torch.int64), Topology(1, 2, 4)), r"loads_MLSE has S=3 source ranks; allowed: S = the topology's 2 GPUs"),
    (lambda: static_plan(-torch.ones(1, 1, 2, 4, dtype=torch.int64), Topology(1, 2, 4)), r"loads_MLSE\[0, 0, 0, 0\] = -1 is negative; allowed: counts >= 0"),
    (lambda: static_plan(torch.zeros(1, 1, 2, 4), Topology(1, 2, 4)), r"loads_MLSE has dtype float32; allowed: int32, int64"),
    (lambda: make_planner("bogus", Topology(1, 2, 4)), "allowed: static"),
])
def test_bad_input_names_the_problem(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        bad()


def test_validate_plan_catches_broken_plans():
    topo = Topology(2, 1, 2, 1)
    loads = torch.ones(1, 1, 2, 2, dtype=torch.int64)
    plan = static_plan(loads, topo)
    plan.slot_tokens_MLGJ[0, 0, 0, 0] += 1
    with pytest.raises(ValueError, match="quotas sum to 3"):
        validate_plan(plan, loads)
    plan = static_plan(loads, topo)
    plan.slot_expert_MLGJ[0, 0, 0, 1] = 1                                # replica from node 1
    with pytest.raises(ValueError, match="another node"):
        validate_plan(plan, loads, intra_node_replicas=True)
    plan.slot_expert_MLGJ[0, 0, 0, 1] = 0                                # duplicate on GPU 0
    with pytest.raises(ValueError, match="two instances"):
        validate_plan(plan, loads)


def test_hierarchical_reordering_puts_co_activated_experts_together():
    """Under hierarchical dispatch a token crosses to a remote node once, so experts chosen
    together belong on one node. Equal loads from every node (placement indifferent for
    load and flat traffic): with the step's pair counts the planner moves experts 0 and 2
    together and 1 and 3 together; flat dispatch, or no pair counts, keeps the placement."""
    from relibra_torch.planning.reorder_traffic import colocated_pairs
    from relibra_torch.replay.counts import count_pairs

    topo = Topology(2, 1, 4, 0)
    ids = torch.tensor([[0, 2], [1, 3]] * 50).view(100, 1, 2)              # tokens choose {0,2} or {1,3}
    pairs = count_pairs(ids, 4)
    assert pairs[0, 0, 2] == pairs[0, 2, 0] == 50 and pairs[0, 0, 1] == 0
    loads = torch.full((1, 1, 2, 4), 25, dtype=torch.int64)                # every node sends 25 to each
    cfg = ReLibraConfig(migration_s_per_expert=1e-9, dispatch="hierarchical", cross_node_replicas=False)
    plan = relibra_plan(loads, topo, config=cfg, pairs_LEE=pairs)
    node = plan.placement_LE[0] // topo.experts_per_gpu // topo.gpus_per_node
    assert node[0] == node[2] and node[1] == node[3] and node[0] != node[1]
    assert int(colocated_pairs(pairs, node.view(1, 4), 2)) == 100
    for other in (dataclasses.replace(cfg, dispatch="flat"), cfg):
        kept = relibra_plan(loads, topo, config=other, pairs_LEE=pairs if other.dispatch == "flat" else None)
        assert torch.equal(kept.placement_LE, topo.static_placement(1))


@SETTINGS
@given(problems(), st.integers(0, 2**31 - 1))
def test_count_pairs_matches_brute_force(problem, seed):
    from relibra_torch.replay.counts import count_pairs
    topo, _ = problem
    E = topo.num_experts
    gen = torch.Generator().manual_seed(seed)
    K = min(3, E)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(12)]).view(6, 2, K)
    ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1                  # pads in no pair
    want = torch.zeros(2, E, E, dtype=torch.int64)
    for t in range(6):
        for l in range(2):
            row = [int(v) for v in ids[t, l] if v >= 0]
            for a in row:
                for b in row:
                    if a != b:
                        want[l, a, b] += 1
    assert torch.equal(count_pairs(ids, E), want)


def test_relibra_on_one_gpu_plans_nothing_and_spends_no_guard():
    """With one GPU there is nothing to balance, move or copy: relibra returns every expert on
    its owner without running the guard or a search (a collapsed router included)."""
    from unittest import mock
    from relibra_torch.planning import relibra as relibra_module
    topo = Topology(1, 1, 8, 2)
    loads = torch.zeros(2, 3, 1, 8, dtype=torch.int64)
    loads[..., 0] = 900
    loads[..., 1:] = 10
    boom = mock.Mock(side_effect=AssertionError("planned on one GPU"))
    with mock.patch.object(relibra_module, "guarded_plan", boom), mock.patch.object(relibra_module, "_search", boom):
        plan = relibra_plan(loads, topo)
    validate_plan(plan, loads)
    assert not bool((plan.slot_expert_MLGJ[..., topo.experts_per_gpu:] >= 0).any())
    assert torch.equal(plan.placement_LE, topo.static_placement(3))
