"""relibra's light plan for the layers the guard keeps (``planning/light.py``) and the tier
between it and the full search (``planning/worth.py``).

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import ReLibraPlanner, Topology, relibra_plan
from relibra_torch.planning.base import layer_share
from relibra_torch.planning.fastpath import keep_plan
from relibra_torch.planning.light import hot_spread_saving_L, light_plan
from relibra_torch.planning.plain import layers_price
from relibra_torch.planning.plan import StepPlan, validate_plan
from relibra_torch.planning.pricing import LIGHT_SHARE, priced_config
from relibra_torch.planning.host_time import light_schedule_share
from relibra_torch.planning.step_set import margin_sets
from relibra_torch.planning import relibra as relibra_module
from relibra_torch.planning import host_time, worth

PRICED = priced_config(2048, 768, "h200")


def _exact_margin_L(*args):
    """The guard's exact margin ``U_l + W_l`` and the full search's floor ``F``
    (``worth.Tiers``) without its one-node quick bound (an upper bound that stands in where
    it keeps every layer). The tests set their floors around these values."""
    def never(loads_MLSE, *rest):
        return (torch.full((loads_MLSE.shape[1],), math.inf, dtype=torch.float64),) * 2
    with mock.patch.object(worth, "_quick_bound_L", never):
        tiers = worth._tiers(*args)
    return tiers.margin_L(), tiers.floor


def _collapsed(topo: Topology, M: int, L: int, seed: int, hot: float, tokens: int = 400) -> torch.Tensor:
    """int64 ``[M, L, S, E]``: every source sends ``hot`` of its tokens to one expert per
    layer (a collapsed router), the rest spread at random."""
    gen = torch.Generator().manual_seed(seed)
    S, E = topo.num_gpus, topo.num_experts
    loads = torch.multinomial(torch.ones(E), M * L * S * tokens, replacement=True, generator=gen)
    loads = torch.zeros(M * L * S, E, dtype=torch.int64).scatter_add_(
        1, loads.view(M * L * S, tokens), torch.ones(M * L * S, tokens, dtype=torch.int64)).view(M, L, S, E)
    hot_L = torch.randint(0, E, (L,), generator=gen)
    loads[:, torch.arange(L), :, hot_L] += int(hot * tokens / (1 - hot))
    return loads


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([1, 2]), g=st.sampled_from([2, 4]), El=st.sampled_from([1, 2]),
       R=st.sampled_from([1, 2]), M=st.integers(1, 4), L=st.integers(1, 3), hot=st.sampled_from([0.0, 0.5, 0.95]),
       dispatch=st.sampled_from(["flat", "hierarchical"]))
def test_light_plan_never_prices_above_keeping_and_is_layer_local(seed, N, g, El, R, M, L, hot, dispatch):
    """Per layer the light plan is the cheaper of the step-long sets by the margin and the
    share rule (``step_set.margin_sets``) where that prices strictly lower than keeping (the
    plain plan's exact price), else the kept layer; so it never prices above keeping. It keeps the kept placement, is a valid plan, and every layer planned alone is
    the whole step's (split planning; every layer sees the step's tokens per source)."""
    topo = Topology(N, g, N * g * El, R)
    loads = _collapsed(topo, M, L, seed, hot, tokens=50)
    config = dataclasses.replace(PRICED, dispatch=dispatch, top_k=1)
    prev = torch.stack([torch.randperm(topo.num_experts, generator=torch.Generator().manual_seed(seed + l))
                        for l in range(L)])
    kept = keep_plan(loads, topo, prev, config)
    plan = light_plan(loads, kept, config)
    validate_plan(plan, loads)
    assert torch.equal(plan.placement_LE, kept.placement_LE)
    idx = torch.arange(L)
    sets = [StepPlan(topo, kept.placement_LE, se, st, "relibra", kept.previous_placement_LE)
            for se, st in margin_sets(loads, topo, kept.placement_LE, config.min_replica_tokens_on(N))[::-1]
            if bool((se[..., El:] >= 0).any())]   # the margin rule's first: it wins ties
    kept_L = layers_price(kept, idx, loads, config)
    price_PL = torch.stack([layers_price(p, idx, loads, config) for p in sets]) if sets else kept_L.view(1, L)
    for l in range(L):
        best = int(price_PL[:, l].argmin())   # the first on ties
        want = sets[best] if sets and bool(price_PL[best, l] < kept_L[l]) else kept
        assert torch.equal(plan.slot_expert_MLGJ[:, l], want.slot_expert_MLGJ[:, l])
        assert torch.equal(plan.slot_tokens_MLGJ[:, l], want.slot_tokens_MLGJ[:, l])
        part = light_plan(loads[:, l:l + 1], keep_plan(loads[:, l:l + 1], topo, prev[l:l + 1], config), config)
        assert torch.equal(part.slot_expert_MLGJ[:, 0], plan.slot_expert_MLGJ[:, l])
        assert torch.equal(part.slot_tokens_MLGJ[:, 0], plan.slot_tokens_MLGJ[:, l])
    assert bool((layers_price(plan, idx, loads, config) <= layers_price(kept, idx, loads, config)).all())


def test_light_plan_spreads_a_collapsed_router_and_keeps_balanced_layers():
    """A one-node layer whose router sends 95% of tokens to one expert gets that expert's
    copies on the other GPUs, all step (each fills once), at well under half the kept price;
    a balanced layer keeps its plan (no copy pays); without balancing nothing is copied."""
    topo = Topology(1, 8, 8, 2)
    loads = torch.cat([_collapsed(topo, 8, 1, 0, 0.95, tokens=2000), _collapsed(topo, 8, 1, 1, 0.0, tokens=2000)], 1)
    prev = topo.static_placement(2)
    kept = keep_plan(loads, topo, prev, PRICED)
    plan = light_plan(loads, kept, PRICED)
    El = topo.experts_per_gpu
    copies = plan.slot_expert_MLGJ[:, 0, :, El:]
    hot = int(loads[:, 0].sum((0, 1)).argmax())
    assert bool((copies == hot).any()) and bool((copies == copies[:1]).all())   # the same copies all step
    price = layers_price(plan, torch.arange(2), loads, PRICED)
    kept_price = layers_price(kept, torch.arange(2), loads, PRICED)
    assert float(price[0]) < 0.5 * float(kept_price[0])
    assert torch.equal(plan.slot_expert_MLGJ[:, 1], kept.slot_expert_MLGJ[:, 1])
    off = light_plan(loads, kept, dataclasses.replace(PRICED, balance=False))
    assert torch.equal(off.slot_expert_MLGJ, kept.slot_expert_MLGJ)


def _two_collapsed_layers(tokens_0: int, tokens_1: int):
    """``(loads, kept, share, margin)``: two one-node collapsed layers (8 GPUs, 32 experts,
    4 micro-batches, ``tokens_l`` per GPU in layer ``l``), the kept plan and the step-long
    sets by the share and the margin rule (``step_set.margin_sets``, both made)."""
    topo = Topology(1, 8, 32, 2)
    loads = torch.cat([_collapsed(topo, 4, 1, 0, 0.95, tokens=t) for t in (tokens_0, tokens_1)], 1)
    kept = keep_plan(loads, topo, topo.static_placement(2), PRICED)
    share, margin = (StepPlan(topo, kept.placement_LE, se, st, "relibra", kept.previous_placement_LE)
                     for se, st in margin_sets(loads, topo, kept.placement_LE, PRICED.min_replica_tokens_on(1)))
    return loads, kept, share, margin


def test_light_plan_weighs_the_margin_rule_against_the_share_rule():
    """Neither rule for how many copies an item gets is cheaper everywhere: on one collapsed
    layer the share rule's eighth instance of the hot expert keeps a GPU's own tokens local
    (the all-to-all it saves outweighs a fill), on the other its fills cost more than the
    compute they spread. The light plan takes each layer's cheaper set."""
    loads, kept, share, margin = _two_collapsed_layers(20, 40)
    idx = torch.arange(2)
    share_L, margin_L = layers_price(share, idx, loads, PRICED), layers_price(margin, idx, loads, PRICED)
    assert float(margin_L[0]) < 0.9 * float(share_L[0]) and float(share_L[1]) < 0.95 * float(margin_L[1])
    plan = light_plan(loads, kept, PRICED)
    for l, want in ((0, margin), (1, share)):
        assert torch.equal(plan.slot_expert_MLGJ[:, l], want.slot_expert_MLGJ[:, l])
        assert torch.equal(plan.slot_tokens_MLGJ[:, l], want.slot_tokens_MLGJ[:, l])
    assert torch.allclose(layers_price(plan, idx, loads, PRICED), torch.minimum(share_L, margin_L))


