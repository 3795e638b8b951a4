"""Each cost-model term against numbers computed by hand (float64, rel. tolerance 1e-12).

A tiny model and round hardware numbers keep the arithmetic checkable:
D = 4, F = 2, 1 TFLOP/s peak at 50% (expert) and 25% (dense) efficiency, NVLink 100 GB/s,
inter-node 10 GB/s.

Legend: M micro-batches, L layers, S source ranks, E experts, G GPUs, J slots per GPU.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relibra_torch.planning import StepPlan, Topology, evaluate, make_planner, static_plan
from relibra_torch.sim.cost import CostModel, CostOptions
from relibra_torch.sim.presets import HardwareSpec, ModelSpec, get_model

REL = 1e-12
MODEL = ModelSpec("tiny", num_layers=3, num_moe_layers=2, hidden_size=4, moe_ffn=2, num_experts=4,
                  top_k=2, num_heads=2, num_kv_heads=1, head_dim=3, vocab_size=10, dense_ffn=5,
                  num_shared_experts=1, shared_ffn=6)
HW = HardwareSpec("round", bf16_tflops=1.0, grouped_gemm_efficiency=0.5, dense_efficiency=0.25,
                  nvlink_gbps=100.0, inter_node_gbps=10.0, hbm_gb=80.0, hbm_gbps=3000.0,
                  inter_node_latency_us=0.0, nvlink_latency_us=0.0)  # latency: its own test
EXPERT_RATE = 0.5e12
DENSE_RATE = 0.25e12
NVL, IB = 100e9, 10e9


def approx(x):
    return pytest.approx(x, rel=REL, abs=0)


def test_expert_compute_is_6DF_forward_and_twice_backward_on_the_busiest_gpu():
    cost = CostModel(MODEL, HW)
    fwd, bwd = cost.expert_compute_s(torch.tensor([1000, 0]))
    assert fwd[0].item() == approx(6 * 4 * 2 * 1000 / EXPERT_RATE)
    assert bwd[0].item() == approx(2 * 6 * 4 * 2 * 1000 / EXPERT_RATE)
    assert fwd[1].item() == 0.0


def test_all_to_all_takes_the_slowest_gpu_with_both_links_summed():
    cost = CostModel(MODEL, HW)
    token_bytes = 4 * 2  # D * bf16
    # GPU 0: sends 10 cross / receives 30 cross, 7 intra both ways; GPU 1: 20 cross, 100 intra.
    t = cost.all_to_all_s(torch.tensor([10, 20]), torch.tensor([30, 5]),
                          torch.tensor([7, 100]), torch.tensor([7, 1]))
    gpu0 = 30 * token_bytes / IB + 7 * token_bytes / NVL
    gpu1 = 20 * token_bytes / IB + 100 * token_bytes / NVL
    assert t.item() == approx(max(gpu0, gpu1))


def _replica_plan():
    """1 node x 2 GPUs, 4 experts (2 per GPU), R = 1; 3 micro-batches, 1 layer.

    GPU 1's replica slot holds expert 0 (owner GPU 0) in micro-batches 0 and 1 (one
    residency), expert 1 (owner GPU 0) in micro-batch 2 (a second one). GPU 0's stays empty.
    """
    topo = Topology(1, 2, 4, 1)
    placement = topo.static_placement(1)
    se = torch.tensor([[[[0, 1, -1], [2, 3, 0]]], [[[0, 1, -1], [2, 3, 0]]],
                       [[[0, 1, -1], [2, 3, 1]]]])
    loads = torch.zeros(3, 1, 2, 4, dtype=torch.int64)
    loads[:, 0, 0] = torch.tensor([8, 4, 2, 2])
    tokens = torch.tensor([[[[4, 4, 0], [2, 2, 4]]], [[[4, 4, 0], [2, 2, 4]]], [[[8, 2, 0], [2, 2, 2]]]])
    plan = StepPlan(topo, placement, se, tokens, "hand", placement.clone())
    return topo, plan, loads


def test_replica_fill_is_charged_once_per_residency_at_both_ends():
    """Weights in at a residency's first micro-batch with tokens, fp32 gradients home at its
    last; the residency of micro-batches 0-1 returns in 1's backward."""
    topo, plan, loads = _replica_plan()
    cost = CostModel(MODEL, HW)
    metrics = evaluate(plan, loads)
    counts = cost.replica_counts(plan, metrics)
    assert counts["fetch_recv_intra"][:, 0].tolist() == [[0, 1], [0, 0], [0, 1]]
    assert counts["fetch_send_intra"][:, 0].tolist() == [[1, 0], [0, 0], [1, 0]]
    assert counts["return_send_intra"][:, 0].tolist() == [[0, 0], [0, 1], [0, 1]]
    assert counts["return_recv_intra"][:, 0].tolist() == [[0, 0], [1, 0], [1, 0]]
    assert int(counts["fetch_recv_cross"].sum()) == 0 and int(counts["return_send_cross"].sum()) == 0
    fill, grad = cost.replica_s(counts)
    weights, grads = 3 * 4 * 2 * 2, 3 * 4 * 2 * 4  # 3 D F bf16 in, fp32 back
    assert fill[:, 0].tolist() == [approx(weights / NVL), 0.0, approx(weights / NVL)]
    assert grad[:, 0].tolist() == [0.0, approx(grads / NVL), approx(grads / NVL)]


