"""The batched all-to-all price (``price.a2a_parts_ML``: micro-batches in chunks, the
hierarchical estimate of several micro-batches at once) is bit-identical to pricing one
micro-batch at a time, the rule it replaced (kept here as the reference): flat and
hierarchical, replicas present and absent, nodes whose columns outgrow one summation block
(``g J > 16``), micro-batches of different column widths, several chunks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning import price
from relibra_torch.planning.hier_estimate import approx_need_batched, approx_need_columns, hierarchical_traffic
from relibra_torch.planning.plan import StepPlan, token_split
from relibra_torch.planning.topology import Topology


def _ref_hier_counts(split_LSGJ, slot_expert_LGJ, tokens_S, top_k, topo):
    """The per-micro-batch rule before batching (verbatim but for names)."""
    L, S, G, J = split_LSGJ.shape
    N, g, E = topo.num_nodes, topo.gpus_per_node, topo.num_experts
    e_LX = slot_expert_LGJ.reshape(L, G * J)
    valid_LX = e_LX >= 0
    node_X = torch.arange(G * J) // (J * g)
    used_LNE = torch.zeros(L, N * E + 1, dtype=torch.bool)
    used_LNE.scatter_(1, torch.where(valid_LX, node_X * E + e_LX, N * E), True)
    rank_LNE = used_LNE[:, :N * E].reshape(L, N, E).cumsum(-1) - 1
    width = max(int(rank_LNE[..., -1].max()) + 1, 1)
    col_LX = rank_LNE.view(L, N * E).gather(1, (node_X * E + e_LX.clamp(min=0))).clamp(min=0)
    idx_LSX = (col_LX.view(L, 1, G * J) * (L * S * N) + torch.arange(L).view(L, 1, 1) * (S * N)
               + torch.arange(S).view(1, S, 1) * N + node_X.view(1, 1, G * J))
    flow_KLSN = torch.zeros(width * L * S * N, dtype=torch.int64)
    flow_KLSN.scatter_add_(0, idx_LSX.reshape(-1), (split_LSGJ.reshape(L, S, G * J) * valid_LX.unsqueeze(1)).reshape(-1))
    flow_KLSN = flow_KLSN.view(width, L, S, N)
    own = torch.nn.functional.one_hot(torch.arange(G) // g, N).bool()
    cross = approx_need_columns(flow_KLSN, tokens_S, top_k).masked_fill(own.unsqueeze(0), 0.0)
    split_JLSG = (split_LSGJ * (slot_expert_LGJ >= 0).unsqueeze(1)).movedim(-1, 0).contiguous()
    copies = approx_need_columns(split_JLSG, tokens_S, top_k)
    return hierarchical_traffic(copies, cross, topo)


def _ref_a2a_parts_ML(plan, loads_MLSE, config):
    topo = plan.topology
    M = loads_MLSE.shape[0]
    G, g, El = topo.num_gpus, topo.gpus_per_node, topo.experts_per_gpu
    node_G = torch.arange(G) // g
    same_node = node_G.view(G, 1) == node_G.view(1, G)
    same_gpu = torch.eye(G, dtype=torch.bool)
    hier = config.dispatch == "hierarchical" and config.top_k > 0
    out = torch.empty(M, plan.num_layers, dtype=torch.float64)
    cross_out = torch.empty(M, plan.num_layers, dtype=torch.float64)
    for m in range(M):
        se_LGJ = plan.slot_expert_MLGJ[m]
        if bool((se_LGJ[..., El:] < 0).all()):
            L, _, J = se_LGJ.shape
            S = loads_MLSE.shape[2]
            idx = se_LGJ.clamp(min=0).view(L, 1, G * J).expand(L, S, G * J)
            split_LSGJ = (loads_MLSE[m].to(torch.int64).gather(2, idx) * (se_LGJ >= 0).view(L, 1, G * J)).view(L, S, G, J)
        else:
            split_LSGJ = token_split(plan.micro_batch(m), loads_MLSE[m:m + 1])[0]
        if hier:
            tokens_S = loads_MLSE[m, 0].to(torch.int64).sum(-1) // config.top_k
            cs, cr, is_, ir = _ref_hier_counts(split_LSGJ, se_LGJ, tokens_S, config.top_k, topo)
        else:
            split_LSG = split_LSGJ.sum(-1)
            cross, intra = split_LSG * ~same_node, split_LSG * (same_node & ~same_gpu)
            cs, cr, is_, ir = cross.sum(2), cross.sum(1), intra.sum(2), intra.sum(1)
        cross_G = torch.maximum(cs, cr).to(torch.float64) * config.cross_node_s_per_token
        out[m] = (cross_G + torch.maximum(is_, ir).to(torch.float64) * config.intra_node_s_per_token).max(-1).values
        cross_out[m] = cross_G.max(-1).values
    return out, cross_out


def _random_plan(gen: torch.Generator, topo: Topology, M: int, L: int, replica_p: float, zipf: float):
    """A valid plan on random loads: a random placement, native slots holding their
    experts, each replica slot a random expert not already on its GPU (or empty), every
    expert's load split over its instances at random."""
    G, J, El, E = topo.num_gpus, topo.slots_per_gpu, topo.experts_per_gpu, topo.num_experts
    weight_E = (torch.arange(1, E + 1, dtype=torch.float64) ** -zipf)[torch.randperm(E, generator=gen)]
    loads = torch.poisson(weight_E.expand(M, L, G, E) * 40 * torch.rand(M, L, G, 1, generator=gen, dtype=torch.float64),
                          generator=gen).to(torch.int64)
    placement = torch.stack([torch.randperm(E, generator=gen) for _ in range(L)])
    native_LGl = torch.empty_like(placement).scatter_(1, placement, torch.arange(E).expand(L, E)).view(L, G, El)
    se = torch.full((M, L, G, J), -1, dtype=torch.int64)
    se[..., :El] = native_LGl
    st = torch.zeros(M, L, G, J, dtype=torch.int64)
    for m in range(M):
        for l in range(L):
            for q in range(G):
                for j in range(El, J):
                    if float(torch.rand(1, generator=gen)) < replica_p:
                        e = int(torch.randint(E, (1,), generator=gen))
                        if not bool((se[m, l, q] == e).any()):
                            se[m, l, q, j] = e
            load_E = loads[m, l].sum(0)
            for e in range(E):
                where = (se[m, l] == e).nonzero()
                w = torch.rand(len(where), generator=gen, dtype=torch.float64) + 0.05
                cut = (w.cumsum(0) / w.sum() * int(load_E[e])).floor().to(torch.int64)
                cut[-1] = int(load_E[e])
                parts = torch.diff(cut, prepend=torch.zeros(1, dtype=torch.int64))
                for (q, j), t in zip(where.tolist(), parts.tolist()):
                    st[m, l, q, j] = t
    return StepPlan(topo, placement, se, st, "test"), loads


