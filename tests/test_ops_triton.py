"""The Triton kernels of relibra_torch.ops, run on CPU by the Triton interpreter.

TRITON_INTERPRET=1 is set before the kernels are first imported (they are imported lazily
on the first Triton call). Every result is checked against the fp64 loop oracles of
relibra_torch.ops.oracle (permutations exactly; products within TOL[dtype] * sum|a*b|) and,
for the index kernels, against the torch reference bit for bit. The interpreter costs
~25 ms per Triton program, so shapes are small but still span several tiles (blocks of 32
rows/columns under the interpreter, 128 token-slots in the permutation kernels).
Budget: ~60 s on one core.

Shape legend: T tokens, K top-k, R sorted rows, D hidden, S slots, G weights; grouped GEMM
operands x_RK / w_GKN / y_RN (K reduction dim, N output dim).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import relibra_torch.ops as ops  # noqa: E402
from relibra_torch.ops import oracle, reference  # noqa: E402
from relibra_torch.ops.backend import uses_triton  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HYP = dict(deadline=None, derandomize=True, print_blob=True)


@pytest.fixture(autouse=True)
def _triton_backend():
    with ops.use_backend("triton"):
        assert uses_triton(torch.device("cpu"))
        yield


def _offsets(sizes):
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _rand(shape, dtype, seed):
    return torch.randn(shape, generator=_gen(seed)).to(dtype)


# ---------------------------------------------------------------------------- permute


@st.composite
def routing(draw):
    """(expert_slot_TK, S): uniform, skewed or single-slot routing, K from 1 up to S."""
    S = draw(st.integers(1, 13))
    K = draw(st.integers(1, S))
    T = draw(st.integers(0, 90))
    kind = draw(st.sampled_from(["uniform", "skewed", "one_slot", "few_slots"]))
    g = _gen(draw(st.integers(0, 2**16)))
    if kind == "uniform":
        slots = torch.randint(0, S, (T, K), generator=g)
    elif kind == "skewed":
        p = torch.rand(S, generator=g) ** 4 + 1e-3
        # multinomial refuses zero samples: T = 0 is drawn too
        slots = (torch.multinomial(p, T * K, replacement=True, generator=g).view(T, K) if T
                 else torch.zeros(0, K, dtype=torch.int64))
    elif kind == "one_slot":
        slots = torch.full((T, K), draw(st.integers(0, S - 1)), dtype=torch.int64)
    else:  # most slots empty
        used = torch.randperm(S, generator=g)[: max(1, S // 4)]
        slots = used[torch.randint(0, used.numel(), (T, K), generator=g)]
    return slots, S


@settings(max_examples=30, **HYP)
@given(case=routing(), dtype=st.sampled_from(DTYPES), D=st.integers(1, 40))
def test_permute_exact_and_inverse(case, dtype, D):
    slots_TK, S = case
    T, K = slots_TK.shape
    x_TD = _rand((T, D), dtype, 1)
    x_sorted, row_of, offsets = ops.permute(slots_TK, x_TD, S)
    want_row_of, want_offsets = oracle.permute_index(slots_TK, S)
    assert torch.equal(row_of, want_row_of)
    assert torch.equal(offsets, want_offsets)
    ref_row_of, ref_offsets = reference.permute_index(slots_TK, S)
    assert torch.equal(row_of, ref_row_of) and torch.equal(offsets, ref_offsets)
    # inverse permutation: every sorted row is exactly its token's row
    inverse = torch.full((T * K,), -1, dtype=torch.int64)
    inverse[row_of.reshape(-1)] = torch.arange(T * K)
    assert bool((inverse >= 0).all())
    assert torch.equal(x_sorted, x_TD[inverse // K])
    # gathering back with unit gates restores K * x exactly for dtypes where K*x is exact
    if T * K and dtype == torch.float32 and K in (1, 2, 4):
        assert torch.equal(ops.unpermute(x_sorted, row_of, None), x_TD * K)


def test_permute_top1_over_several_blocks():
    T, S = 300, 11  # n = 300 token-slots: three 128-blocks, the last one partial
    slots_TK = torch.randint(0, S, (T, 1), generator=_gen(5))
    slots_TK[::7] = 3  # a hot slot
    x_TD = _rand((T, 3), torch.float16, 6)
    x_sorted, row_of, offsets = ops.permute(slots_TK, x_TD, S)
    want_row_of, want_offsets = oracle.permute_index(slots_TK, S)
    assert torch.equal(row_of, want_row_of) and torch.equal(offsets, want_offsets)
    assert torch.equal(x_sorted[row_of[:, 0]], x_TD)


def test_permute_many_blocks_top_k_equals_num_slots():
    # n = T*K spans several 128-token-slot blocks and every token picks every slot once.
    T, S = 70, 7
    g = _gen(0)
    slots_TK = torch.stack([torch.randperm(S, generator=g) for _ in range(T)])
    x_TD = _rand((T, 5), torch.float32, 2).requires_grad_()
    x_sorted, row_of, offsets = ops.permute(slots_TK, x_TD, S)
    assert offsets.tolist() == [T * (s + 1) for s in range(S)]
    assert torch.equal(row_of, oracle.permute_index(slots_TK, S)[0])
    for narrow in (torch.int32, torch.int16):  # replay files store int16/int32 ids
        assert torch.equal(ops.permute_index(slots_TK.to(narrow), S)[0], row_of)
    grad = _rand((T * S, 5), torch.float32, 3)
    x_sorted.backward(grad)
    exact, bound = oracle.unpermute(grad, row_of, None)
    oracle.check_within(x_TD.grad, exact, bound, torch.float32, "permute dx")


# ---------------------------------------------------------------------------- unpermute


@settings(max_examples=15, **HYP)
@given(case=routing(), dtype=st.sampled_from(DTYPES), D=st.integers(1, 40), gates_dtype=st.sampled_from(["f32", "same"]))
def test_unpermute_forward_backward(case, dtype, D, gates_dtype):
    slots_TK, S = case
    T, K = slots_TK.shape
    _, row_of, _ = ops.permute(slots_TK, torch.zeros(T, 1), S)
    y_RD = _rand((T * K, D), dtype, 4).requires_grad_()
    gates_TK = torch.rand((T, K), generator=_gen(5)).to(torch.float32 if gates_dtype == "f32" else dtype)
    gates_TK.requires_grad_()
    out = ops.unpermute(y_RD, row_of, gates_TK)
    assert out.dtype == dtype
    oracle.check_within(out, *oracle.unpermute(y_RD.detach(), row_of, gates_TK.detach()), dtype, "out")
    dout = _rand((T, D), dtype, 6)
    out.backward(dout)
    d64, g64, y64 = dout.double(), gates_TK.detach().double(), y_RD.detach().double()
    dy_exact = torch.zeros(T * K, D, dtype=torch.float64)
    dy_exact[row_of.reshape(-1)] = (g64[..., None] * d64[:, None]).reshape(T * K, D)
    oracle.check_within(y_RD.grad, dy_exact, dy_exact.abs(), dtype, "dy")
    rows_TKD = y64[row_of]
    gtol_dtype = gates_TK.dtype
    oracle.check_within(gates_TK.grad, (rows_TKD * d64[:, None]).sum(-1),
                        (rows_TKD.abs() * d64.abs()[:, None]).sum(-1), gtol_dtype, "dgates")


def test_unpermute_extra_rows_get_zero_grad_and_is_deterministic():
    # y has more rows than token-slots (R > T*K): unread rows get exactly zero gradient.
    T, K, R, D = 5, 2, 14, 9
    row_of = torch.tensor([[3, 0], [13, 7], [1, 2], [10, 11], [4, 6]])
    y = _rand((R, D), torch.float32, 7).requires_grad_()
    gates = torch.rand((T, K), generator=_gen(8)).requires_grad_()
    out1 = ops.unpermute(y, row_of, gates)
    out2 = ops.unpermute(y, row_of, gates)
    assert torch.equal(out1, out2)
    out1.backward(_rand((T, D), torch.float32, 9))
    unread = torch.ones(R, dtype=torch.bool)
    unread[row_of.reshape(-1)] = False
    assert torch.equal(y.grad[unread], torch.zeros(int(unread.sum()), D))
    assert bool((y.grad[~unread] != 0).all())


# ---------------------------------------------------------------------------- grouped GEMM


@st.composite
def grouped_case(draw):
    """(sizes_S, slot_to_weight_S or None, G, Kd, N, tail rows)."""
    S = draw(st.sampled_from([1, 2, 3, 5, 7, 11]))
    size = st.one_of(st.just(0), st.just(1), st.integers(0, 70))
    sizes = draw(st.lists(size, min_size=S, max_size=S))
    if draw(st.booleans()):
        hot = draw(st.integers(0, S - 1))
        sizes = [draw(st.integers(1, 90)) if s == hot else 0 for s in range(S)]  # one group holds all
    if draw(st.booleans()):
        G = draw(st.integers(1, S))
        s2w = draw(st.lists(st.integers(0, G - 1), min_size=S, max_size=S))
    else:
        G, s2w = S, None
    Kd = draw(st.integers(1, 70))
    N = draw(st.integers(1, 70))
    tail = draw(st.sampled_from([0, 0, 3]))
    return sizes, s2w, G, Kd, N, tail


def _check_grouped_gemm(sizes, s2w, G, Kd, N, tail, dtype, w_transposed=False):
    offsets = _offsets(sizes)
    R = sum(sizes) + tail
    s2w_t = None if s2w is None else torch.tensor(s2w)
    x = _rand((R, Kd), dtype, 10).requires_grad_()
    if w_transposed:  # stride-generic: a [G, N, K] buffer viewed as [G, K, N]
        w = _rand((G, N, Kd), dtype, 11).transpose(1, 2).requires_grad_()
    else:
        w = _rand((G, Kd, N), dtype, 11).requires_grad_()
    y = ops.grouped_gemm(x, w, offsets, s2w_t)
    assert y.dtype == dtype and y.shape == (R, N)
    oracle.check_within(y, *oracle.grouped_mm(x.detach(), w.detach(), offsets, s2w_t), dtype, "y")
    dy = _rand((R, N), dtype, 12)
    y.backward(dy)
    dx_exact, dx_bound = oracle.grouped_mm(dy, w.detach().transpose(1, 2), offsets, s2w_t)
    oracle.check_within(x.grad, dx_exact, dx_bound, dtype, "dx")
    oracle.check_within(w.grad, *oracle.grouped_mm_wgrad(x.detach(), dy, offsets, s2w_t, G), dtype, "dw")


@settings(max_examples=24, **HYP)
@given(case=grouped_case(), dtype=st.sampled_from(DTYPES))
def test_grouped_gemm_forward_backward(case, dtype):
    _check_grouped_gemm(*case, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,sizes,s2w,G", [
    ("empty_and_one_row_groups", [0, 1, 0, 5, 1, 0, 33], None, 7),
    ("all_rows_in_one_group", [0, 0, 67, 0, 0], None, 5),
    ("replicas_share_weights", [9, 0, 31, 4, 17], [2, 0, 2, 1, 2], 4),
])
def test_grouped_gemm_edge_cases(name, sizes, s2w, G, dtype):
    # G=4 with s2w never naming weight 3: its gradient must be exactly zero
    _check_grouped_gemm(sizes, s2w, G, 37, 41, 2, dtype)


def test_grouped_gemm_transposed_weight_and_no_groups():
    _check_grouped_gemm([12, 0, 35], [1, 1, 0], 2, 33, 9, 0, torch.float32, w_transposed=True)
    # S = 0 slots: every row is outside every slot
    y = ops.grouped_gemm(torch.randn(4, 3), torch.randn(0, 3, 2), torch.zeros(0, dtype=torch.int32))
    assert torch.equal(y, torch.zeros(4, 2))


def test_grouped_gemm_matches_reference_and_is_deterministic():
    sizes, s2w = [20, 0, 45, 3], torch.tensor([0, 1, 0, 2])
    offsets = _offsets(sizes)
    # K = 64 is a multiple of the interpreter's BK = 32: the unmasked (EVEN_K) K loop
    x, dy = _rand((68, 64), torch.float32, 13), _rand((68, 24), torch.float32, 14)
    w = _rand((3, 64, 24), torch.float32, 15)
    y_tri = ops.grouped_gemm(x, w, offsets, s2w)
    dw_tri = ops.custom_ops.grouped_mm_wgrad(x, dy, offsets, s2w, 3)
    assert torch.equal(y_tri, ops.grouped_gemm(x, w, offsets, s2w))
    assert torch.equal(dw_tri, ops.custom_ops.grouped_mm_wgrad(x, dy, offsets, s2w, 3))
    with ops.use_backend("torch"):
        y_ref = ops.grouped_gemm(x, w, offsets, s2w)
        dw_ref = ops.custom_ops.grouped_mm_wgrad(x, dy, offsets, s2w, 3)
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw_tri, dw_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(dw_tri[1], torch.zeros(64, 24))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_swiglu_triton_matches_torch(dtype):
    sizes, s2w = [7, 0, 40, 1, 12], torch.tensor([1, 0, 1, 2, 0])
    offsets = _offsets(sizes)
    G, D, F = 3, 24, 36
    tensors = [_rand(s, dtype, 20 + i) for i, s in enumerate([(60, D), (G, D, F), (G, F, D), (G, D, F)])]
    dout = _rand((60, D), dtype, 30)
    results = {}
    for backend in ("triton", "torch"):
        leaves = [t.clone().requires_grad_() for t in tensors]
        with ops.use_backend(backend):
            y = ops.expert_swiglu(*leaves, offsets, s2w)
            y.backward(dout)
        results[backend] = [y.detach()] + [t.grad for t in leaves]
    # Three chained GEMMs with bf16 intermediates: an ulp of difference in h moves single
    # elements by several ulps, so bf16 is compared by relative Frobenius error.
    for name, a, b in zip(["y", "dx", "dw1", "dw2", "dw3"], results["triton"], results["torch"]):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)
        else:
            rel = float((a.float() - b.float()).norm() / b.float().norm())
            assert rel < 1e-2, f"{name}: relative Frobenius error {rel:.3g} >= 1e-2"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_outputs_round_to_nearest_even(dtype):
    # K = 1: each output is one product, exact in fp32, so the kernel's store must equal
    # torch's round-to-nearest-even cast bit for bit (the interpreter alone would truncate).
    x = _rand((40, 1), dtype, 40)
    w = _rand((2, 1, 35), dtype, 41)
    offsets = _offsets([15, 25])
    y = ops.grouped_gemm(x, w, offsets)
    want = torch.cat([x[:15].float() * w[0].float(), x[15:].float() * w[1].float()]).to(dtype)
    assert torch.equal(y, want)
