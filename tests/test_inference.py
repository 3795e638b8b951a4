"""The Replicate-and-Quantize inference transform: int8 error bounds, the budget (property
test), the live even split, and a transformed layer on 4 gloo ranks (2 nodes x 2 GPUs)
against the same transformed layer in one process.

Legend: T tokens, D dim, F hidden, E experts, K top-k, G GPUs, El native per GPU, R replica
slots, J = El + R, O/I output/input channels.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _inference_fns as ifns
from _moe_refs import close
from relibra_torch.inference import (decide_layer, dequantize_int8, even_quota, int8_bytes, live_layer_plan,
                                     quantize_int8, replicate_and_quantize)
from relibra_torch.planning import Topology
from relibra_torch.testing import RankPool


@settings(max_examples=30, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1), O=st.integers(1, 9), I=st.integers(1, 17),
       scale=st.sampled_from([1e-6, 1.0, 1e4]))
def test_int8_roundtrip_error_bound(seed, O, I, scale):
    w = torch.randn(3, O, I, generator=torch.Generator().manual_seed(seed)) * scale
    w[0, 0] = 0.0  # a zero row stays exactly zero
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (3, O)
    assert int(q.abs().max()) <= 127
    err = (dequantize_int8(q, s) - w).abs()
    # half a step per element, per output row (plus fp32 rounding of the product)
    bound = w.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-5) + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err[0, 0].max()) == 0.0
    # the row maximum is exact up to fp32 rounding (it maps to +-127)
    assert torch.allclose(dequantize_int8(q, s).abs().amax(-1), w.abs().amax(-1), rtol=1e-6)
    assert int8_bytes((O, I)) == O * I + 4 * O


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(seed=st.integers(0, 2**31 - 1), layout=st.sampled_from([(1, 2, 4), (2, 2, 8), (2, 2, 4), (1, 4, 8)]),
       R=st.integers(0, 3), budget=st.floats(0.2, 1.6), full=st.integers(30, 400), skew=st.floats(0.0, 3.0),
       forwards=st.sampled_from([None, 1, 3]))
def test_transform_never_exceeds_the_budget(seed, layout, R, budget, full, skew, forwards):
    N, g, E = layout
    topo = Topology(N, g, E, R)
    gen = torch.Generator().manual_seed(seed)
    shape = (E,) if forwards is None else (forwards, E)  # aggregate or per calibration forward
    load_E = (torch.rand(shape, generator=gen) ** (1 + skew) * 1000).round().to(torch.int64)
    importance_E = torch.rand(E, generator=gen).double() * (torch.rand(E, generator=gen) > 0.2)
    q = max(1, full // 4) + int(torch.randint(0, 8, (1,), generator=gen))
    placement = torch.randperm(E, generator=gen)
    budget_bytes = int(budget * E * full)
    if budget_bytes < E * q:
        with pytest.raises(ValueError, match="below the layer's minimum"):
            decide_layer(load_E, importance_E, topo, placement, full, q, budget_bytes)
        return
    d = decide_layer(load_E, importance_E, topo, placement, full, q, budget_bytes)
    inst = d.instances_E
    assert d.expert_bytes == int((inst * torch.where(d.quantized_E, q, full)).sum()) <= budget_bytes
    assert bool((inst >= 1).all())
    El = topo.experts_per_gpu
    native = torch.empty(E, dtype=torch.int64)
    native[placement] = torch.arange(E)
    assert torch.equal(d.slot_expert_GJ[:, :El].flatten(), native)  # natives stay where they were
    for row in d.slot_expert_GJ:  # one instance per expert per GPU
        real = row[row >= 0]
        assert real.unique().numel() == real.numel()
    # quantized experts are the least important ones (ties aside)
    if d.quantized_E.any() and (~d.quantized_E).any():
        assert float(importance_E[d.quantized_E].max()) <= float(importance_E[~d.quantized_E].min())
    # replicas never raise the (fractional) busiest-GPU load, summed over forwards
    def peak(se):
        c = torch.bincount(se[se >= 0], minlength=E).clamp(min=1).double()
        share_FGJ = (load_E.reshape(-1, E).double() / c)[:, se.clamp(min=0)]
        return float(torch.where(se >= 0, share_FGJ, 0.0).sum(-1).max(-1).values.sum())
    base = torch.full_like(d.slot_expert_GJ, -1)
    base[:, :El] = d.slot_expert_GJ[:, :El]
    assert peak(d.slot_expert_GJ) <= peak(base) + 1e-9


def test_live_split_is_even_and_by_token_order():
    topo = Topology(1, 2, 2, 1)  # GPU 0: expert 0 + replica of 1; GPU 1: expert 1 + replica of 0
    se = torch.tensor([[0, 1], [1, 0]])
    assert even_quota(se, torch.tensor([5, 2])).tolist() == [[3, 1], [1, 2]]
    lp = live_layer_plan(topo, torch.arange(2), se, torch.tensor([[4, 1], [1, 1]]))
    # expert 0: 5 pairs over (0, 0) quota 3 and (1, 1) quota 2: source 0's 4 pairs first, 3 to
    # (0, 0) and 1 to (1, 1), then source 1's pair to (1, 1). Expert 1: 2 pairs over (0, 1)
    # and (1, 0), quota 1 each: source 0's pair to (0, 1), source 1's to (1, 0).
    assert lp.split_SGJ[0].tolist() == [[3, 1], [0, 1]] and lp.split_SGJ[1].tolist() == [[0, 0], [1, 1]]
    assert lp.split_SGJ.sum(0).tolist() == even_quota(se, torch.tensor([5, 2])).tolist()


def test_one_process_transform_stays_close_and_shrinks_memory():
    case = {"E": 8, "K": 2, "R": 1, "seed": 3, "shared": True, "placement": None,
            "calib_tokens": [200], "eval_tokens": [64]}
    m = ifns.build(case, None)
    x = ifns.tokens(case, "eval", 0)
    with torch.no_grad():
        ref = m(x)
    before = sum(p.numel() * p.element_size() for p in m.expert_params().values())
    rep = replicate_and_quantize(m, lambda mod: mod(ifns.tokens(case, "calib", 0)), topology=Topology(2, 2, 8, 1),
                                 budget_bytes=int(0.8 * before))
    d = rep.layers[0][1]
    assert d.quantized_E.any() and d.expert_bytes <= int(0.8 * before)
    assert m.resident_experts.nbytes() < before and sum(p.numel() for p in m.expert_params().values()) == 0
    with torch.no_grad():
        out = m(x)
    # int8 weights: per-element error <= max|row| / 254, so the output moves by ~1e-2 relative
    assert float((out - ref).abs().max()) <= 2e-2 * float(ref.abs().max())
    assert not torch.equal(out, ref)


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, timeout_s=240, grace_s=5) as p:
        yield p


CASES = [
    {"E": 8, "K": 2, "R": 1, "budget": None, "seed": 1, "shared": False, "placement": None},
    {"E": 4, "K": 1, "R": 2, "budget": 0.9, "seed": 2, "shared": True, "placement": [2, 0, 3, 1]},
    {"E": 8, "K": 3, "R": 2, "budget": 1.2, "seed": 5, "shared": False, "placement": [7, 1, 4, 0, 6, 2, 5, 3]},
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"E{c['E']}-K{c['K']}-R{c['R']}-b{c['budget']}")
def test_four_gloo_ranks_equal_one_process(pool, case):
    case = dict(case, calib_tokens=[40, 0, 25, 60], eval_tokens=[30, 7, 0, 21])
    if case["placement"] is not None:
        case["placement"] = torch.tensor(case["placement"])
    topo = Topology(ifns.N, ifns.GPN, case["E"], case["R"])
    full = 3 * ifns.HIDDEN * ifns.DIM * 4
    budget = None if case["budget"] is None else int(case["budget"] * case["E"] * full)
    res = pool.run(ifns.run_transformed, case, topo, budget)

    # the same transformed layer in one process: same logical weights, same stats
    m = ifns.build(case, None)
    # one calibration forward over every rank's tokens, as the 4 ranks ran one (collective) forward
    calib = torch.cat([ifns.tokens(case, "calib", r) for r in range(4)])
    rep = replicate_and_quantize(m, lambda mod: mod(calib), topology=topo, budget_bytes=budget)
    d = rep.layers[0][1]
    np.testing.assert_array_equal(rep.calibration.load_LE.numpy(), res[0]["load"])
    np.testing.assert_array_equal(rep.calibration.forward_load_LFE.numpy(), res[0]["forward_load"])
    np.testing.assert_allclose(rep.calibration.importance_LE.numpy(), res[0]["importance"], rtol=1e-6)  # fp32 GEMMs
    for r in res:
        np.testing.assert_array_equal(r["slot_expert"], d.slot_expert_GJ.numpy())
        np.testing.assert_array_equal(r["quantized"], d.quantized_E.numpy())
    assert (d.slot_expert_GJ[:, topo.experts_per_gpu:] >= 0).any(), "the case should replicate"
    assert any(r["fills"] for r in res), "some replica slot should compute tokens"
    assert sum(r["nbytes"] for r in res) == d.expert_bytes <= (budget or case["E"] * full)
    with torch.no_grad():
        for r in range(4):
            close(res[r]["out"], m(ifns.tokens(case, "eval", r)).numpy(), f"rank {r} output")
    # every GPU computed exactly the live even split of the gathered counts
    counts_E = torch.bincount(torch.from_numpy(np.concatenate([r["ids"].reshape(-1) for r in res])),
                              minlength=case["E"])
    quota_GJ = even_quota(d.slot_expert_GJ, counts_E)
    for g, r in enumerate(res):
        np.testing.assert_array_equal(r["slot_tokens"], quota_GJ[g].numpy())


def test_example_runs_and_keeps_memory(tmp_path):
    """examples/replicate_quantize.py end to end at toy size (the documented run is larger)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    import replicate_quantize

    res = replicate_quantize.main(["--train-steps", "3", "--batch", "8", "--calib", "16", "--held-out", "64",
                                   "--out", str(tmp_path)])
    assert res["held_out"] == 64 and res["expert_bytes_after"] <= res["expert_bytes_before"]
    assert (tmp_path / "result.json").exists()
    for layer in res["layers"]:
        assert layer["after"]["imbalance"] >= 1.0 and layer["before"]["lis"] >= 1.0
        assert layer["expert_bytes"] <= layer["original_bytes"]
