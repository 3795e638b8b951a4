"""Step-long traffic sets capped per owner GPU (planning/fill_spread.py): the fast estimate
equals the simulator's, the link price is what the cost model charges the inter-node part,
the capped sets obey their caps, and the choice is never priced above the uncapped one."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraConfig, Topology, fill_spread, relibra_plan, validate_plan
from relibra_torch.planning.evaluate import evaluate
from relibra_torch.planning.fill_spread import (capped_step_set, fill_link_seconds, link_seconds, spread_args,
                                                spread_step_fills)
from relibra_torch.planning.hier_estimate import approx_need, approx_need_pieces
from relibra_torch.planning.traffic import step_replicas, traffic_replicas
from relibra_torch.sim import CostModel, CostOptions, get_hardware
from relibra_torch.sim.dispatch import hierarchical_metrics
from relibra_torch.sim.presets import ModelSpec

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MODEL = ModelSpec("tiny-moe", num_layers=2, num_moe_layers=2, hidden_size=256, moe_ffn=128,
                  num_experts=8, top_k=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=1000)


def routed_loads(M, L, S, E, tokens, k, seed, skew=4.0):
    """``[M, L, S, E]`` counts of ``tokens`` tokens per source picking ``k`` distinct experts."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(M, L, S, E, dtype=torch.int64)
    for m in range(M):
        for l in range(L):
            w = torch.rand(E, generator=g) ** skew + 1e-3
            for s in range(S):
                ids = torch.multinomial(w.expand(tokens, E), k, replacement=False, generator=g)
                out[m, l, s] = torch.bincount(ids.flatten(), minlength=E)
    return out


def hier_config(**kw):
    cost = CostModel(MODEL, get_hardware("h200"), CostOptions(dispatch="hierarchical"))
    return cost, ReLibraConfig.from_weights(cost.reorder_weights(), dispatch="hierarchical", top_k=MODEL.top_k, **kw)


@SETTINGS
@given(seed=st.integers(0, 10_000), L=st.integers(1, 3), S=st.integers(1, 6), E=st.integers(1, 9),
       P=st.integers(1, 4), k=st.integers(1, 3), ones=st.booleans())
def test_piece_estimate_is_the_simulators(seed, L, S, E, P, k, ones):
    """:func:`approx_need_pieces` equals :func:`approx_need` on the same flows (a source's
    pairs of an expert in one piece), zero-token sources and always-chosen experts included."""
    g = torch.Generator().manual_seed(seed)
    tokens_S = torch.randint(0, 30, (S,), generator=g)
    loads = (torch.rand(L, S, E, generator=g) * (tokens_S.view(1, S, 1) + 1)).long().clamp(max=tokens_S.view(1, S, 1))
    if ones:
        loads[..., 0] = tokens_S.view(1, S)             # p = 1: every token needs that piece
    piece = torch.randint(0, P, (L, S, E), generator=g)
    flow = torch.zeros(L, S, P, E, dtype=torch.int64).scatter_(2, piece.unsqueeze(2), loads.unsqueeze(2))
    torch.testing.assert_close(approx_need_pieces(loads, piece, P, tokens_S, k), approx_need(flow, tokens_S, k),
                               rtol=1e-12, atol=1e-9)


@SETTINGS
@given(seed=st.integers(0, 10_000), M=st.integers(1, 3), nodes=st.sampled_from([(2, 2), (2, 1), (4, 1), (4, 2)]),
       R=st.integers(1, 2), tokens=st.sampled_from([8, 200, 2000]))