def test_refetched_replicas_pay_two_fetches_one_return_and_the_recompute():
    topo, plan, loads = _replica_plan()
    cost = CostModel(MODEL, HW, CostOptions(refetch_replicas=True))
    metrics = evaluate(plan, loads)
    counts = cost.replica_counts(plan, metrics)
    assert counts["fetch_recv_intra"][:, 0].tolist() == [[0, 2], [0, 2], [0, 2]]
    assert counts["return_send_intra"][:, 0].tolist() == [[0, 1], [0, 1], [0, 1]]
    fill, grad = cost.replica_s(counts)
    weights, grads = 3 * 4 * 2 * 2, 3 * 4 * 2 * 4
    assert fill[:, 0].tolist() == [approx(weights / NVL)] * 3
    # backward: the replica's GPU receives the weights again while it sends gradients (full
    # duplex: the larger of the two), the owner the reverse
    assert grad[:, 0].tolist() == [approx(max(weights, grads) / NVL)] * 3
    step = cost.step_cost(plan, metrics, torch.full((3, 2), 10), torch.full((3, 2), 55.0))
    kept = CostModel(MODEL, HW).step_cost(plan, metrics, torch.full((3, 2), 10), torch.full((3, 2), 55.0))
    fwd, _ = cost.expert_compute_s(metrics.gpu_load_MLG.max(-1).values)
    rows = (plan.slot_tokens_MLGJ[:, 0, :, 2] * metrics.residency.active_MLGJ[:, 0, :, 2]).sum(-1)  # [M]
    recompute = cost.expert_compute_s(2 * metrics.gpu_load_MLG[:, 0] + torch.stack([torch.zeros(3, dtype=torch.int64), rows], 1))[0]
    assert torch.allclose(step.expert_s_ML[:, 0], fwd[:, 0] + recompute.max(-1).values, rtol=REL, atol=0)
    assert step.expert_s_ML.sum() > kept.expert_s_ML.sum()
    assert step.replica_bytes == 6 * weights + 3 * grads


def test_a_replica_without_tokens_costs_nothing():
    topo, plan, loads = _replica_plan()
    plan.slot_tokens_MLGJ[2, 0, 1, 2] = 0          # expert 1's replica gets no tokens
    plan.slot_tokens_MLGJ[2, 0, 0, 1] += 2
    counts = CostModel(MODEL, HW).replica_counts(plan, evaluate(plan, loads))
    assert counts["fetch_recv_intra"][:, 0, 1].tolist() == [1, 0, 0]
    assert counts["return_send_intra"][:, 0, 1].tolist() == [0, 1, 0]


def test_cross_node_fill_uses_the_inter_node_bandwidth_and_fp32_grads_double_it():
    topo = Topology(2, 1, 2, 1)  # 2 nodes x 1 GPU, 1 expert each
    placement = topo.static_placement(1)
    se = torch.tensor([[[[0, -1], [1, 0]]]])
    tokens = torch.tensor([[[[3, 0], [5, 3]]]])
    loads = torch.tensor([[[[3, 2], [3, 3]]]])
    plan = StepPlan(topo, placement, se, tokens, "hand", placement.clone())
    cost = CostModel(MODEL, HW, CostOptions(grad_bytes=4))
    fill, grad = cost.replica_s(cost.replica_counts(plan, evaluate(plan, loads)))
    assert fill.item() == approx(3 * 4 * 2 * 2 / IB)
    assert grad.item() == approx(3 * 4 * 2 * 4 / IB)
    cost = CostModel(MODEL, HW, CostOptions(grad_bytes=2))  # bf16 gradients: the weights' bytes
    fill, grad = cost.replica_s(cost.replica_counts(plan, evaluate(plan, loads)))
    assert grad.item() == approx(fill.item())


