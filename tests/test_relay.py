"""Relays (planning/relay.py): which tokens go, the planner's rule, the count-level estimate
against the exact count, the simulator's price and collectives, and never worse as priced."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology, relibra_plan, static_plan, validate_plan
from relibra_torch.sim import CostModel, CostOptions, get_hardware
from relibra_torch.planning.evaluate import evaluate
from relibra_torch.planning.relay import (RELAY_COLLECTIVES, exec_ranks, plan_relays, relay_rows,
                                          relay_token_index, relayed_counts)
from relibra_torch.planning.pricing import GUARD_FLOORS
from relibra_torch.planning.relay_choice import (add_relays, relay_bound_ML, relay_host_s, relay_savings,
                                                 relays_worth_L)
from relibra_torch.sim.dispatch import exact_copies, hierarchical_metrics
from relibra_torch.planning.plan import token_split
from test_fill_spread import MODEL, routed_loads

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(T=st.integers(0, 40), counts=st.lists(st.integers(0, 8), min_size=1, max_size=6))
def test_relayed_tokens_are_distinct_evenly_spaced_and_in_peer_order(T, counts):
    relay_g = torch.tensor(counts)
    k = int(relay_g.sum())
    if k > T:
        with pytest.raises(ValueError, match="does not match the plan"):
            relay_token_index(T, relay_g)
        return
    idx, peer = relay_token_index(T, relay_g)
    assert idx.numel() == peer.numel() == k
    assert (idx[1:] > idx[:-1]).all() and (idx >= 0).all() and (idx < max(T, 1)).all()
    assert torch.equal(torch.bincount(peer, minlength=len(counts)), relay_g)
    assert (peer[1:] >= peer[:-1]).all()


@SETTINGS
@given(seed=st.integers(0, 10_000), B=st.integers(1, 3), N=st.integers(2, 3), g=st.integers(2, 4),
       big=st.integers(1, 60))
def test_plan_relays_moves_toward_the_node_mean_and_never_more_than_a_rank_has(seed, B, N, g, big):
    gen = torch.Generator().manual_seed(seed)
    S = N * g
    tokens = torch.randint(0, big + 1, (B, S), generator=gen)
    cross = torch.rand(B, S, N, generator=gen, dtype=torch.float64) * tokens.unsqueeze(-1) * 0.9
    copies = torch.rand(B, S, S, generator=gen, dtype=torch.float64) * tokens.unsqueeze(-1)
    relay = plan_relays(cross, tokens, g)
    assert relay.dtype == torch.int64 and (relay >= 0).all()
    assert not relay[:, torch.arange(S), torch.arange(S) % g].any()         # never to itself
    assert (relay.sum(-1) <= tokens).all()
    c2, x2, send, recv = relayed_counts(copies, cross, relay, tokens, g)
    torch.testing.assert_close(x2.sum(1), cross.sum(1))                      # rows move, none is lost
    torch.testing.assert_close(c2.sum(1), copies.sum(1))
    before = cross.sum(-1).view(B, N, g)
    after = x2.sum(-1).view(B, N, g)
    assert (after.amax(-1) <= before.amax(-1) + 1e-9).all()                  # the busiest sends no more
    assert (after >= before.amin(-1, keepdim=True) - 1e-9).all()            # nobody below the least
    assert torch.equal(send, relay.sum(-1).to(send.dtype)) and float(send.sum()) == float(recv.sum())


@SETTINGS
@given(seed=st.integers(0, 10_000), K=st.integers(1, 3), per=st.integers(1, 6))
def test_the_estimate_with_relays_is_exact_where_a_sources_tokens_are_alike(seed, K, per):
    """Where every token of a source picks the same experts, moving a share of its tokens
    moves that share of its rows: the estimate's rule equals the exact count."""
    gen = torch.Generator().manual_seed(seed)
    topo = Topology(2, 2, 8, replica_slots=1)
    S, E = topo.num_gpus, topo.num_experts
    sets = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(S)])
    T_S = torch.randint(1, per + 1, (S,), generator=gen) * 2
    ids_TK = torch.cat([sets[s].expand(int(T_S[s]), K) for s in range(S)])
    source_T = torch.repeat_interleave(torch.arange(S), T_S)
    loads = torch.zeros(1, 1, S, E, dtype=torch.int64)
    loads[0, 0].index_put_((source_T.repeat_interleave(K), ids_TK.flatten()), torch.ones(ids_TK.numel(),
                                                                                         dtype=torch.int64), accumulate=True)
    plan = static_plan(loads, topo)
    split = token_split(plan, loads)[0]
    relay = torch.zeros(1, S, topo.gpus_per_node, dtype=torch.int64)
    for s in range(S):  # half of each source's tokens to its node-mate
        relay[0, s, 1 - s % 2] = int(T_S[s]) // 2
    ids = ids_TK.unsqueeze(1)
    cross0, copies0 = exact_copies(split, plan.slot_expert_MLGJ[0], ids, source_T, topo)
    cross1, copies1 = exact_copies(split, plan.slot_expert_MLGJ[0], ids, source_T, topo, relay_LSg=relay)
    c_est, x_est, _, _ = relayed_counts(copies0, cross0, relay, T_S.expand(1, S), topo.gpus_per_node)
    torch.testing.assert_close(x_est, cross1.to(torch.float64))
    torch.testing.assert_close(c_est, copies1.to(torch.float64))
    half = T_S // 2  # each keeps the rest of its own and takes its node-mate's half
    assert torch.equal(exec_ranks(source_T, relay[0], 2).bincount(minlength=S), T_S - half + half[torch.arange(S) ^ 1])


