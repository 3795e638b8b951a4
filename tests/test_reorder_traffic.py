"""Reordering's traffic search: each node's cross-node send and receive after traffic replicas."""

import itertools

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology, relibra_plan, validate_plan
from relibra_torch.planning.reorder_traffic import traffic_objective, traffic_swap_search

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw, even_nodes=False):
    """Node assignment, loads ``own [L, M, N, E]`` and a priced config."""
    N = draw(st.integers(2, 3))
    g = draw(st.integers(1, 2))
    per_node = draw(st.sampled_from([2, 4])) if even_nodes else draw(st.integers(1, 5))
    E, L, M = N * per_node, draw(st.integers(1, 2)), draw(st.integers(1, 3))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    skew = draw(st.sampled_from([1.0, 4.0]))
    own_LMNE = (torch.rand(L, M, N, E, generator=gen) ** skew * 60).long()
    node_LE = torch.stack([torch.randperm(E, generator=gen) // per_node for _ in range(L)])
    prev_LE = torch.stack([torch.randperm(E, generator=gen) // per_node for _ in range(L)])
    config = ReLibraConfig(compute_s_per_token=draw(st.sampled_from([0.0, 5.7e-8])),
                           cross_node_s_per_token=3.3e-7,
                           migration_s_per_expert=draw(st.sampled_from([0.0, 1e-6, 1.3e-3])),
                           cross_replica_fill_s_per_expert=draw(st.sampled_from([0.0, 4e-6])),
                           swap_candidates=8)
    return node_LE, own_LMNE, prev_LE, config, g


@SETTINGS
@given(problems(even_nodes=True))
def test_without_replicas_the_search_ends_where_no_swap_helps(problem):
    """With no traffic replicas the vectorised swap scores are exact: when every expert is a
    candidate (per node 2 * swap_candidates or fewer), the result is a local optimum of
    :func:`traffic_objective` under every swap, checked by brute force, and never worse than
    the start."""
    node_LE, own_LMNE, prev_LE, config, g = problem
    load_LME = own_LMNE.sum(2)
    out_LE = traffic_swap_search(node_LE, load_LME, own_LMNE, prev_LE, config, g, 0)
    objective = lambda n: traffic_objective(n, load_LME, own_LMNE, prev_LE, config, g, 0)  # noqa: E731
    start_L, end_L = objective(node_LE), objective(out_LE)
    assert (end_L <= start_L + 1e-15).all()
    L, E = node_LE.shape
    for a, b in itertools.combinations(range(E), 2):
        swapped = out_LE.clone()
        swapped[:, a], swapped[:, b] = out_LE[:, b], out_LE[:, a]
        assert (objective(swapped) >= end_L * (1 - 1e-9) - 1e-15).all(), (a, b)


@SETTINGS
@given(problems(), st.integers(0, 2), st.booleans())
def test_the_search_never_raises_its_objective_and_keeps_node_sizes(problem, slots, with_pairs):
    node_LE, own_LMNE, prev_LE, config, g = problem
    load_LME = own_LMNE.sum(2)
    L, M, N, E = own_LMNE.shape
    pairs_LEE, coloc_w = None, 0.0
    if with_pairs:
        pairs_LEE = torch.randint(0, 30, (L, E, E), generator=torch.Generator().manual_seed(E))
        pairs_LEE = (pairs_LEE + pairs_LEE.transpose(1, 2)) * (1 - torch.eye(E, dtype=torch.int64))
        coloc_w = 1e-8
    args = (load_LME, own_LMNE, prev_LE, config, g, slots, pairs_LEE, coloc_w)
    out_LE = traffic_swap_search(node_LE, *args)
    assert (traffic_objective(out_LE, *args) <= traffic_objective(node_LE, *args) + 1e-15).all()
    assert torch.equal(torch.nn.functional.one_hot(out_LE, N).sum(1), torch.nn.functional.one_hot(node_LE, N).sum(1))
    assert torch.equal(out_LE, traffic_swap_search(node_LE.clone(), *args))     # deterministic


def test_experts_move_to_the_node_whose_tokens_would_otherwise_cross():
    """Two nodes of one GPU, four experts, no traffic replicas. Node 0's sources want experts
    2 and 3 (on node 1), node 1's want 0 and 1 (on node 0): every token crosses, 20 each way.
    Loads are equal, so a load-only objective is indifferent; the traffic search swaps the
    pairs and every token stays home. When a migration costs more than the traffic saved,
    nothing moves."""
    own_LMNE = torch.zeros(1, 2, 2, 4, dtype=torch.int64)
    own_LMNE[0, :, 0, 2:] = 10
    own_LMNE[0, :, 1, :2] = 10
    node_LE = torch.tensor([[0, 0, 1, 1]])
    cheap = ReLibraConfig(compute_s_per_token=0.0, migration_s_per_expert=0.0)
    args = (own_LMNE.sum(2), own_LMNE, node_LE, cheap, 1, 0)
    out = traffic_swap_search(node_LE, *args)
    assert out.tolist() == [[1, 1, 0, 0]]
    assert float(traffic_objective(out, *args)) == 0.0 < float(traffic_objective(node_LE, *args))
    # 2 micro-batches x 20 tokens x 3.3e-7 s: moving even one expert (1 s) does not pay
    dear = ReLibraConfig(compute_s_per_token=0.0, migration_s_per_expert=1.0)
    assert torch.equal(traffic_swap_search(node_LE, own_LMNE.sum(2), own_LMNE, node_LE, dear, 1, 0), node_LE)


def test_relibra_plans_stay_valid_with_the_traffic_search():
    """The whole planner on a skewed 2-node problem: a valid plan, deterministic."""
    topo = Topology(2, 2, 8, 2)
    gen = torch.Generator().manual_seed(3)
    loads = (torch.rand(3, 2, 4, 8, generator=gen) ** 4 * 300).long()
    config = ReLibraConfig(cross_replica_fill_s_per_expert=4e-6)
    plan = relibra_plan(loads, topo, config=config)
    validate_plan(plan, loads)
    again = relibra_plan(loads.clone(), topo, config=config)
    assert torch.equal(plan.placement_LE, again.placement_LE)


def test_modelled_replicas_break_ties_toward_lower_ids_like_the_traffic_planner():
    """Node 1's sources want experts 0-7 (node 0) 5 tokens each, expert k in micro-batch k
    only: equal step demand, one traffic slot (g = 1, r = 1). Like the traffic planner's
    stable sort, the model replicates expert 0, so micro-batch 0, where node 0 also sends
    6 residual tokens to node 1, costs 6 and every other micro-batch 5: 41 token-times
    (any other choice would give 36)."""
    own_LMNE = torch.zeros(1, 8, 2, 10, dtype=torch.int64)
    for k in range(8):
        own_LMNE[0, k, 1, k] = 5
    own_LMNE[0, 0, 0, 8:] = 6                     # node 0 wants experts 8 and 9 (node 1): 8 is replicated
    node_LE = torch.tensor([[0] * 8 + [1] * 2])
    config = ReLibraConfig(compute_s_per_token=0.0, cross_node_s_per_token=1.0, migration_s_per_expert=0.0)
    objective = traffic_objective(node_LE, own_LMNE.sum(2), own_LMNE, node_LE, config, 1, 1)
    assert float(objective) == 41.0


def test_a_swap_that_changes_nothing_is_not_taken_when_the_objective_is_negative():
    """With co-activation the objective can be negative; a swap of two idle experts (no
    tokens, no pairs) is no improvement and must not be taken (with an odd round limit a
    back-and-forth would leave them swapped)."""
    own_LMNE = torch.zeros(1, 1, 2, 6, dtype=torch.int64)
    own_LMNE[0, 0, 0, [0, 4]] = 10
    own_LMNE[0, 0, 1, [2, 5]] = 10
    pairs_LEE = torch.zeros(1, 6, 6, dtype=torch.int64)
    pairs_LEE[0, 0, 4] = pairs_LEE[0, 4, 0] = pairs_LEE[0, 2, 5] = pairs_LEE[0, 5, 2] = 100
    node_LE = torch.tensor([[0, 0, 1, 1, 0, 1]])
    config = ReLibraConfig(migration_s_per_expert=0.0, max_swap_rounds=3)
    args = (own_LMNE.sum(2), own_LMNE, node_LE, config, 1, 0, pairs_LEE, 1e-7)
    assert float(traffic_objective(node_LE, *args)) < 0
    assert torch.equal(traffic_swap_search(node_LE, *args), node_LE)