def test_the_share_rule_is_weighed_only_where_the_window_holds_it():
    """``room_L`` (``worth.Tiers.light_room_L``): a layer whose window does not hold a second
    set's host time gets the margin rule's set alone, even where the share rule's prices lower;
    the other layers are weighed as without it, and a layer planned alone is the same."""
    loads, kept, share, margin = _two_collapsed_layers(40, 40)
    idx = torch.arange(2)
    assert bool((layers_price(share, idx, loads, PRICED) < layers_price(margin, idx, loads, PRICED)).all())
    plan = light_plan(loads, kept, PRICED, room_L=torch.tensor([False, True]))
    for l, want in ((0, margin), (1, share)):
        assert torch.equal(plan.slot_expert_MLGJ[:, l], want.slot_expert_MLGJ[:, l])
        assert torch.equal(plan.slot_tokens_MLGJ[:, l], want.slot_tokens_MLGJ[:, l])
        alone = light_plan(loads[:, l:l + 1], kept.layers(torch.tensor([l])), PRICED, room_L=torch.tensor([l == 1]))
        assert torch.equal(alone.slot_expert_MLGJ[:, 0], want.slot_expert_MLGJ[:, l])
    none = light_plan(loads, kept, PRICED, room_L=torch.tensor([False, False]))
    assert torch.equal(none.slot_expert_MLGJ, margin.slot_expert_MLGJ)
    tiers = worth.Tiers(torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
                        schedules_s=0.4, floor=10.0, light_floor=1.0, scale=1.0, light_schedules=0.5, light_layer=0.8)
    assert tiers.light_room_L().tolist() == [False, True, True]   # window less 0.2 of schedules >= 1.8