def test_migration_moves_weights_master_and_adam_state_over_the_right_link():
    topo = Topology(2, 2, 4, 0)  # GPUs 0,1 on node 0; 2,3 on node 1; one expert each
    prev = topo.static_placement(1)
    new = torch.tensor([[2, 1, 0, 3]])  # experts 0 and 2 swap nodes
    plan = StepPlan(topo, new, torch.zeros(1, 1, 4, 1, dtype=torch.int64),
                    torch.zeros(1, 1, 4, 1, dtype=torch.int64), "hand", prev)
    cost = CostModel(MODEL, HW)
    secs, n, nbytes = cost.migration(plan)
    per_expert = 3 * 4 * 2 * (2 + 4 + 8)  # bf16 weights + fp32 master + two fp32 moments
    assert n == 2 and nbytes == 2 * per_expert
    assert secs == approx(per_expert / IB)  # each GPU sends one and receives one, full duplex
    # inside a node: NVLink, and without a master copy
    plan.placement_LE = torch.tensor([[1, 0, 2, 3]])
    cost = CostModel(MODEL, HW, CostOptions(master_weights=False))
    secs, n, _ = cost.migration(plan)
    assert n == 2 and secs == approx(3 * 4 * 2 * (2 + 8) / NVL)


def test_dense_flops_match_the_formulas():
    cost = CostModel(MODEL, HW)
    T, pairs = torch.tensor([100.0]), torch.tensor([5050.0])  # one sample of 100 tokens
    f = cost.dense_flops(T, pairs)
    # GQA projections: Q 4x(2*3), K and V 4x(1*3) each, O (2*3)x4 -> 24 + 12 + 12 + 24 = 72
    assert MODEL.attention_projection_params() == 72
    assert f["attention"].item() == approx(2 * 72 * 100 + 2 * (6 + 6) * 5050)
    assert f["moe_extra"].item() == approx((2 * 4 * 4 + 6 * 4 * 6) * 100)
    assert f["dense_ffn"].item() == approx(6 * 4 * 5 * 100)
    assert f["head"].item() == approx(2 * 4 * 10 * 100)


def test_dense_time_takes_the_slowest_rank_and_covers_all_layers_forward_and_backward():
    cost = CostModel(MODEL, HW)
    tokens = torch.tensor([[100, 50]])
    pairs = torch.tensor([[5050.0, 1275.0]])
    d = cost.dense_s(tokens, pairs)
    attn = 2 * 72 * 100 + 24 * 5050
    moe_layer = attn + (32 + 144) * 100
    dense_layer = attn + 120 * 100
    head = 80 * 100
    assert d["attention_layer_fwd"].item() == approx(moe_layer / DENSE_RATE)
    assert d["total"].item() == approx(3 * (2 * moe_layer + 1 * dense_layer + head) / DENSE_RATE)


def test_dense_forward_per_token_is_the_dense_forward_without_the_context_term():
    """``dense_fwd_s_per_token`` (the guard's step window) times a rank's tokens is that rank's
    dense forward with no attention context, and below it with any."""
    cost = CostModel(MODEL, HW)
    per_token = cost.dense_fwd_s_per_token()
    assert per_token == approx((2 * (2 * 72 + 32 + 144) + (2 * 72 + 120) + 80) / DENSE_RATE)
    tokens = torch.tensor([[100, 50]])
    assert cost.dense_s(tokens, torch.zeros(1, 2))["total"].item() / 3 == approx(100 * per_token)
    assert cost.dense_s(tokens, torch.tensor([[5050.0, 1275.0]]))["total"].item() / 3 > 100 * per_token


def test_mla_attention_parameters_of_deepseek_v3():
    m = get_model("deepseek-v3")
    D, h = 7168, 128
    q = D * 1536 + 1536 * h * (128 + 64)
    kv = D * (512 + 64) + 512 * h * (128 + 128)
    o = h * 128 * D
    assert m.attention_projection_params() == q + kv + o
    assert m.attention_qk_dim() == h * 192 and m.attention_v_dim() == h * 128


def _two_gpu_step():
    topo = Topology(1, 2, 4, 1)
    _, plan, loads = _replica_plan()
    tokens = torch.full((3, 2), 10)
    pairs = torch.full((3, 2), 55.0)
    return topo, plan, loads, tokens, pairs