def test_relays_are_kept_only_where_the_priced_all_to_all_gains_more_than_their_latency():
    """relibra's plan on an uneven trace: relays where the priced exchange is faster by more
    than their collectives' latency (``RELAY_COLLECTIVES``), none on flat dispatch, with
    relay=False or on one node; the simulator charges them as an NVLink stage and
    ``RELAY_COLLECTIVES`` more collectives."""
    M, L, S, E = 2, 2, 8, 16
    topo = Topology(2, 4, E, replica_slots=1)
    loads = routed_loads(M, L, S, E, 400, MODEL.top_k, 3)
    loads[:, :, 0] *= 3                                         # rank 0 has 3x the tokens
    wide = dataclasses.replace(MODEL, hidden_size=4096)  # rows worth more than the relays' latency
    cost = CostModel(wide, get_hardware("h200"), CostOptions(dispatch="hierarchical"))
    cfg = ReLibraConfig.from_weights(cost.reorder_weights(), dispatch="hierarchical", top_k=MODEL.top_k)
    base = relibra_plan(loads, topo, config=dataclasses.replace(cfg, relay=False))
    assert base.relay_MLGg is None
    plan = add_relays(base, loads, cfg)
    assert plan.relay_MLGg is not None and plan.relay_MLGg[:, :, 0].sum() > 0   # the heavy rank hands tokens away
    validate_plan(plan, loads)
    flat = dataclasses.replace(cfg, dispatch="flat")
    assert add_relays(base, loads, flat) is base
    one = Topology(1, 8, E, replica_slots=1)
    assert add_relays(relibra_plan(loads, one, config=cfg), loads, cfg).relay_MLGg is None
    # the simulator's price: the exchange with relays is faster where they are kept
    tokens_MS = loads[:, 0].sum(-1) // MODEL.top_k
    pairs = torch.zeros_like(tokens_MS, dtype=torch.float64)
    m0 = hierarchical_metrics(base, evaluate(base, loads), loads, tokens_MS, MODEL.top_k)
    m1 = hierarchical_metrics(plan, evaluate(plan, loads), loads, tokens_MS, MODEL.top_k)
    c0, c1 = cost.step_cost(base, m0, tokens_MS, pairs), cost.step_cost(plan, m1, tokens_MS, pairs)
    on = plan.relay_MLGg.flatten(2).any(-1)
    assert (c1.all_to_all_s_ML[on] < c0.all_to_all_s_ML[on]).all()
    assert torch.equal(c1.all_to_all_s_ML[~on], c0.all_to_all_s_ML[~on])
    lat = cost.collective_latency_s(torch.full((M, L), RELAY_COLLECTIVES), 2)
    torch.testing.assert_close(c1.latency_s_ML - c0.latency_s_ML, lat * on)
    send, recv = relay_rows(plan.relay_MLGg.flatten(0, 1))
    assert torch.equal(m1.relay_send_MLG.flatten(0, 1), send) and torch.equal(m1.relay_recv_MLG.flatten(0, 1), recv)
    assert c1.step_s < c0.step_s