@pytest.mark.parametrize("N", [1, 2])
def test_the_guard_sends_layers_between_the_floors_to_the_light_plan(N):
    """Three tiers: a layer whose gain bound and window reach the floor gets the full search;
    one that reaches only ``light_share`` of it the light plan; one below keeps its placement.
    The floors are set around the layer's own margin, so each tier is met on purpose."""
    topo = Topology(N, 4, N * 8, 2)
    loads = _collapsed(topo, 4, 1, 3, 0.95, tokens=500)
    prev = topo.static_placement(1)
    cfg = dataclasses.replace(PRICED, plan_layer_s=0.0, plan_layer_nodes_s=0.0, light_share=LIGHT_SHARE)
    margin = float(_exact_margin_L(loads, topo, prev, dataclasses.replace(cfg, plan_floor_s=1.0, plan_floor_nodes_s=1.0),
                             None)[0][0])
    full = relibra_plan(loads, topo, prev, dataclasses.replace(cfg, plan_floor_s=0.0, plan_floor_nodes_s=0.0))
    kept = keep_plan(loads, topo, prev, cfg)
    light = light_plan(loads, kept, cfg)
    assert not torch.equal(light.slot_expert_MLGJ, kept.slot_expert_MLGJ)      # the light plan copies here
    for floor, want in ((0.5 * margin, full), (1.5 * margin, light), (3.0 / LIGHT_SHARE * margin, kept)):
        got = relibra_plan(loads, topo, prev, dataclasses.replace(cfg, plan_floor_s=floor, plan_floor_nodes_s=floor))
        for name in ("placement_LE", "slot_expert_MLGJ", "slot_tokens_MLGJ"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (floor / margin, name)
    off = relibra_plan(loads, topo, prev, dataclasses.replace(cfg, plan_floor_s=1.5 * margin,
                                                              plan_floor_nodes_s=1.5 * margin, light_share=0.0))
    assert torch.equal(off.slot_expert_MLGJ, kept.slot_expert_MLGJ)


def test_light_tier_decisions_do_not_depend_on_the_share():
    """Split planning: each rank's share gets the same tiers and plans as the whole step.
    The floors are set between the layers' whole-step margins, so the four layers meet three
    tiers (and a share planned without the step's layer count would meet others)."""
    topo = Topology(1, 4, 8, 2)
    loads = torch.cat([_collapsed(topo, 4, 1, s, hot, tokens=300 * (s + 1))
                       for s, hot in enumerate([0.0, 0.5, 0.95, 0.95])], 1)
    L = loads.shape[1]
    prev = topo.static_placement(L)
    probe = dataclasses.replace(PRICED, plan_floor_s=1.0, plan_layer_s=0.0, plan_schedule_s=0.0)
    margin_L = _exact_margin_L(loads, topo, prev, probe, L)[0]
    m = margin_L.sort().values
    floor = float(m[2] + m[3]) / 2                                     # share 1: the floor is plan_floor_s
    share = float(m[0] + m[1]) / 2 / floor
    cfg = dataclasses.replace(probe, plan_floor_s=floor, light_share=share)
    tiers = [2 if x >= floor else 1 if x >= share * floor else 0 for x in margin_L.tolist()]
    assert sorted(tiers) == [0, 1, 1, 2]
    alone = _exact_margin_L(loads[:, :1], topo, prev[:1], probe, None)[0]     # without the step's count
    assert float(alone[0]) < float(margin_L[0])
    planner = ReLibraPlanner(topo, cfg)
    searched = []
    # no schedules and no per-layer light part: the light floor is light_share of the floor
    with mock.patch.object(host_time, "LIGHT_LAYER_S", 0.0), mock.patch.object(host_time, "LIGHT_EXPERT_S", 0.0):
        search = relibra_module._search
        with mock.patch.object(relibra_module, "_search", lambda loads_MLSE, *a, **k: searched.append(
                loads_MLSE.shape[1]) or search(loads_MLSE, *a, **k)):
            whole = planner.plan(loads)
        assert searched == [tiers.count(2)]                               # the full search ran on its tier
        El = topo.experts_per_gpu
        for l, tier in enumerate(tiers):
            copies = bool((whole.slot_expert_MLGJ[:, l, :, El:] >= 0).any())
            assert copies or tier == 0, (l, tier)
            if tier == 0:
                assert torch.equal(whole.slot_expert_MLGJ[:, l], keep_plan(loads, topo, prev, cfg).slot_expert_MLGJ[:, l])
        for r in range(topo.num_gpus):
            layers = layer_share(r, topo.num_gpus, L)
            part = planner.plan_layers(loads, layers)
            assert torch.equal(part.slot_expert_MLGJ, whole.slot_expert_MLGJ[:, layers])
            assert torch.equal(part.slot_tokens_MLGJ, whole.slot_tokens_MLGJ[:, layers])
            assert torch.equal(part.placement_LE, whole.placement_LE[layers])


def test_a_light_plan_is_kept_only_where_its_exact_saving_repays_its_host_time():
    """``light_plan``'s ``min_saving_L``: the guard admits a layer to the light tier on the
    gain bound, and keeps the step-long set only where the exact saving (keeping's price less
    the set's) exceeds the charge its schedules add; a layer whose saving falls
    short keeps its plan, the others are unchanged."""
    topo = Topology(1, 8, 8, 2)
    loads = torch.cat([_collapsed(topo, 8, 1, s, 0.95, tokens=500 * (s + 1)) for s in range(3)], 1)
    prev = topo.static_placement(3)
    kept = keep_plan(loads, topo, prev, PRICED)
    free = light_plan(loads, kept, PRICED)
    idx = torch.arange(3)
    saving_L = layers_price(kept, idx, loads, PRICED) - layers_price(free, idx, loads, PRICED)
    assert bool((saving_L > 0).all())                              # every layer copies with nothing to repay
    need_L = torch.stack([saving_L[0] * 0.5, saving_L[1] * 1.5, -saving_L[2]])
    got = light_plan(loads, kept, PRICED, need_L)
    for l, want in enumerate((free, kept, free)):
        assert torch.equal(got.slot_expert_MLGJ[:, l], want.slot_expert_MLGJ[:, l]), l
        assert torch.equal(got.slot_tokens_MLGJ[:, l], want.slot_tokens_MLGJ[:, l]), l


@pytest.mark.parametrize("N", [1, 2])
def test_the_guard_keeps_a_light_plan_only_where_its_exact_saving_pays(N):
    """The guard admits a layer to the light tier on the gain bound, ``U + W - s >= F'`` (``W``
    the window, ``s`` the light plan's schedules, ``F'`` its host time), then keeps the
    step-long set only where the exact saving ``S`` exceeds what the schedules add to the
    charge once ``F'`` is spent: ``max(0, F' - W + s) - max(0, F' - W)``. So ``s`` where the
    plan's own time fills the window, nothing where all fits, the overflow in between."""
    topo = Topology(N, 4, N * 8, 2)
    loads = _collapsed(topo, 4, 1, 3, 0.95, tokens=500)
    prev = topo.static_placement(1)
    cfg = dataclasses.replace(PRICED, plan_floor_s=1e3, plan_floor_nodes_s=1e3, light_share=LIGHT_SHARE)  # no full search
    kept = keep_plan(loads, topo, prev, cfg)
    light = light_plan(loads, kept, cfg)
    saving = float(layers_price(kept, torch.arange(1), loads, cfg)[0] - layers_price(light, torch.arange(1), loads, cfg)[0])
    gain_L, forward_L = worth.gain_bound_L(loads, topo, prev, cfg)      # one layer, share 1: W is the forward
    bound, w = float(gain_L[0]), float(forward_L[0])
    assert bound > saving > 0 and w > 0
    mid = (saving + bound) / 2                                     # above the saving, below the bound
    over = min(mid, w / 2 + 0.5 * saving)                          # schedules the window cannot all hold
    cases = ((mid, w + (bound - mid) / 2, kept),                   # window spent by F': needs S > s
             (0.5 * saving, w + (bound - 0.5 * saving) / 2, light),
             (0.0, w / 2, light),                                  # all fits: any saving
             (over, w - over + 0.5 * saving, light))               # overflow 0.5 S of the schedules
    for sched, light_floor, want in cases:
        c = dataclasses.replace(cfg, plan_schedule_s=sched / light_schedule_share(topo) / 0.5)  # M / 8 = 0.5, one layer
        with mock.patch.object(worth, "light_floor_s", lambda *a, f=light_floor: f), \
                mock.patch.object(worth, "_quick_bound_L", worth.gain_bound_L):
            t = worth._tiers(loads, topo, prev, c, None)
            assert not bool(t.full_L()[0]) and bool(t.light_L()[0]), (sched, light_floor)
            need = max(0.0, light_floor - w + sched) - max(0.0, light_floor - w)
            torch.testing.assert_close(float(t.light_saving_L()[0]), need, rtol=1e-9, atol=1e-15)
            got = relibra_plan(loads, topo, prev, c)
        assert torch.equal(got.slot_expert_MLGJ, want.slot_expert_MLGJ), (sched / saving, light_floor)
        assert torch.equal(got.slot_tokens_MLGJ, want.slot_tokens_MLGJ), (sched / saving, light_floor)


def test_the_guard_weighs_the_share_rule_where_its_window_has_room():
    """The guard hands the light plan ``Tiers.light_room_L`` of its light layers: a wide window
    (the light floor small) weighs the share rule's set too, a window its light floor fills
    does not, and the plans differ on a layer where the share rule prices lower."""
    topo = Topology(1, 8, 32, 2)
    loads = _collapsed(topo, 4, 1, 0, 0.95, tokens=40)
    prev = topo.static_placement(1)
    cfg = dataclasses.replace(PRICED, plan_floor_s=1e3, plan_floor_nodes_s=1e3, light_share=LIGHT_SHARE,
                              plan_schedule_s=0.0)   # no full search; no schedules
    kept = keep_plan(loads, topo, prev, cfg)
    share, margin = margin_sets(loads, topo, prev, cfg.min_replica_tokens_on(1))
    _, forward_L = worth.gain_bound_L(loads, topo, prev, cfg)
    w = float(forward_L[0])                       # one layer, share 1: the window is the forward
    seen = []

    def spy(*args):
        seen.append(args[4].tolist())
        return light_plan(*args)
    for light_floor, room, want in ((0.1 * w, True, share), (0.99 * w, False, margin)):
        with mock.patch.object(worth, "light_floor_s", lambda *a, f=light_floor: f), \
                mock.patch.object(worth, "light_layer_s", lambda *a: 0.05 * w), \
                mock.patch.object(worth, "light_plan", spy):
            got = relibra_plan(loads, topo, prev, cfg)
        assert seen[-1] == [room]
        assert torch.equal(got.slot_expert_MLGJ, want[0]) and torch.equal(got.slot_tokens_MLGJ, want[1])
    assert not torch.equal(share[0], margin[0]) and not torch.equal(kept.slot_expert_MLGJ, share[0])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([1, 2]), g=st.sampled_from([2, 4, 8]),
       El=st.sampled_from([1, 4]), R=st.sampled_from([0, 1, 2]), M=st.integers(1, 4), L=st.integers(1, 3),
       hot=st.sampled_from([0.0, 0.5, 0.95]), tokens=st.sampled_from([20, 400]))