def test_step_cost_is_the_sum_of_its_terms():
    topo, plan, loads, tokens, pairs = _two_gpu_step()
    cost = CostModel(MODEL, HW)
    metrics = evaluate(plan, loads)
    step = cost.step_cost(plan, metrics, tokens, pairs)
    fwd, bwd = cost.expert_compute_s(metrics.gpu_load_MLG.max(-1).values)
    a2a = cost.all_to_all_s(metrics.cross_send_MLG, metrics.cross_recv_MLG,
                            metrics.intra_send_MLG, metrics.intra_recv_MLG)
    fill, grad = cost.replica_s(cost.replica_counts(plan, metrics))
    moe = fwd + bwd + 4 * a2a + fill + grad
    assert torch.allclose(step.moe_layer_s_ML, moe, rtol=REL, atol=0)
    dense = float(cost.dense_s(tokens, pairs)["total"].sum())
    assert step.step_s == approx(float(moe.sum()) + dense + step.migration_s)
    assert step.migration_s == 0.0 and step.migrated_experts == 0
    assert step.replica_bytes == 2 * 3 * 4 * 2 * (2 + 4)  # 2 residencies x (bf16 weights + fp32 grads)
    token_bytes = 8
    assert step.cross_node_bytes == 0.0
    assert step.intra_node_bytes == approx(4 * token_bytes * float(metrics.intra_send_MLG.sum()))


def test_overlap_hides_replica_transfer_behind_attention_up_to_its_length():
    topo, plan, loads, tokens, pairs = _two_gpu_step()
    metrics = evaluate(plan, loads)
    plain = CostModel(MODEL, HW).step_cost(plan, metrics, tokens, pairs)
    hidden = CostModel(MODEL, HW, CostOptions(overlap_replication=True)).step_cost(plan, metrics, tokens, pairs)
    # attention of one layer at these sizes is far longer than one 96-byte NVLink copy
    assert float(hidden.replica_exposed_s_ML.sum()) == 0.0
    assert float(plain.replica_exposed_s_ML.sum()) > 0.0
    assert plain.step_s - hidden.step_s == approx(float(plain.replica_s_ML.sum()))
    # a slow NVLink makes the fill longer than attention: only the excess is charged
    slow = HardwareSpec("slow", 1.0, 0.5, 0.25, nvlink_gbps=1e-9, inter_node_gbps=10.0, hbm_gb=80.0,
                        hbm_gbps=3000.0, inter_node_latency_us=0.0, nvlink_latency_us=0.0)
    c = CostModel(MODEL, slow, CostOptions(overlap_replication=True))
    s = c.step_cost(plan, metrics, tokens, pairs)
    attn = c.dense_s(tokens, pairs)
    fill, grad = c.replica_s(c.replica_counts(plan, metrics))
    expect = ((fill - attn["attention_layer_fwd"].unsqueeze(1)).clamp(min=0)
              + (grad - attn["attention_layer_bwd"].unsqueeze(1)).clamp(min=0))
    assert torch.allclose(s.replica_exposed_s_ML, expect, rtol=REL, atol=0)
    assert float(expect.sum()) > 0


def test_uniform_has_mean_load_uniform_traffic_and_nothing_moved():
    cost = CostModel(MODEL, HW)
    loads = torch.zeros(1, 1, 4, 4, dtype=torch.int64)  # 2 nodes x 2 GPUs
    loads[0, 0, :, 0] = 40  # everything to expert 0
    tokens, pairs = torch.full((1, 4), 20), torch.full((1, 4), 210.0)
    step = cost.uniform_step_cost(loads, 2, 2, tokens, pairs)
    mean = 160 / 4
    fwd, bwd = 6 * 4 * 2 * mean / EXPERT_RATE, 2 * 6 * 4 * 2 * mean / EXPERT_RATE
    cross = 40 * 2 / 4  # (G - g) / G of each source's 40 tokens, received evenly
    intra = 40 * 1 / 4
    a2a = 8 * (cross / IB + intra / NVL)
    assert step.moe_layer_s_ML.item() == approx(fwd + bwd + 4 * a2a)
    assert step.replica_bytes == 0 and step.migration_s == 0 and step.migrated_experts == 0


def test_uniform_loads_make_static_equal_to_uniform():
    topo = Topology(2, 2, 8, 0)
    loads = torch.full((2, 3, 4, 8), 5, dtype=torch.int64)
    cost = CostModel(MODEL, HW)
    tokens, pairs = torch.full((2, 4), 20), torch.full((2, 4), 210.0)
    plan = static_plan(loads, topo)
    real = cost.step_cost(plan, evaluate(plan, loads), tokens, pairs)
    uniform = cost.uniform_step_cost(loads, 2, 2, tokens, pairs)
    assert real.step_s == approx(uniform.step_s)
    assert real.cross_node_bytes == approx(uniform.cross_node_bytes)