def _wide_config(top_k: int, **kw) -> ReLibraConfig:
    """relibra's hierarchical config for MODEL's experts at hidden 4096 (rows worth more than latency)."""
    cost = CostModel(dataclasses.replace(MODEL, hidden_size=4096, top_k=top_k), get_hardware("h200"),
                     CostOptions(dispatch="hierarchical"))
    return ReLibraConfig.from_weights(cost.reorder_weights(), dispatch="hierarchical", top_k=top_k, **kw)


@SETTINGS
@given(seed=st.integers(0, 10_000), N=st.integers(2, 4), g=st.integers(2, 4), K=st.integers(1, 3),
       tokens=st.integers(8, 120), slots=st.integers(0, 1))
def test_the_relay_bound_covers_what_relays_save(seed, N, g, K, tokens, slots):
    """``relay_bound_ML`` (pairs only, no estimate) is at least what ``relay_savings`` finds, on
    uneven ranks and on relibra's plans with copies; where the tokens-only bound sends
    ``relay_savings`` out early, it is 0."""
    gen = torch.Generator().manual_seed(seed)
    S, E = N * g, 2 * N * g
    topo = Topology(N, g, E, replica_slots=slots)
    loads = routed_loads(2, 2, S, E, tokens, K, seed) * torch.randint(1, 5, (1, 1, S, 1), generator=gen)
    cfg = _wide_config(K)
    plan = relibra_plan(loads, topo, config=dataclasses.replace(cfg, relay=False))
    found, bound_ML = relay_savings(plan, loads, cfg), relay_bound_ML(plan, loads, cfg)
    if found is None:  # sends too small to cover the latency, by the tokens-only bound: so by this one too
        assert not bound_ML.any()
        return
    assert (found[0] <= bound_ML + 1e-12).all()


def test_a_relay_saves_more_than_the_busiest_sources_send_where_one_gpu_receives_from_every_node():
    """Every source sends to node 0's experts and the sources of local index 0 have 8x the
    tokens: node 0's GPU 0 receives all of their rows. Relays spread them over node 0's GPUs,
    saving several times the busiest source's whole inter-node send (the bound the relays' early
    exit used to take); ``relay_bound_ML`` covers it."""
    N, g, E, T = 8, 4, 32, 256
    topo = Topology(N, g, E, replica_slots=2)
    loads = torch.zeros(2, 1, N * g, E, dtype=torch.int64)
    for s in range(N * g):
        loads[:, 0, s, s % g] = T if s % g == 0 else T // 8
    cfg = _wide_config(1)
    plan = static_plan(loads, topo)
    saving_ML = relay_savings(plan, loads, cfg)[0]
    busiest_send = T * cfg.cross_node_s_per_token
    assert (saving_ML > 3 * busiest_send).all()
    assert (saving_ML <= relay_bound_ML(plan, loads, cfg)).all()


