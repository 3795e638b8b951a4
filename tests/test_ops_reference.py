"""The torch reference path of relibra_torch.ops, the backend switch and the input checks.

Runs without the Triton interpreter (backend "torch"); the Triton kernels are tested against
the same oracles in test_ops_triton.py. Budget: ~10 s on one core.

Shape legend: T tokens, K top-k, R sorted rows, D hidden, S slots, G weights; grouped GEMM
operands x_RK / w_GKN / y_RN (K reduction dim, N output dim).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import relibra_torch.ops as ops
from relibra_torch.ops import oracle
from relibra_torch.ops.backend import uses_triton


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _torch_backend():
    with ops.use_backend("torch"):
        yield


@st.composite
def grouped_case(draw, max_slots=9, max_rows=12, max_dim=20):
    """(sizes_S, slot_to_weight_S or None, G, Kd, N) covering empty/one-row groups and sharing."""
    S = draw(st.integers(1, max_slots))
    sizes = draw(st.lists(st.integers(0, max_rows), min_size=S, max_size=S))
    if draw(st.booleans()):
        G = draw(st.integers(1, S))
        s2w = draw(st.lists(st.integers(0, G - 1), min_size=S, max_size=S))
    else:
        G, s2w = S, None
    Kd = draw(st.integers(1, max_dim))
    N = draw(st.integers(1, max_dim))
    return sizes, s2w, G, Kd, N


def _offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


# ---------------------------------------------------------------------------- backend switch


def test_backend_switch_and_env(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    with ops.use_backend("auto"):
        assert ops.get_backend() == "auto"
        assert not uses_triton(torch.device("cpu"))
        assert uses_triton(torch.device("cuda"))
        with ops.use_backend("torch"):
            assert not uses_triton(torch.device("cuda"))
        assert ops.get_backend() == "auto"
    ops.set_backend(None)
    try:
        monkeypatch.setenv(ops.ENV_VAR, "torch")
        assert ops.get_backend() == "torch"
        monkeypatch.setenv(ops.ENV_VAR, "cuda")
        with pytest.raises(ValueError, match="RELIBRA_OPS_BACKEND = 'cuda'; allowed: one of 'auto', 'triton', 'torch'"):
            ops.get_backend()
        ops.set_backend("triton")
        assert ops.get_backend() == "triton"
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            uses_triton(torch.device("cpu"))
    finally:
        ops.set_backend(None)
    with pytest.raises(ValueError, match="backend = 'fast'; allowed: one of 'auto', 'triton', 'torch'"):
        ops.set_backend("fast")
    with pytest.raises(ValueError, match="allowed"):
        with ops.use_backend("gpu"):
            pass


# ---------------------------------------------------------------------------- permute


@settings(max_examples=60, deadline=None, derandomize=True)
@given(T=st.integers(0, 20), K=st.integers(1, 5), S=st.integers(1, 7), data=st.data())
def test_permute_reference_is_the_stable_sort(T, K, S, data):
    slots = data.draw(st.lists(st.integers(0, S - 1), min_size=T * K, max_size=T * K))
    slots_TK = torch.tensor(slots, dtype=torch.int64).view(T, K)
    x_TD = torch.randn(T, 3)
    x_sorted, row_of, offsets = ops.permute(slots_TK, x_TD, S)
    want_row_of, want_offsets = oracle.permute_index(slots_TK, S)
    assert torch.equal(row_of, want_row_of)
    assert torch.equal(offsets, want_offsets) and offsets.dtype == torch.int32
    # row_of is a permutation of [0, T*K) and the inverse reproduces every token's row
    assert torch.equal(row_of.reshape(-1).sort().values, torch.arange(T * K))
    inverse = torch.empty(T * K, dtype=torch.int64)
    inverse[row_of.reshape(-1)] = torch.arange(T * K)
    assert torch.equal(x_sorted, x_TD[inverse // K]) if T * K else x_sorted.shape == (0, 3)


def test_permute_backward_sums_the_k_copies():
    T, K, S, D = 6, 3, 4, 5
    slots_TK = torch.tensor([[0, 1, 2], [3, 3, 3], [1, 0, 1], [2, 2, 0], [0, 0, 0], [3, 1, 2]])
    x_TD = torch.randn(T, D, requires_grad=True)
    x_sorted, row_of, _ = ops.permute(slots_TK, x_TD, S)
    g_RD = torch.randn(T * K, D)
    x_sorted.backward(g_RD)
    assert torch.allclose(x_TD.grad, g_RD[row_of].sum(1), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- unpermute


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpermute_reference_forward_backward(dtype):
    torch.manual_seed(0)
    T, K, S, D = 9, 3, 4, 7
    slots_TK = torch.randint(0, S, (T, K))
    _, row_of, _ = ops.permute(slots_TK, torch.zeros(T, 1), S)
    y_RD = torch.randn(T * K, D).to(dtype).requires_grad_()
    gates_TK = torch.rand(T, K).requires_grad_()
    out = ops.unpermute(y_RD, row_of, gates_TK)
    exact, bound = oracle.unpermute(y_RD.detach(), row_of, gates_TK.detach())
    oracle.check_within(out, exact, bound, dtype, "unpermute")
    dout = torch.randn(T, D).to(dtype)
    out.backward(dout)
    d64 = dout.double()
    dy_exact = torch.zeros(T * K, y_RD.shape[1], dtype=torch.float64)
    dy_exact[row_of.reshape(-1)] = (gates_TK.detach().double()[..., None] * d64[:, None]).reshape(T * K, D)
    dy_bound = dy_exact.abs()
    oracle.check_within(y_RD.grad, dy_exact, dy_bound, dtype, "unpermute dy")
    y64 = y_RD.detach().double()[row_of]
    oracle.check_within(gates_TK.grad, (y64 * d64[:, None]).sum(-1), (y64.abs() * d64.abs()[:, None]).sum(-1),
                        dtype, "unpermute dgates")


# ---------------------------------------------------------------------------- grouped GEMM


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=grouped_case(), dtype=st.sampled_from(DTYPES), tail=st.integers(0, 3), w_t=st.booleans(),
       aligned=st.booleans())
def test_grouped_gemm_reference_matches_oracle(case, dtype, tail, w_t, aligned):
    sizes, s2w, G, Kd, N = case
    if aligned:  # the no-padding path of the reference
        Kd, N = 8 * ((Kd + 7) // 8), 8 * ((N + 7) // 8)
    offsets = _offsets(sizes)
    R = sum(sizes) + tail  # tail rows belong to no slot and must come out 0
    s2w_t = None if s2w is None else torch.tensor(s2w)
    x = torch.randn(R, Kd).to(dtype).requires_grad_()
    if w_t:  # a transposed parameter, as the MoE layer passes torchtitan-layout weights
        w = torch.randn(G, N, Kd).to(dtype).transpose(1, 2).requires_grad_()
    else:
        w = torch.randn(G, Kd, N).to(dtype).requires_grad_()
    y = ops.grouped_gemm(x, w, offsets, s2w_t)
    oracle.check_within(y, *oracle.grouped_mm(x.detach(), w.detach(), offsets, s2w_t), dtype, "y")
    dy = torch.randn(R, N).to(dtype)
    y.backward(dy)
    dx_exact, dx_bound = oracle.grouped_mm(dy, w.detach().transpose(1, 2), offsets, s2w_t)
    oracle.check_within(x.grad, dx_exact, dx_bound, dtype, "dx")
    oracle.check_within(w.grad, *oracle.grouped_mm_wgrad(x.detach(), dy, offsets, s2w_t, G), dtype, "dw")


def test_expert_swiglu_reference_matches_dense_loop():
    torch.manual_seed(0)
    sizes, s2w = [3, 0, 5, 1], torch.tensor([1, 0, 1, 2])
    G, D, F = 3, 6, 10
    x = torch.randn(sum(sizes), D)
    w1, w3, w2 = torch.randn(G, D, F), torch.randn(G, D, F), torch.randn(G, F, D)
    y = ops.expert_swiglu(x, w1, w2, w3, _offsets(sizes), s2w)
    want = torch.zeros_like(y)
    start = 0
    for s, n in enumerate(sizes):
        g, xs = int(s2w[s]), x[start:start + n]
        want[start:start + n] = (torch.nn.functional.silu(xs @ w1[g]) * (xs @ w3[g])) @ w2[g]
        start += n
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- input checks


def test_bad_inputs_raise_naming_the_field():
    x, w, offs = torch.randn(4, 3), torch.randn(2, 3, 5), torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="offsets_S has dtype int64; allowed: int32"):
        ops.grouped_gemm(x, w, offs.long())
    with pytest.raises(TypeError, match="w_GKN has dtype"):
        ops.grouped_gemm(x, w.double(), offs)
    with pytest.raises(TypeError, match="x_RK has dtype float64"):
        ops.grouped_gemm(x.double(), w.double(), offs)
    with pytest.raises(ValueError, match="w_GKN has K=3 but x_RK has K=4"):
        ops.grouped_gemm(torch.randn(4, 4), w, offs)
    with pytest.raises(ValueError, match=r"w_GKN has G = 2 weights; allowed: G = S = 3"):
        ops.grouped_gemm(x, w, torch.tensor([1, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets_S = \[3, 1\]; allowed: non-decreasing cumulative ends in \[0, R=4\]"):
        ops.grouped_gemm(x, w, torch.tensor([3, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"offsets_S = \[1, 9\]; allowed: non-decreasing cumulative ends in \[0, R=4\]"):
        ops.grouped_gemm(x, w, torch.tensor([1, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_to_weight_S has values in \\[0, 2\\]; allowed: \\[0, G=2\\)"):
        ops.grouped_gemm(x, w, torch.tensor([1, 2, 4], dtype=torch.int32), torch.tensor([0, 2, 1]))
    with pytest.raises(ValueError, match="slot_to_weight_S has 1 entries; it needs S=2"):
        ops.grouped_gemm(x, w, offs, torch.tensor([0]))
    with pytest.raises(ValueError, match="expert_slot_TK has values in \\[0, 5\\]; allowed: \\[0, num_slots=4\\)"):
        ops.permute(torch.tensor([[0, 5]]), torch.randn(1, 2), 4)
    with pytest.raises(ValueError, match="x_TD has T=2"):
        ops.permute(torch.tensor([[0, 1]]), torch.randn(2, 2), 4)
    with pytest.raises(TypeError, match="expert_slot_TK has dtype float32"):
        ops.permute(torch.zeros(1, 2), torch.randn(1, 2), 4)
    with pytest.raises(ValueError, match="num_slots = -1; allowed: an int >= 0"):
        ops.permute_index(torch.zeros(1, 2, dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="gates_TK has shape \\(2, 1\\)"):
        ops.unpermute(torch.randn(2, 3), torch.tensor([[0, 1]]), torch.ones(2, 1))
    with pytest.raises(ValueError, match="row_of_TK has repeated rows"):
        ops.unpermute(torch.randn(2, 3), torch.tensor([[1, 1]]), torch.ones(1, 2))
    with pytest.raises(ValueError, match="row_of_TK has values in \\[0, 2\\]; allowed: \\[0, 2\\)"):
        ops.unpermute(torch.randn(2, 3), torch.tensor([[0, 2]]), None)