def test_reorder_weights_for_qwen3_30b_on_h200():
    from relibra_torch.sim.presets import get_hardware
    cost = CostModel(get_model("qwen3-30b-a3b"), get_hardware("h200"))
    w = cost.reorder_weights()
    D, F = 2048, 768
    assert w.compute_s_per_token == approx(18 * D * F / (989e12 * 0.60))
    assert w.cross_node_s_per_token == approx(4 * 2 * D / 45e9)
    assert w.intra_node_s_per_token == approx(4 * 2 * D / 360e9)
    assert w.migration_s_per_expert == approx(3 * D * F * 14 / 45e9)
    assert w.intra_migration_s_per_expert == approx(3 * D * F * 14 / 360e9)
    assert w.replica_fill_s_per_expert == approx(3 * D * F * (2 + 4) / 360e9)  # bf16 in, fp32 back


def test_cost_options_reject_bad_values():
    with pytest.raises(ValueError, match="activation_bytes"):
        CostOptions(activation_bytes=0)
    with pytest.raises(ValueError, match="optimizer_state_bytes"):
        CostOptions(optimizer_state_bytes=-1)


# --- invariants over random problems (hypothesis) -------------------------------------
@st.composite
def problems(draw):
    nodes, gpus = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    per_gpu, R = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    topo = Topology(nodes, gpus, nodes * gpus * per_gpu, R)
    M, L = draw(st.integers(1, 3)), draw(st.integers(1, 2))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    loads = (torch.rand(M, L, topo.num_gpus, topo.num_experts, generator=gen) ** 4 * 300).long()
    name = draw(st.sampled_from(["static", "eplb-oracle", "relibra"]))
    return topo, loads, name


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_invariants_uniform_bounds_compute_slower_links_never_help_and_parts_add_up(problem):
    topo, loads, name = problem
    model = ModelSpec("inv", num_layers=loads.shape[1], num_moe_layers=loads.shape[1], hidden_size=64,
                      moe_ffn=32, num_experts=topo.num_experts, top_k=1, num_heads=2, num_kv_heads=1,
                      head_dim=8, vocab_size=50)
    plan = make_planner(name, topo).plan(loads)
    metrics = evaluate(plan, loads)
    M, G = loads.shape[0], topo.num_gpus
    tokens, pairs = loads[:, 0].sum(-1), loads[:, 0].sum(-1).double() * 3
    fast = CostModel(model, HW)
    step = fast.step_cost(plan, metrics, tokens, pairs)
    uniform = fast.uniform_step_cost(loads, topo.num_nodes, topo.gpus_per_node, tokens, pairs)
    # the busiest GPU carries at least the mean
    assert (step.expert_s_ML >= uniform.expert_s_ML * (1 - 1e-12)).all()
    # parts add up to the step
    total = float(step.moe_layer_s_ML.sum()) + step.attention_dense_s + step.migration_s
    assert step.step_s == pytest.approx(total, rel=1e-12)
    assert torch.allclose(step.moe_layer_s_ML, step.expert_s_ML + step.all_to_all_s_ML
                          + step.replica_exposed_s_ML, rtol=1e-12, atol=0)
    # halving either bandwidth never makes the step faster
    for field in ("nvlink_gbps", "inter_node_gbps"):
        slow_hw = HardwareSpec("slow", HW.bf16_tflops, HW.grouped_gemm_efficiency, HW.dense_efficiency,
                               **{"nvlink_gbps": HW.nvlink_gbps, "inter_node_gbps": HW.inter_node_gbps,
                                  "hbm_gb": HW.hbm_gb, "hbm_gbps": HW.hbm_gbps, "inter_node_latency_us": 0.0,
                                  "nvlink_latency_us": 0.0,
                                  field: getattr(HW, field) / 2})
        slow = CostModel(model, slow_hw).step_cost(plan, metrics, tokens, pairs)
        assert slow.step_s >= step.step_s * (1 - 1e-12)
    # overlap never costs more than no overlap
    hidden = CostModel(model, HW, CostOptions(overlap_replication=True)).step_cost(plan, metrics, tokens, pairs)
    assert hidden.step_s <= step.step_s * (1 + 1e-12)