def _config(dispatch: str, top_k: int) -> SimpleNamespace:
    return SimpleNamespace(dispatch=dispatch, top_k=top_k, cross_node_s_per_token=3.1e-9, intra_node_s_per_token=0.7e-9)


def _check(plan, loads, config):
    got, got_cross = price.a2a_parts_ML(plan, loads, config)
    want, want_cross = _ref_a2a_parts_ML(plan, loads, config)
    assert torch.equal(got, want) and torch.equal(got_cross, want_cross)
    # the per-GPU rows too (a price keeps only the busiest GPU's)
    M, L = loads.shape[:2]
    split = price._splits(plan, loads, 0, M)
    for m in range(M):
        assert torch.equal(split[m], token_split(plan.micro_batch(m), loads[m:m + 1])[0])
    if config.dispatch == "hierarchical":
        tokens_MS = loads[:, 0].sum(-1) // config.top_k
        rows = price._hierarchical_counts(split, plan.slot_expert_MLGJ, tokens_MS, config.top_k, plan.topology)
        for m in range(M):
            ref = _ref_hier_counts(split[m], plan.slot_expert_MLGJ[m], tokens_MS[m], config.top_k, plan.topology)
            assert all(torch.equal(r.view(M, L, -1)[m], w) for r, w in zip(rows, ref))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), M=st.integers(1, 4), L=st.integers(1, 3), shape=st.sampled_from(
    [(1, 4, 8, 2), (2, 2, 8, 1), (2, 3, 12, 2), (3, 2, 12, 3), (2, 3, 24, 3), (2, 4, 16, 3)]),
    replica_p=st.sampled_from([0.0, 0.3, 0.9]), dispatch=st.sampled_from(["flat", "hierarchical"]),
    top_k=st.sampled_from([1, 2, 4]), zipf=st.sampled_from([0.0, 1.2]))
def test_batched_a2a_matches_per_micro_batch(seed, M, L, shape, replica_p, dispatch, top_k, zipf):
    N, g, E, R = shape
    gen = torch.Generator().manual_seed(seed)
    plan, loads = _random_plan(gen, Topology(N, g, E, R), M, L, replica_p, zipf)
    _check(plan, loads, _config(dispatch, top_k))


@pytest.mark.parametrize("seed", [13, 19])  # seeds where one width for all (zero columns) changes a float
def test_batched_hierarchical_wide_nodes_and_chunks(seed, monkeypatch):
    """``g J = 21`` columns per node (beyond one 16-row summation block) and ``L S N = 24``
    (a float sum's rounding then depends on its block's shape), micro-batches of different
    widths (replicas in some only), and chunks of one and two micro-batches."""
    gen = torch.Generator().manual_seed(seed)
    L, G, El, J = 2, 6, 4, 7
    plan, loads = _random_plan(gen, Topology(2, 3, 24, 3), 5, L, 0.6, 1.0)
    se, st = plan.slot_expert_MLGJ, plan.slot_tokens_MLGJ
    se[1, ..., El:] = -1  # a micro-batch without replicas: the native split, a narrower flow
    st[1] = 0
    st[1, ..., :El] = loads[1].sum(1).gather(1, se[1, ..., :El].reshape(L, -1)).view(L, G, El)
    se[3, ..., El + 1:] = -1  # one replica slot of three: a width between
    st[3] = 0
    for l in range(L):
        for e in range(24):
            where = (se[3, l] == e).nonzero()
            st[3, l, int(where[0, 0]), int(where[0, 1])] = int(loads[3, l, :, e].sum())
    config = _config("hierarchical", 2)
    _check(plan, loads, config)
    row = L * G * G * J * 8   # bytes of one micro-batch's split
    for chunk in (1, 2):
        monkeypatch.setattr(price, "_CHUNK_BYTES", chunk * row)
        _check(plan, loads, config)
        _check(plan, loads, _config("flat", 2))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 4), K=st.integers(1, 24), L=st.integers(1, 3),
       S=st.integers(1, 9), P=st.integers(1, 4), top_k=st.integers(1, 4))
def test_approx_need_batched_is_each_flow_alone(seed, B, K, L, S, P, top_k):
    gen = torch.Generator().manual_seed(seed)
    flow = torch.randint(0, 40, (B, K, L, S, P), generator=gen) * (torch.rand(B, K, L, S, P, generator=gen) < 0.7)
    tokens = torch.randint(0, 120, (B, S), generator=gen)
    got = approx_need_batched(flow, tokens, top_k)
    for b in range(B):
        assert torch.equal(got[b], approx_need_columns(flow[b].contiguous(), tokens[b], top_k))
