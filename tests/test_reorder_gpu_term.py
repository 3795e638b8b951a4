"""Reordering without replica slots (``R = 0``) prices a node's busiest GPU, not its load
(``reorder_greedy.busiest_gpu_term``): the swap scores equal a brute-force swap."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning.reorder_greedy import busiest_gpu_term
from relibra_torch.planning.reorder_traffic import node_biggest, swap_candidates, swap_node_terms, swap_pairs


def _terms_LMN(node_LE, load_LME, N, g, gpu_term):
    nl_LMN = torch.bmm(load_LME, torch.nn.functional.one_hot(node_LE, N).to(torch.int64))
    if not gpu_term:
        return nl_LMN
    big_LMN = torch.zeros_like(nl_LMN).scatter_reduce_(2, node_LE.unsqueeze(1).expand_as(load_LME), load_LME, "amax")
    return busiest_gpu_term(nl_LMN, big_LMN, g)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([2, 3, 4]), per_node=st.integers(1, 5), g=st.sampled_from([1, 2, 4]),
       M=st.integers(1, 3), high=st.sampled_from([1, 5, 1000]), gpu_term=st.booleans())
def test_swap_terms_equal_a_brute_force_swap(seed, N, per_node, g, M, high, gpu_term):
    gen = torch.Generator().manual_seed(seed)
    L, E = 2, N * per_node
    load_LME = torch.randint(0, high + 1, (L, M, E), generator=gen)
    node_LE = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)]) // per_node
    per_side = max(per_node // 2, 1)
    cand_LX = swap_candidates(node_LE, load_LME.sum(1), N, per_side)
    pairs = swap_pairs(N, 2 * per_side)
    nl_LMN = torch.bmm(load_LME, torch.nn.functional.one_hot(node_LE, N).to(torch.int64))
    got = swap_node_terms(nl_LMN, node_LE, load_LME, cand_LX, pairs, g, gpu_term).reshape(L, M, -1)
    for l in range(L):
        for w in range(pairs.pos_a_W.numel()):
            a, b = int(cand_LX[l, pairs.pos_a_W[w]]), int(cand_LX[l, pairs.pos_b_W[w]])
            na, nb = int(pairs.na_W[w]), int(pairs.nb_W[w])
            swapped = node_LE[l:l + 1].clone()
            swapped[0, a], swapped[0, b] = nb, na
            terms = _terms_LMN(swapped, load_LME[l:l + 1], N, g, gpu_term)[0]
            assert torch.equal(got[l, :, w], torch.maximum(terms[:, na], terms[:, nb])), (l, w)


def test_node_biggest_ties_and_lone_experts():
    load_LME = torch.tensor([[[5, 5, 1, 7]]])
    first, expert, second = node_biggest(torch.tensor([[0, 0, 1, 1]]), load_LME, 2)
    assert first.tolist() == [[[5, 7]]] and second.tolist() == [[[5, 1]]] and expert[0, 0, 1] == 3
    first, _, second = node_biggest(torch.tensor([[0, 1, 2, 3]]), load_LME, 4)
    assert first.tolist() == [[[5, 5, 1, 7]]] and second.tolist() == [[[0, 0, 0, 0]]]
