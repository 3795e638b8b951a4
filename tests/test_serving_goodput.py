"""Goodput search invariants on a tiny model (hypothesis), the cost model's roofline, determinism."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.planning.pricing import get_hardware
from relibra_torch.serving.compare import CompareSetup, compare
from relibra_torch.serving.constants import DEFAULT_CONSTANTS
from relibra_torch.serving.cost import ServingCost
from relibra_torch.serving.goodput import best_config, goodput, run_config
from relibra_torch.serving.requests import Requests
from relibra_torch.serving.routing import synthetic_popularity
from relibra_torch.serving.systems import Cluster, enumerate_configs
from relibra_torch.sim.presets import ModelSpec, get_model

# small enough to simulate fast, big enough that a burst of its requests takes tens of ms
TINY = ModelSpec("tiny", num_layers=16, num_moe_layers=16, hidden_size=4096, moe_ffn=2048, num_experts=16,
                 top_k=2, num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=32000)
# min_trace_s=0: the invariants hold on any trace, and the tiny model's goodputs (thousands of
# req/s) would repeat these 40 requests into 50,000 per run (the repetition is tested below)
TIGHT = replace(DEFAULT_CONSTANTS, ttft_slo_s=0.05, tpot_slo_s=0.004, min_trace_s=0.0)


@lru_cache(maxsize=None)
def _pi():
    return synthetic_popularity(TINY.num_moe_layers, TINY.num_experts, TINY.top_k, 0)


def _requests(n: int = 40, seed: int = 0) -> Requests:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(0.05, n))
    return Requests(t - t[0], rng.integers(50, 3000, n), rng.integers(2, 200, n), "test")


def _cluster(gpus: int, consts=TIGHT) -> Cluster:
    cost = ServingCost(TINY, get_hardware("h200"), consts)
    return Cluster(gpus, 8, cost, _pi(), _pi())


def _best(system: str, gpus: int, consts=TIGHT, allow_idle: bool = True):
    cl = _cluster(gpus, consts)
    reqs = _requests()
    need = int((reqs.prompt_N + reqs.output_N).max())
    return best_config(enumerate_configs(system, cl, need, allow_idle=allow_idle), cl, reqs)


@settings(max_examples=4, deadline=None)
@given(st.sampled_from(["pd-disagg", "expertplex", "chunked-prefill"]),
       st.floats(0.02, 0.1), st.floats(0.003, 0.008), st.floats(1.0, 3.0))
def test_goodput_is_monotone_in_slo_looseness(system, ttft, tpot, looser):
    tight = replace(TIGHT, ttft_slo_s=ttft, tpot_slo_s=tpot)
    loose = replace(TIGHT, ttft_slo_s=ttft * looser, tpot_slo_s=tpot * looser)
    assert _best(system, 4, loose).rate >= _best(system, 4, tight).rate


@settings(max_examples=3, deadline=None)
@given(st.sampled_from(["colocated", "pd-disagg", "expertplex"]), st.integers(3, 4))
def test_total_goodput_is_monotone_in_cluster_size_when_gpus_may_idle(system, gpus):
    # with allow_idle every configuration of G GPUs is one of G + 1 GPUs too
    assert _best(system, gpus + 1).rate >= _best(system, gpus).rate


def test_goodput_is_the_highest_grid_rate_meeting_the_target():
    cl = _cluster(4)
    reqs = _requests()
    cfg = enumerate_configs("pd-disagg", cl, 4000)[0]
    g = goodput(cfg, cl, reqs)
    assert g.rate > 0
    assert run_config(cfg, cl, reqs.scaled(g.scale)).attainment >= 0.9
    assert run_config(cfg, cl, reqs.scaled(g.scale * 2 ** (1 / 32))).attainment < 0.9


def test_decode_is_bandwidth_bound_and_prefill_compute_bound():
    m = get_model("minimax-m2")
    cost = ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS)
    cl = Cluster(8, 8, cost, synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0),
                 synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0))
    t = cl.table(8)
    dec = cost.parts(64, 64 * 2000, 64 * 2000, 64, 8, t, 8, (7 / 8, 0.0))
    assert dec.moe_memory_s > 3 * dec.moe_compute_s  # weights read for 64 tokens
    assert all(mem > comp for comp, mem in dec.attn)  # the KV cache and the weights
    pre = cost.parts(65536, 65536 * 1000, 0, 64, 8, t, 8, (7 / 8, 0.0))
    assert pre.moe_compute_s > pre.moe_memory_s
    # MoE time follows the tile footprint: ~1 row per active expert costs a full tile each
    assert dec.moe_tiles >= t.active(64) - 1e-9


def test_a_measured_tile_time_replaces_the_roofline_one():
    m = get_model("minimax-m2")
    a = ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS)
    b = ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS, tile_time_us=2 * a.tile_time_s * 1e6)
    assert b.tile_time_s == pytest.approx(2 * a.tile_time_s) and b.sm_tile_s == pytest.approx(2 * a.sm_tile_s)


def test_memory_check_rejects_instances_that_do_not_hold_the_weights():
    m = get_model("minimax-m2")  # ~225 GB of FP8 experts: one 80 GB H800 cannot hold them
    cost = ServingCost(m, get_hardware("h800"), DEFAULT_CONSTANTS)
    cl = Cluster(16, 8, cost, synthetic_popularity(62, 256, 8, 0), synthetic_popularity(62, 256, 8, 0))
    sizes = {c.get("gpus_per_instance") for c in enumerate_configs("pd-disagg", cl, 5000)}
    assert 1 not in sizes and 2 not in sizes and 4 in sizes
    assert all(c.get("expert_gpus") >= 4 for c in enumerate_configs("expertplex", cl, 5000))


def test_comparison_is_deterministic_for_a_seed():
    def doc():
        setup = CompareSetup(TINY, get_hardware("h200"), TIGHT, 1, 4, _requests(40), _pi(),
                             ("expertplex", "pd-colocate"), "synthetic", seed=0)
        d = compare(setup)
        d.pop("seconds")
        return d
    assert doc() == doc()


def test_data_parallel_iterations_pay_the_scheduler_sync_once_per_step():
    from relibra_torch.serving.systems import SystemConfig, build_engine

    m = get_model("minimax-m2")
    pi = synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0)

    def step(system, knobs, consts):
        cl = Cluster(16, 8, ServingCost(m, get_hardware("h200"), consts), pi, pi)
        eng = build_engine(SystemConfig(system, knobs, 16), cl, np.zeros(1), np.ones(1, np.int64),
                           np.ones(1, np.int64))
        return [x.pricer.decode_s(256, 256 * 1000.0) for x in eng.executors if x.mode != "prefill"][0]

    off = replace(DEFAULT_CONSTANTS, dp_sync_us=0.0)
    colo = (("gpus_per_instance", 4), ("instances", 4))
    assert step("colocated", colo, DEFAULT_CONSTANTS) - step("colocated", colo, off) == pytest.approx(455e-6)
    one = (("gpus_per_instance", 1), ("instances", 16))  # one GPU: no gather, no sync
    assert step("chunked-prefill", one, DEFAULT_CONSTANTS) == step("chunked-prefill", one, off)
    xp = (("expert_gpus", 4), ("prefill_attention_gpus", 4), ("decode_attention_gpus", 8), ("prefill_near_experts", 1))
    assert step("expertplex", xp, DEFAULT_CONSTANTS) - step("expertplex", xp, off) == pytest.approx(455e-6)


def test_each_expertplex_prefill_gpu_is_priced_on_its_own_links():
    from relibra_torch.serving.systems import SystemConfig, build_engine

    m = get_model("minimax-m2")
    pi = synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0)
    cl = Cluster(16, 8, ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS), pi, pi)

    def prefill_times(n_ap, n_ad):
        knobs = (("expert_gpus", 4), ("prefill_attention_gpus", n_ap), ("decode_attention_gpus", n_ad),
                 ("prefill_near_experts", 1))
        eng = build_engine(SystemConfig("expertplex", knobs, 16), cl, np.zeros(1), np.ones(1, np.int64),
                           np.ones(1, np.int64))
        return [x.pricer.prefill_s(16384, 16 * 1024 * 1025 / 2, 0, 16) for x in eng.executors if x.mode == "prefill"]

    near_only = prefill_times(4, 8)  # GPUs 4-7 share the experts' node
    mixed = prefill_times(8, 4)  # GPUs 4-7 near, 8-11 on the other node
    assert len(set(near_only)) == 1 and mixed[:4] == pytest.approx(near_only)
    assert min(mixed[4:]) > 2 * max(mixed[:4])  # RDMA at 45 GB/s vs NVLink at 360 GB/s


def test_expertplex_may_use_any_count_of_expert_gpus():
    import torch

    from relibra_torch.serving.routing import build_tile_table, static_placement

    slots = static_placement(2, 10, 3)  # 4 + 3 + 3 experts, the short GPUs' last slot empty
    assert slots[0].tolist() == [[0, 1, 2, 3], [4, 5, 6, -1], [7, 8, 9, -1]]
    pi = torch.full((2, 10), 0.5, dtype=torch.float64)  # every expert gets rows at any size
    table = build_tile_table(pi, slots, 64)
    assert table.active(4096) == 4.0 and table.tiles(4096) >= 4.0  # the 4-expert GPU is the slowest
    m = get_model("minimax-m2")  # 256 experts on 16 H200: 2 (the fewest that hold them) to 14
    pi_m = synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0)
    cl = Cluster(16, 8, ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS), pi_m, pi_m)
    counts = {c.get("expert_gpus") for c in enumerate_configs("expertplex", cl, 5000)}
    assert counts == set(range(2, 15))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_replicated_placement_is_eplb_where_gpus_divide_experts_and_holds_every_expert_on_any_count(
        E, G, r, L, seed):
    import torch

    from relibra_torch.planning.eplb import eplb_slots
    from relibra_torch.planning.topology import Topology
    from relibra_torch.serving.routing import replicated_placement

    G = min(G, E)
    w_LE = torch.rand(L, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) ** 3
    slots_LGJ = replicated_placement(w_LE, G, r)
    J = -(-E // G) + r
    assert slots_LGJ.shape == (L, G, J) and bool((slots_LGJ >= 0).all())     # no slot left empty
    count_LE = torch.stack([torch.bincount(s.flatten(), minlength=E) for s in slots_LGJ])
    assert bool((count_LE >= 1).all()) and int(count_LE.sum()) == L * G * J   # every expert at least once
    # copies go to the most load per copy: no expert with fewer copies carries more load per copy
    # than the least-per-copy expert that was given an extra one would without it
    per_copy_LE = w_LE / count_LE
    extra_LE = count_LE > 1
    for l in range(L):
        if bool(extra_LE[l].any()):
            least = (w_LE[l] / (count_LE[l] - 1))[extra_LE[l]].min()
            assert float(per_copy_LE[l].max()) <= float(least) + 1e-12
    if E % G == 0:
        assert torch.equal(slots_LGJ, eplb_slots(w_LE, Topology(1, G, E, r)))


def test_expertplex_repl_searches_every_count_of_expert_gpus():
    m = get_model("minimax-m2")  # 256 experts: 5 expert GPUs hold 52 + r slots each
    pi_m = synthetic_popularity(m.num_moe_layers, m.num_experts, m.top_k, 0)
    cl = Cluster(16, 8, ServingCost(m, get_hardware("h200"), DEFAULT_CONSTANTS), pi_m, pi_m)
    counts = {c.get("expert_gpus") for c in enumerate_configs("expertplex-repl", cl, 5000)}
    assert {3, 5, 6, 7} <= counts


def test_balanced_placement_puts_every_ep_group_in_eplbs_layout():
    from relibra_torch.serving.routing import build_tile_table, replicated_placement, static_placement

    for switch, layout in ((0.0, lambda cl, g: static_placement(*cl.pi_LE.shape, g)),
                           (1.0, lambda cl, g: replicated_placement(cl.recent_LE, g, 0))):
        cl = _cluster(16, replace(TIGHT, balanced_placement=switch))
        for g in (3, 4, 8):   # an ExpertPlex expert group (uneven) and instances
            want = build_tile_table(cl.pi_LE, layout(cl, g), TIGHT.tile_m, cl.seed)
            got = cl.table(g)
            assert np.array_equal(got.max_tiles_T, want.max_tiles_T) and np.array_equal(got.max_active_T,
                                                                                         want.max_active_T)
    # the slowest GPU's tiles under EPLB's layout at most contiguous blocks' on this skewed routing
    blocks = _cluster(16).table(4).tiles(16384)
    assert _cluster(16, replace(TIGHT, balanced_placement=1.0)).table(4).tiles(16384) <= blocks
    with pytest.raises(ValueError, match=r"serving.balanced_placement = 0.5; allowed: 0 \(contiguous"):
        replace(TIGHT, balanced_placement=0.5)


def test_deepep_time_scales_with_bytes_per_rank_and_only_decode_pays_it():
    # the README's times are its 128 tokens x top-8 x 7168 hidden moved at its bandwidths
    ds = ServingCost(get_model("deepseek-v3"), get_hardware("h800"), DEFAULT_CONSTANTS)
    assert ds.a2a_floor_s(8, 128) == pytest.approx(191e-6) and ds.a2a_floor_s(8, 256) == pytest.approx(382e-6)
    assert ds.a2a_floor_s(16, 64) == pytest.approx(313e-6 / 2)
    mm = ServingCost(get_model("minimax-m2"), get_hardware("h200"), DEFAULT_CONSTANTS)  # hidden 3072
    assert mm.a2a_floor_s(4, 40) == pytest.approx(191e-6 * 40 * 3072 / (128 * 7168))
    t = Cluster(8, 8, mm, _pi_mm := synthetic_popularity(62, 256, 8, 0), _pi_mm).table(8)
    dec = mm.parts(320, 320 * 1000, 320 * 1000, 320, 8, t, 8, (7 / 8, 0.0), decode=True)
    pre = mm.parts(320, 320 * 160, 0, 1, 8, t, 8, (7 / 8, 0.0))  # DeepEP's normal kernels: bytes only
    assert dec.comm_floor_s == pytest.approx(62 * mm.a2a_floor_s(8, 40)) and pre.comm_floor_s == 0.0


def test_transfers_are_priced_by_the_slower_of_sender_egress_and_receiver_ingress():
    from relibra_torch.serving.systems import _ExpertPlex

    cost = ServingCost(TINY, get_hardware("h200"), TIGHT)
    # one GPU sending over RDMA only: 1 / rdma s per byte; 8 such senders into 2 receivers:
    # each receiver's NIC takes 4 bytes per byte sent, so the ingress binds (4x slower)
    assert cost.link_s((0.0, 1.0)) == pytest.approx(1 / cost.rdma)
    assert cost.link_s((0.0, 1.0), (0.0, 4.0)) == pytest.approx(4 / cost.rdma)
    assert cost.link_s((0.0, 1.0), (0.5, 0.0)) == pytest.approx(1 / cost.rdma)  # egress binds
    table = _cluster(8).table(2)
    one = cost.parts(4096, 4096.0 * 2049, 0, 2, 1, table, 2, (0.0, 1.0))
    fan_in = cost.parts(4096, 4096.0 * 2049, 0, 2, 1, table, 2, (0.0, 1.0), ingress=(0.0, 4.0))
    assert fan_in.comm_bytes_s == pytest.approx(4 * one.comm_bytes_s) and fan_in.moe_tiles == one.moe_tiles
    # ExpertPlex: 2 expert GPUs on node 0, 6 decode GPUs next to them, 16 prefill GPUs on
    # nodes 1-2: all 16 prefilling at once put 16 / 2 = 8 bytes per byte sent on each
    # receiving NIC; one alone puts 1/2 (its own egress then binds)
    px = _ExpertPlex(_cluster(24), 2, 16, 6, 0, prefill_near=False)
    assert px.ingress(px.prefill_nodes) == pytest.approx((0.0, 8.0))
    assert px.ingress(px.prefill_nodes[:1]) == pytest.approx((0.0, 0.5))
    assert px.decode_ingress == pytest.approx((3.0, 0.0))  # 6 same-node decode GPUs into 2


def test_two_micro_batches_take_the_max_of_stages_where_that_is_faster():
    from relibra_torch.serving.cost import pair_s
    from relibra_torch.serving.systems import _ExpertPlex, _Instance

    # one micro-batch: attention 2, all-to-all 1, experts 1 (half-batch times)
    assert pair_s(2.0, 1.0, 1.0, same_gpus=True) == 6.0  # the shared GPU computes both: 2 (2 + 1)
    assert pair_s(2.0, 1.0, 1.0, same_gpus=False) == 4.0  # the attention GPU binds: 2 x 2
    assert pair_s(0.5, 3.0, 0.5, same_gpus=False) == 6.0  # the links bind
    assert pair_s(1.0, 1.0, 1.0, same_gpus=False) == 3.0  # one micro-batch's own chain binds
    off = replace(TIGHT, micro_batch_overlap=0.0)
    on_cl, off_cl = _cluster(16), _cluster(16, off)
    # a 2-node EP16 prefill: compute and RDMA traffic are comparable, so overlapping pays
    pairs = 16 * 2048.0 * 2049 / 2
    on, seq = _Instance(on_cl, 16).prefill_s(32768, pairs, 0, 16), _Instance(off_cl, 16).prefill_s(32768, pairs, 0, 16)
    assert on < 0.9 * seq
    # a small decode batch is bound by weight reads, which two micro-batches would double
    assert _Instance(on_cl, 16).decode_s(16, 16 * 1000.0) == _Instance(off_cl, 16).decode_s(16, 16 * 1000.0)
    # ExpertPlex: a prefill GPU's attention overlaps the expert GPUs' work on the other half
    on_px, off_px = _ExpertPlex(on_cl, 4, 4, 8, 0, True), _ExpertPlex(off_cl, 4, 4, 8, 0, True)
    assert on_px.prefill_s(8192, 8192.0 * 8193 / 2, 0, 1) < 0.9 * off_px.prefill_s(8192, 8192.0 * 8193 / 2, 0, 1)


def test_a_system_with_no_configuration_gets_no_ratio():
    """A system none of whose configurations fits (too few GPUs for its servers, or too
    little memory) has no goodput to compare: its ratio is ``None`` (shown ``-``), not 0.00x."""
    from relibra_torch.serving.compare import _ratios

    none = {"fits": False, "goodput": 0.0}
    ran = {"fits": True, "goodput": 4.0}
    assert _ratios({"expertplex": none, "colocated": ran}) == {"expertplex/colocated": None}
    assert _ratios({"expertplex": ran, "pd-disagg": none}) == {"expertplex/pd-disagg": None}
    assert _ratios({"expertplex": ran, "colocated": {"fits": True, "goodput": 2.0}}) == {"expertplex/colocated": 2.0}


def test_goodput_zero_says_why_and_requests_past_the_context_window_are_counted():
    """A system no rate serves gets a note naming the slowest rate tried and an attainment
    bound, its curve only complete runs; requests longer than the model's context window
    are counted in a note."""
    from relibra_torch.serving.compare import CompareSetup, context_notes

    reqs = _requests(12)
    impossible = replace(TIGHT, ttft_slo_s=1e-9)
    setup = CompareSetup(TINY, get_hardware("h200"), impossible, 1, 8, reqs, _pi(), ("colocated",), "test")
    r = compare(setup)["systems"]["colocated"]
    assert r["goodput"] == 0.0 and r["note"].startswith("no rate tried met the SLO: even at ")
    assert all(p[2] for p in r["curve"])
    # the attainment of a complete run at the slowest rate, not the early-stopped run's bound
    assert "at most" not in r["note"] and "the slowest tried, 0% of requests met it (P90 needs 90%)" in r["note"]
    assert min(r["curve"])[1] == 0.0
    long = int((reqs.prompt_N + reqs.output_N).max())
    assert context_notes(reqs, TINY) == []                                   # unknown window: no claim
    assert context_notes(reqs, replace(TINY, max_context=long)) == []
    over = int(((reqs.prompt_N + reqs.output_N) > long - 1).sum())
    note = context_notes(reqs, replace(TINY, max_context=long - 1))[0]
    assert note.startswith(f"{over} of 12 requests need more than tiny's context window ({long - 1:,} tokens")


def test_expertplex_runs_as_several_groups_of_whole_nodes():
    """``groups``: deployments alike of ``group_nodes`` whole nodes each (every node used; with
    idle GPUs allowed any that fit, so a cluster's configurations stay those of a larger one),
    every group's servers on its own nodes; requests finish once (run_config raises
    otherwise), and two groups serve at least what one group of the same shape serves on one
    node."""
    from relibra_torch.serving.systems import SystemConfig, build_engine

    cl2 = _cluster(16)
    reqs = _requests()
    need = int((reqs.prompt_N + reqs.output_N).max())
    configs = enumerate_configs("expertplex", cl2, need)
    grouped = [c for c in configs if dict(c.knobs).get("groups", 1) == 2]
    assert grouped and all(c.gpus == 2 * (c.get("expert_gpus") + c.get("prefill_attention_gpus")
                                          + c.get("decode_attention_gpus")) <= 16 for c in grouped)
    assert not [c for c in enumerate_configs("expertplex", _cluster(8), need) if "groups" in dict(c.knobs)]
    assert not [c for c in enumerate_configs("expertplex", _cluster(17), need) if "groups" in dict(c.knobs)]
    idle = {c for c in enumerate_configs("expertplex", _cluster(16), need, allow_idle=True)}
    assert {c for c in enumerate_configs("expertplex", _cluster(17), need, allow_idle=True)} >= idle
    assert {c for c in enumerate_configs("expertplex", _cluster(24), need, allow_idle=True)} >= idle
    knobs = (("expert_gpus", 2), ("prefill_attention_gpus", 2), ("decode_attention_gpus", 4),
             ("prefill_near_experts", 1))
    two = SystemConfig("expertplex", knobs + (("groups", 2), ("group_nodes", 1)), 16)
    eng = build_engine(two, cl2, reqs.arrival_N, reqs.prompt_N, reqs.output_N)
    nodes = {x.name: x.node for x in eng.entry + eng.decoders}
    assert nodes == {"g0p0": 0, "g0p1": 0, "g0d": 0, "g1p0": 1, "g1p1": 1, "g1d": 1}
    one = SystemConfig("expertplex", knobs, 8)
    assert goodput(two, cl2, reqs).rate >= goodput(one, _cluster(8), reqs).rate > 0


def test_tpot_is_undefined_not_zero_when_every_request_has_one_output_token():
    """TPOT needs two output tokens: requests of one have none, and where all do the
    percentiles are None (shown "-"), not 0 ms; other requests' TPOTs are not pulled down."""
    cl = _cluster(4)
    cfg = enumerate_configs("colocated", cl, 4000)[0]
    reqs = _requests(12)
    one = Requests(reqs.arrival_N, reqs.prompt_N, np.ones_like(reqs.output_N), "test")
    m = run_config(cfg, cl, one)
    p = m.percentiles()
    assert p["tpot_p50_s"] is None and p["tpot_p90_s"] is None and p["ttft_p50_s"] > 0
    mixed = Requests(reqs.arrival_N, reqs.prompt_N, np.where(np.arange(12) % 2, reqs.output_N, 1), "test")
    m = run_config(cfg, cl, mixed)
    decoding = m.tpot_N[np.arange(12) % 2 == 1]
    assert m.percentiles()["tpot_p50_s"] == pytest.approx(np.median(decoding)) and decoding.min() > 0