def test_link_price_is_the_cost_models_inter_node_part(seed, M, nodes, R, tokens):
    """On a relibra plan (traffic replicas, balancing copies), :func:`link_seconds` without
    compute is the cost model's inter-node all-to-all at the busiest GPU, ``max(send,
    receive)`` rows by its count estimate, summed over micro-batches and layers: the
    balancing copies stay inside their node, where hierarchical rows do not see them."""
    N, g = nodes
    topo = Topology(N, g, 8 if N * g <= 4 else 16, R)
    L, G, E = 2, N * g, topo.num_experts
    loads = routed_loads(M, L, G, E, tokens, MODEL.top_k, seed)
    cost, config = hier_config()
    plan = relibra_plan(loads, topo, None, config)
    validate_plan(plan, loads)
    tokens_MS = loads[:, 0].sum(-1) // MODEL.top_k
    metrics = hierarchical_metrics(plan, evaluate(plan, loads), loads, tokens_MS, MODEL.top_k)
    cross = torch.maximum(metrics.cross_send_MLG, metrics.cross_recv_MLG).double().max(-1).values
    El = topo.experts_per_gpu
    owner_gpu_LE = plan.placement_LE // El
    se = plan.slot_expert_MLGJ
    gpu_node = (torch.arange(G) // g).view(1, 1, G, 1)
    remote = (se >= 0) & (owner_gpu_LE.gather(1, se.clamp(min=0).permute(1, 0, 2, 3).reshape(L, -1))
                          .view(L, M, G, -1).permute(1, 0, 2, 3) // g != gpu_node)
    traffic = torch.where(remote, se, -1)
    row_s = config.cross_node_s_per_token
    got = link_seconds(loads, owner_gpu_LE, traffic, g, MODEL.top_k, row_s, 0.0)
    torch.testing.assert_close(got, row_s * cross.sum(0), rtol=1e-9, atol=1e-15)


@SETTINGS
@given(seed=st.integers(0, 10_000), L=st.integers(1, 3), N=st.integers(2, 4), g=st.integers(1, 3),
       B=st.integers(1, 3), cap=st.integers(1, 5), fill=st.sampled_from([0.0, 1e-6, 1e-4]))
def test_capped_sets_obey_slots_caps_and_the_fill_rule(seed, L, N, g, B, cap, fill):
    """Each node takes at most ``B`` distinct remote experts with positive demand whose
    demand pays for a fill, and no owner GPU sends more than ``cap``; with a cap no owner
    reaches, each node's set is :func:`step_replicas`'."""
    gen = torch.Generator().manual_seed(seed)
    E, token_s = N * g * 2, 1e-7
    owner_gpu_LE = torch.stack([torch.randperm(E, generator=gen) // 2 for _ in range(L)])
    step_LNE = (torch.rand(L, N, E, generator=gen) ** 3 * 3000).long()
    step_LNE.masked_fill_(torch.arange(N).view(1, N, 1) == (owner_gpu_LE // g).view(L, 1, E), 0)   # remote only
    out = capped_step_set(step_LNE, owner_gpu_LE, B, cap, token_s, fill)
    for l in range(L):
        sends = {}
        for n in range(N):
            picked = [e for e in out[l, n].tolist() if e >= 0]
            assert len(picked) == len(set(picked)) <= B
            for e in picked:
                assert step_LNE[l, n, e] * token_s > fill and owner_gpu_LE[l, e] // g != n
                sends[int(owner_gpu_LE[l, e])] = sends.get(int(owner_gpu_LE[l, e]), 0) + 1
        assert max(sends.values(), default=0) <= cap
    loose = capped_step_set(step_LNE, owner_gpu_LE, B, N * B, token_s, fill)
    topo = Topology(N, g, E, B)          # one traffic slot per ... B per GPU: g * B per node
    e_MLGr, _ = step_replicas(step_LNE.unsqueeze(0), torch.zeros(L, N * g, dtype=torch.int64), topo, B, token_s,
                              fill)
    # step_replicas fills g * B slots per node; compare with a capped set of that size
    loose = capped_step_set(step_LNE, owner_gpu_LE, g * B, N * g * B, token_s, fill)
    for l in range(L):
        for n in range(N):
            want = {e for e in e_MLGr[0, l, n * g:(n + 1) * g].flatten().tolist() if e >= 0}
            assert {e for e in loose[l, n].tolist() if e >= 0} == want


@SETTINGS
@given(seed=st.integers(0, 10_000), M=st.integers(1, 3), nodes=st.sampled_from([(2, 2), (4, 1), (4, 2)]),
       tokens=st.sampled_from([64, 2000]), skew=st.sampled_from([1.0, 6.0]))
def test_the_choice_is_never_priced_above_the_uncapped_set_and_plans_stay_valid(seed, M, nodes, tokens, skew):
    """Per layer, the spread choice's price (link and load terms plus the busiest fill link)
    is at most the uncapped traffic set's; relibra's plan with it is valid, and without
    ``spread_fills`` (or under flat dispatch) the traffic set is the uncapped one."""
    N, g = nodes
    topo = Topology(N, g, 8 if N * g <= 4 else 16, 2)
    L, G, E, El = 2, N * g, topo.num_experts, topo.experts_per_gpu
    loads = routed_loads(M, L, G, E, tokens, MODEL.top_k, seed, skew)
    cost, config = hier_config()
    placement = topo.static_placement(L)
    token_s, fill_s = config.cross_node_s_per_token / g, config.cross_replica_fill_s_per_expert
    plain = traffic_replicas(loads, topo, placement, 1, token_s, fill_s)
    spread = traffic_replicas(loads, topo, placement, 1, token_s, fill_s, spread=spread_args(config))
    owner = placement // El
    top_k, row_s, pair_s = spread_args(config)

    def price(e, q):
        return link_seconds(loads, owner, e, g, top_k, row_s, pair_s) + fill_link_seconds(e, q, owner, fill_s)

    assert (price(*spread) <= price(*plain) * (1 + 1e-12)).all()
    off = traffic_replicas(loads, topo, placement, 1, token_s, fill_s,
                           spread=spread_args(hier_config(spread_fills=False)[1]))
    assert all(torch.equal(a, b) for a, b in zip(off, plain))
    plan = relibra_plan(loads, topo, None, config)
    validate_plan(plan, loads)


def test_fill_link_counts_the_owner_sending_every_copy():
    """Three nodes copying one owner's expert in the same micro-batch: the owner's link
    carries three fills, while each receiver carries one."""
    L, G, r = 1, 4, 1
    owner_gpu_LE = torch.tensor([[0, 1, 2, 3]])
    e = torch.tensor([-1, 0, 0, 0]).view(1, L, G, r)         # GPUs 1-3 hold expert 0 (owner GPU 0)
    q = torch.tensor([0, 5, 5, 5]).view(1, L, G, r)
    assert float(fill_link_seconds(e, q, owner_gpu_LE, 1.0)) == 3.0
    e2 = torch.tensor([-1, 0, 1, 2]).view(1, L, G, r)         # three owners, one copy each
    assert float(fill_link_seconds(e2, q, owner_gpu_LE, 1.0)) == 1.0


def _link_seconds_one_at_a_time(loads_MLSE, owner_gpu_LE, expert_MLGr, g, top_k, row_s, pair_s):
    """:func:`link_seconds` as it was written before every micro-batch was priced at once: one
    micro-batch at a time, each with its own first layer's tokens, summed in order."""
    M, L, S, E = loads_MLSE.shape
    N = S // g
    node_S = torch.arange(S) // g
    owner_node_LE = owner_gpu_LE // g
    out = torch.zeros(L, dtype=torch.float64)
    for m in range(M):
        loads_LSE = loads_MLSE[m].to(torch.int64)
        local_LNE = torch.nn.functional.one_hot(owner_node_LE, N).permute(0, 2, 1).bool()
        e = expert_MLGr[m].reshape(L, N, -1)
        held_LNE = torch.zeros(L, N, E, dtype=torch.int64).scatter_add_(2, e.clamp(min=0), (e >= 0).to(torch.int64))
        local_LSE = (local_LNE | (held_LNE > 0))[:, node_S, :]
        piece_LSE = torch.where(local_LSE, node_S.view(1, S, 1).expand(L, S, E), owner_node_LE.view(L, 1, E))
        need = approx_need_pieces(loads_LSE, piece_LSE.contiguous(), N, loads_LSE[0].sum(-1) // top_k, top_k)
        need = need.masked_fill(torch.nn.functional.one_hot(node_S, N).bool().unsqueeze(0), 0.0)
        recv = need.view(L, N, g, N).sum(1).permute(0, 2, 1).reshape(L, S)
        node_load = torch.zeros(L, N, dtype=torch.float64).scatter_add_(
            1, piece_LSE.reshape(L, -1), loads_LSE.reshape(L, -1).to(torch.float64))
        out += row_s * torch.maximum(need.sum(-1), recv).max(-1).values + pair_s * node_load.max(-1).values / g
    return out


@SETTINGS
@given(seed=st.integers(0, 10_000), M=st.integers(1, 9), L=st.integers(1, 3), N=st.integers(2, 5),
       g=st.integers(1, 4), J=st.integers(1, 3), k=st.integers(1, 4), r=st.integers(1, 2), empty=st.booleans(),
       chunk=st.sampled_from([0, 1, 2]))
def test_link_price_of_every_micro_batch_at_once_is_one_at_a_times_to_the_bit(seed, M, L, N, g, J, k, r, empty, chunk):
    """Pricing micro-batches together (rows ``M L``, each with its micro-batch's tokens; all
    at once, or in chunks of ``chunk`` where the block cap is lowered) gives
    :func:`link_seconds` bit for bit what one micro-batch at a time gave, summed in the same
    order: uneven and empty sources, empty and repeated traffic slots."""
    G, E = N * g, N * g * J
    gen = torch.Generator().manual_seed(seed)
    loads = torch.randint(0, 300, (M, L, G, E), generator=gen) * (torch.rand(M, L, G, E, generator=gen) < 0.6)
    if empty:
        loads[:, :, : G // 2] = 0
    owner = torch.stack([torch.randperm(E, generator=gen) // J for _ in range(L)])
    expert = torch.randint(-1, E, (M, L, G, r), generator=gen)
    k = min(k, E)
    cap = fill_spread.LINK_BLOCK_ELEMENTS
    fill_spread.LINK_BLOCK_ELEMENTS = chunk * L * G * E if chunk else cap
    try:
        got = link_seconds(loads, owner, expert, g, k, 3.3e-7, 5.7e-8)
    finally:
        fill_spread.LINK_BLOCK_ELEMENTS = cap
    assert torch.equal(got, _link_seconds_one_at_a_time(loads, owner, expert, g, k, 3.3e-7, 5.7e-8))