def test_relays_are_found_only_on_layers_whose_bound_repays_their_host_time():
    """With the guard's host-time fields on, a layer gets relays only where ``scale`` times its
    bound covers their host time (``relay_host_s``): all of them on a fast host, none on a slow
    one, and between the two the layer with the larger bound alone; a share planned alone
    (split planning, ``total_layers``) gets the same relays as in the whole step."""
    M, L, S, E = 2, 2, 8, 16
    topo = Topology(2, 4, E, replica_slots=1)
    loads = routed_loads(M, L, S, E, 400, MODEL.top_k, 3)
    loads[:, :, 0] *= 3
    # layer 1: the same tokens, routed to fewer experts (every layer of a step carries the same tokens)
    factor = loads[:, 0].sum(-1, keepdim=True) // (400 * MODEL.top_k)
    loads[:, 1] = routed_loads(M, 1, S, E, 400, MODEL.top_k, 4, skew=12.0)[:, 0] * factor
    assert torch.equal(loads[:, 1].sum(-1), loads[:, 0].sum(-1))
    cfg = _wide_config(MODEL.top_k, **GUARD_FLOORS)
    base = relibra_plan(loads, topo, config=dataclasses.replace(cfg, relay=False, plan_floor_s=0.0,
                                                                 plan_floor_nodes_s=0.0))
    free = add_relays(base, loads, dataclasses.replace(cfg, plan_floor_nodes_s=0.0))   # guard off
    assert free.relay_MLGg is not None and free.relay_MLGg[:, 0].any() and free.relay_MLGg[:, 1].any()
    fast = add_relays(base, loads, dataclasses.replace(cfg, host_scale_nodes=1e-9))
    assert torch.equal(fast.relay_MLGg, free.relay_MLGg)
    assert add_relays(base, loads, dataclasses.replace(cfg, host_scale_nodes=1e6)) is base
    # the host scale at which each layer's bound (counted L / ceil(L / G) = 2 times) meets its host time
    bound_L = relay_bound_ML(base, loads, cfg).sum(0) * 2
    meets_L = bound_L / relay_host_s(topo, M, dataclasses.replace(cfg, host_scale_nodes=1.0), 1)
    hi, lo = int(meets_L.argmax()), int(meets_L.argmin())
    assert meets_L[hi] > 1.1 * meets_L[lo]
    mid = dataclasses.replace(cfg, host_scale_nodes=float(meets_L.sqrt().prod()))
    assert relays_worth_L(base, loads, mid).tolist() == [layer == hi for layer in range(L)]
    between = add_relays(base, loads, mid)
    assert not between.relay_MLGg[:, lo].any() and torch.equal(between.relay_MLGg[:, hi], free.relay_MLGg[:, hi])
    for layer in range(L):   # each layer as a one-layer share of the two-layer step
        part = add_relays(base.layers(torch.tensor([layer])), loads[:, [layer]], mid, total_layers=L)
        assert torch.equal(part.relays()[:, 0], between.relays()[:, layer])


def test_validate_plan_names_bad_relays():
    topo = Topology(2, 2, 8)
    loads = torch.ones(1, 1, 4, 8, dtype=torch.int64)
    plan = static_plan(loads, topo)
    for relay, msg in [(torch.zeros(1, 1, 4, 3, dtype=torch.int64), "expected int64"),
                       (-torch.ones(1, 1, 4, 2, dtype=torch.int64), "negative"),
                       (torch.eye(2, dtype=torch.int64).repeat(2, 1).view(1, 1, 4, 2), "to itself")]:
        with pytest.raises(ValueError, match=msg):
            validate_plan(dataclasses.replace(plan, relay_MLGg=relay), loads)
    one = Topology(1, 4, 8)
    relay = torch.zeros(1, 1, 4, 4, dtype=torch.int64)
    relay[0, 0, 0, 1] = 1
    with pytest.raises(ValueError, match="on one node"):
        validate_plan(dataclasses.replace(static_plan(loads, one), relay_MLGg=relay), loads)