def test_the_hot_expert_estimate_is_below_the_bounds_compute_part(seed, N, g, El, R, M, L, hot, tokens):
    """``light.hot_spread_saving_L``: never negative, at most the gain bound's expert-compute
    part (the busiest GPU's pairs above the mean, per micro-batch) and so at most the bound;
    0 across nodes and without replica slots."""
    topo = Topology(N, g, N * g * El, R)
    loads = _collapsed(topo, M, L, seed, hot, tokens=tokens)
    prev = topo.static_placement(L)
    est_L = hot_spread_saving_L(loads, topo, prev, PRICED)
    assert est_L.shape == (L,) and bool((est_L >= 0).all())
    if N > 1 or R == 0:
        assert bool((est_L == 0).all())
    gpu_MLG = torch.zeros(M, L, topo.num_gpus, dtype=torch.int64).scatter_add_(
        2, (prev // El).expand(M, L, -1), loads.sum(2))
    G = topo.num_gpus
    compute_L = ((gpu_MLG.amax(-1) - (gpu_MLG.sum(-1) + G - 1) // G).sum(0).to(torch.float64)
                 * PRICED.compute_s_per_token)
    assert bool((est_L <= compute_L + 1e-15).all())
    assert bool((est_L <= worth.gain_bound_L(loads, topo, prev, PRICED)[0] + 1e-15).all())


def test_the_light_tier_admits_a_collapsed_layer_on_its_hot_expert():
    """A rank plans 2 of the step's 12 layers on 8 GPUs, so its plan saves 6 layers' worth per
    share-layer. A collapsed layer whose gain bound, counted once, is below the light floor,
    but whose hot expert's estimate counted 6 times is above it, gets the light plan (the
    stand-in ``switch-256/collapsed/t32x8/1x8``); without the estimate it does not, and a
    balanced layer is not admitted either way."""
    topo = Topology(1, 8, 64, 2)
    loads = torch.cat([_collapsed(topo, 8, 1, 0, 0.95, tokens=64), _collapsed(topo, 8, 1, 1, 0.0, tokens=64)], 1)
    prev = topo.static_placement(2)
    cfg = dataclasses.replace(PRICED, plan_floor_s=1e3, plan_floor_nodes_s=1e3, light_share=LIGHT_SHARE,
                              plan_schedule_s=0.0)   # no full search; no schedules
    with mock.patch.object(worth, "_quick_bound_L", worth.gain_bound_L):
        t = worth._tiers(loads, topo, prev, cfg, 12)
    assert t.scale == 6.0
    hot = float(hot_spread_saving_L(loads, topo, prev, cfg)[0])
    gain, window = float(t.gain_L[0]), float(t.light_window_L()[0])
    assert 6 * hot > gain > 0
    floor = window + (gain + 6 * hot) / 2                        # between the bound once and the estimate
    with mock.patch.object(worth, "light_floor_s", lambda *a: floor), \
            mock.patch.object(worth, "_quick_bound_L", worth.gain_bound_L):
        t = worth._tiers(loads, topo, prev, cfg, 12)
        assert t.light_L().tolist() == [True, False]
        assert t._replace(hot_saving_L=None).light_L().tolist() == [False, False]
        plan = relibra_plan(loads, topo, prev, cfg, total_layers=12)
    El = topo.experts_per_gpu
    assert bool((plan.slot_expert_MLGJ[:, 0, :, El:] >= 0).any())          # the light plan's copies
    assert not bool((plan.slot_expert_MLGJ[:, 1, :, El:] >= 0).any())      # the balanced layer kept


def test_a_layer_rides_the_light_plan_another_rank_runs():
    """Three one-layer shares on four GPUs: a collapsed layer admitted to the light tier, a
    half-collapsed one below it whose gain bound covers its own part of the light plan, and a
    balanced one whose bound does not. Where the collapsed layer is planned, some rank spends
    the light plan's fixed host time anyway, so the half-collapsed layer gets the light plan
    too, on its own rank (which learns it from the step's loads) as in the whole-step plan;
    where no layer of the step is planned it is kept, and the balanced layer always is."""
    topo = Topology(1, 4, 8, 2)
    El = topo.experts_per_gpu
    loads = torch.cat([_collapsed(topo, 4, 1, s, hot) for s, hot in enumerate([0.95, 0.5, 0.0])], 1)
    L, prev = loads.shape[1], topo.static_placement(3)
    cfg = dataclasses.replace(PRICED, plan_floor_s=1e3, plan_floor_nodes_s=1e3, plan_schedule_s=0.0,
                              light_share=LIGHT_SHARE)   # no full search, no schedules
    exact = mock.patch.object(worth, "_quick_bound_L", worth.gain_bound_L)
    with exact:
        t = worth._tiers(loads, topo, prev, cfg, L)
    counted_L = torch.maximum(t.gain_L, t.scale * hot_spread_saving_L(loads, topo, prev, cfg)) + t.light_window_L()
    assert float(counted_L[0]) > float(counted_L[1:].max()) and float(t.gain_L[2]) < float(t.gain_L[1])
    floor = float(counted_L[0] + counted_L[1:].max()) / 2              # admits the collapsed layer alone
    part = float(t.gain_L[1] + t.gain_L[2]) / 2                        # covered by the half-collapsed bound
    planner = ReLibraPlanner(topo, cfg)

    def copies_L(plan: StepPlan) -> list[bool]:
        return [bool((plan.slot_expert_MLGJ[:, l, :, El:] >= 0).any()) for l in range(plan.num_layers)]

    with exact, mock.patch.object(worth, "light_floor_s", lambda *a: floor), \
            mock.patch.object(worth, "light_layer_s", lambda *a: part):
        t = worth._tiers(loads, topo, prev, cfg, L)
        assert t.light_L().tolist() == [True, False, False] and t.ride_L().tolist() == [False, True, False]
        whole = planner.plan(loads)
        assert copies_L(whole) == [True, True, False]
        for r in range(L):                                             # each rank plans its layer alone
            got = planner.plan_layers(loads, [r])
            assert torch.equal(got.slot_expert_MLGJ, whole.slot_expert_MLGJ[:, [r]])
            assert torch.equal(got.slot_tokens_MLGJ, whole.slot_tokens_MLGJ[:, [r]])
        # without the collapsed layer nothing of the step is planned: the layer is kept
        calm = torch.cat([_collapsed(topo, 4, 1, 7, 0.0), loads[:, 1:]], 1)
        assert copies_L(planner.plan(calm)) == [False, False, False]
        assert copies_L(planner.plan_layers(calm, [1])) == [False]
        with mock.patch.object(worth.Tiers, "ride_L", lambda self: torch.zeros_like(self.gain_L, dtype=torch.bool)):
            assert copies_L(planner.plan(loads)) == [True, False, False]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([1, 2]), L=st.integers(2, 8), M=st.integers(1, 4),
       hots=st.lists(st.sampled_from([0.0, 0.5, 0.8, 0.95]), min_size=8, max_size=8),
       floor_at=st.floats(0.05, 0.95), part_at=st.floats(0.0, 1.0), dispatch=st.sampled_from(["flat", "hierarchical"]))
@example(seed=0, N=1, L=4, M=1, hots=[0.0, 0.0, 0.8, 0.95, 0.0, 0.0, 0.0, 0.0], floor_at=0.5, part_at=0.203125,
         dispatch="flat")
def test_split_planning_gives_the_whole_step_plan_with_riding_layers(seed, N, L, M, hots, floor_at, part_at, dispatch):
    """One-layer shares on eight GPUs, the light floor drawn between the two highest margins
    (one layer admitted) and its per-layer part below the highest gain bound (others may
    ride): every rank's share plans as the whole step does, so a layer rides on its rank, which
    learns from the step's loads that another is planned, exactly where it rides in the
    whole-step plan. (On one node the cheaper bound once let a lone layer's share ride where
    the whole step's exact bound did not: the example.) Under hierarchical dispatch every
    layer carries the same pairs per source, as replayed routing does (every token passes
    every MoE layer with its top-k): a rank's tokens are its first layer's pairs // top_k,
    as the simulator counts them, so a share must see the step's tokens."""
    topo = Topology(N, 8 // N, 16, 2)
    if dispatch == "flat":
        loads = torch.cat([_collapsed(topo, M, 1, seed + l, hots[l], tokens=200) for l in range(L)], 1)
    else:  # each layer 400 pairs per source, hots[l] of them on one expert
        loads = torch.cat([_collapsed(topo, M, 1, seed + l, 0.0, tokens=400 - int(400 * hots[l])) for l in range(L)], 1)
        for l in range(L):
            loads[:, l, :, l * 5 % 16] += int(400 * hots[l])
        assert bool((loads.sum(-1) == 400).all())
    prev = topo.static_placement(L)
    cfg = dataclasses.replace(PRICED, plan_floor_s=1e3, plan_floor_nodes_s=1e3, plan_schedule_s=0.0,
                              light_share=LIGHT_SHARE, dispatch=dispatch, top_k=2 if dispatch == "hierarchical" else 0)
    t = worth._tiers(loads, topo, prev, cfg, L)
    hot_L = hot_spread_saving_L(loads, topo, prev, cfg)
    top = (torch.maximum(t.light_bound_L(), t.scale * hot_L) + t.light_window_L()).sort(descending=True).values
    floor = float(top[1] + floor_at * (top[0] - top[1]))
    part = float(part_at * t.light_bound_L().max())
    planner = ReLibraPlanner(topo, cfg)
    with mock.patch.object(worth, "light_floor_s", lambda *a: floor), \
            mock.patch.object(worth, "light_layer_s", lambda *a: part):
        whole = planner.plan(loads)
        for r in range(L):
            got = planner.plan_layers(loads, [r])
            assert torch.equal(got.slot_expert_MLGJ, whole.slot_expert_MLGJ[:, [r]])
            assert torch.equal(got.slot_tokens_MLGJ, whole.slot_tokens_MLGJ[:, [r]])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), N=st.sampled_from([1, 2]), L=st.integers(1, 4), M=st.integers(1, 4),
       hot=st.sampled_from([0.0, 0.5, 0.95]), tokens=st.sampled_from([20, 100, 400]), total=st.sampled_from([1, 4, 12]),
       floor_at=st.floats(0.0, 1.5))
def test_the_hot_expert_estimate_is_skipped_only_where_it_cannot_admit(seed, N, L, M, hot, tokens, total, floor_at):
    """The guard computes the hot expert's estimate only where ``scale`` times the bound could
    reach the light floor; the tiers (light and riding) are those with the estimate computed."""
    topo = Topology(N, 8 // N, 16, 2)
    loads = torch.cat([_collapsed(topo, M, 1, seed + l, hot, tokens) for l in range(L)], 1)
    prev, cfg = topo.static_placement(L), dataclasses.replace(PRICED, host_scale=0.5, host_scale_nodes=0.5)
    total = max(total, L)
    hot_L = hot_spread_saving_L(loads, topo, prev, cfg)
    t = worth._tiers(loads, topo, prev, cfg, total)
    floor = floor_at * max(float((t.scale * torch.maximum(t.gain_L, hot_L) + t.light_window_L()).max()), 1e-9)
    with mock.patch.object(worth, "light_floor_s", lambda *a: floor):
        t = worth._tiers(loads, topo, prev, cfg, total)
    full = t._replace(hot_saving_L=hot_L)
    assert torch.equal(t.light_L(), full.light_L()) and torch.equal(t.ride_L(), full.ride_L())
    if t.hot_saving_L is None:   # the light tier off (a zero floor), or no layer within reach
        assert floor <= 0 or bool((t.scale * t.gain_L + t.light_window_L() < floor).all())