def test_paper_ratios_are_shown_for_its_model_only_and_labelled_with_its_setting():
    """The paper's 2.01x / 1.41x belong to its MiniMax-M2.7 setting: a comparison of another
    model carries none; the MiniMax-M2 preset's carries them, printed with the setting."""
    import io

    from rich.console import Console

    from relibra_torch.serving.compare import PAPER_RATIOS
    from relibra_torch.serving.report import print_report

    setup = CompareSetup(TINY, get_hardware("h200"), TIGHT, 1, 4, _requests(12), _pi(), ("colocated",), "test")
    doc = compare(setup)
    assert doc["paper_ratios"] == {}
    minimax = get_model("minimax-m2")   # does not fit one H200: no search, only the document
    pi = synthetic_popularity(minimax.num_moe_layers, minimax.num_experts, minimax.top_k, 0)
    paper = compare(CompareSetup(minimax, get_hardware("h200"), TIGHT, 1, 1, _requests(12), pi, ("colocated",),
                                 "test"))
    assert paper["paper_ratios"] == PAPER_RATIOS
    for d, shown in ((doc, False), (paper, True)):
        d["ratios"] = {"expertplex/pd-disagg": 0.5}
        out = io.StringIO()
        print_report(d, Console(file=out, width=300))
        line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("expertplex/pd-disagg"))
        assert line == ("expertplex/pd-disagg: 0.50x (paper, MiniMax-M2.7 on 8 x H800 nodes, ShareGPT lengths: 2.01x)"
                        if shown else "expertplex/pd-disagg: 0.50x"), line
