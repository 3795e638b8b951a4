"""Reordering without replica slots (``R = 0``) and with one expert per GPU weighs no load
term (``relibra.reorder``'s ``term_LME``): the swap scores equal a brute-force swap, and the
busiest GPU, which that term would stand for, is the same under every assignment."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology
from relibra_torch.planning.relibra import reorder
from relibra_torch.planning.reorder_traffic import swap_candidates, swap_node_terms, swap_pairs


def _node_loads(node_LE, load_LME, N):
    return torch.bmm(load_LME, torch.nn.functional.one_hot(node_LE, N).to(torch.int64))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([2, 3, 4]), per_node=st.integers(1, 5),
       M=st.integers(1, 3), high=st.sampled_from([1, 5, 1000]))
def test_swap_terms_equal_a_brute_force_swap(seed, N, per_node, M, high):
    gen = torch.Generator().manual_seed(seed)
    L, E = 2, N * per_node
    load_LME = torch.randint(0, high + 1, (L, M, E), generator=gen)
    node_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)]) // per_node
    per_side = max(per_node // 2, 1)
    cand_LX = swap_candidates(node_LE, load_LME.sum(1), N, per_side)
    pairs = swap_pairs(N, 2 * per_side)
    got = swap_node_terms(_node_loads(node_LE, load_LME, N), load_LME, cand_LX, pairs).reshape(L, M, -1)
    for l in range(L):
        for w in range(pairs.pos_a_W.numel()):
            a, b = int(cand_LX[l, pairs.pos_a_W[w]]), int(cand_LX[l, pairs.pos_b_W[w]])
            na, nb = int(pairs.na_W[w]), int(pairs.nb_W[w])
            swapped = node_LE[l:l + 1].clone()
            swapped[0, a], swapped[0, b] = nb, na
            nl = _node_loads(swapped, load_LME[l:l + 1], N)[0]
            assert torch.equal(got[l, :, w], torch.maximum(nl[:, na], nl[:, nb])), (l, w)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([2, 4]), g=st.sampled_from([2, 4]), M=st.integers(1, 4))
def test_with_one_expert_per_gpu_the_busiest_gpu_is_the_same_under_every_assignment(seed, N, g, M):
    """Why the load term is dropped: every placement of ``G`` experts on ``G`` GPUs has the
    largest expert as its busiest GPU, micro-batch by micro-batch."""
    gen = torch.Generator().manual_seed(seed)
    E = N * g
    load_ME = torch.randint(0, 1000, (M, E), generator=gen)
    for _ in range(5):
        gpu_E = torch.randperm(E, generator=gen)
        busiest_M = torch.zeros(M, E, dtype=torch.int64).scatter_add_(1, gpu_E.expand(M, E), load_ME).amax(1)
        assert torch.equal(busiest_M, load_ME.amax(1))


def test_one_expert_per_gpu_at_r0_moves_only_for_the_all_to_all():
    """2 x 2 GPUs, 4 experts, R = 0, flat dispatch; every source sends the same to every expert,
    so no placement changes the all-to-all or the busiest GPU: relibra keeps static (a load
    term would swap the two hot experts apart to even the node loads, for nothing)."""
    topo = Topology(2, 2, 4, 0)
    loads_MLSE = torch.zeros(2, 1, 4, 4, dtype=torch.int64)
    for e, t in enumerate((2000, 1500, 250, 200)):
        loads_MLSE[:, 0, :, e] = t
    cfg = ReLibraConfig(compute_s_per_token=5.7e-8, cross_node_s_per_token=3.3e-7, migration_s_per_expert=1e-4,
                        traffic_search=False)
    assert (reorder(loads_MLSE, topo, topo.static_placement(1), cfg) // 2).tolist() == [[0, 0, 1, 1]]
