"""The numpy greedy start of reordering equals the per-expert torch loop it replaced
(``planning.reorder_greedy``), ties included: same integers, same float64 objective."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning.pricing import priced_config
from relibra_torch.planning.reorder_load import load_first_objective as _objective
from relibra_torch.planning.reorder_greedy import greedy_nodes


def _reference(load_LME, total_LE, src_node_LNE, prev_node_LE, config, N, g):
    """The torch loop of ``relibra.reorder`` before the numpy port."""
    L, M, E = load_LME.shape
    per_node, rows = E // N, torch.arange(L)
    greedy_LE = torch.empty(L, E, dtype=torch.int64)
    nl_LMN = torch.zeros(L, M, N, dtype=torch.int64)
    count_LN = torch.zeros(L, N, dtype=torch.int64)
    order_LE = total_LE.sort(dim=1, descending=True, stable=True).indices
    for i in range(E):
        e_L = order_LE[:, i]
        add_LM = load_LME[rows, :, e_L]
        new_max_LN = torch.maximum(nl_LMN.max(-1, keepdim=True).values, nl_LMN + add_LM.unsqueeze(-1)).sum(1)
        cross_LN = total_LE[rows, e_L].unsqueeze(1) - src_node_LNE[rows, :, e_L]
        moved_LN = (torch.arange(N) != prev_node_LE[rows, e_L].unsqueeze(1)).to(torch.int64)
        cost_LN = _objective(new_max_LN, cross_LN, moved_LN, config, g, N)
        cost_LN = cost_LN.masked_fill(count_LN >= per_node, float("inf"))
        n_L = cost_LN.argmin(1)
        greedy_LE[rows, e_L] = n_L
        nl_LMN[rows, :, n_L] += add_LM
        count_LN[rows, n_L] += 1
    return greedy_LE


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([2, 3, 4, 6, 8]), per_node=st.integers(1, 6), g=st.sampled_from([1, 2, 8]),
       L=st.integers(1, 3), M=st.integers(1, 4), high=st.sampled_from([1, 3, 1000]),
       model=st.sampled_from([(2048, 768), (768, 3072)]))
def test_greedy_nodes_equal_the_torch_loop(seed, N, per_node, g, L, M, high, model):
    gen = torch.Generator().manual_seed(seed)
    E = N * per_node
    own_LMNE = torch.randint(0, high + 1, (L, M, N, E), generator=gen)   # small ``high``: many ties
    load_LME, src_node_LNE = own_LMNE.sum(2), own_LMNE.sum(1)
    total_LE = load_LME.sum(1)
    prev_node_LE = torch.stack([torch.randperm(E, generator=gen) % N for _ in range(L)])
    config = priced_config(*model, "h200")
    got = greedy_nodes(load_LME, total_LE, src_node_LNE, prev_node_LE, config, N, g)
    want = _reference(load_LME, total_LE, src_node_LNE, prev_node_LE, config, N, g)
    assert got.dtype == torch.int64 and torch.equal(got, want)
    assert (torch.nn.functional.one_hot(got, N).sum(1) == per_node).all()   # every node holds E / N
