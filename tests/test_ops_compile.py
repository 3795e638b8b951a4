"""relibra_torch.ops under torch.compile: custom-op registration checks and one inductor graph.

The ops are torch.library custom ops with fake kernels and registered autograd; opcheck
validates each registration, and one fullgraph inductor compile of permute -> SwiGLU experts
-> unpermute (forward and backward) must match eager on both backends, the backend being
read when the compiled graph runs. Budget: ~30 s on one core (the inductor compile ~15 s).

Shape legend: T tokens, K top-k, R sorted rows, D hidden, F expert hidden, S slots, G weights.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

import relibra_torch.ops as ops  # noqa: E402
from relibra_torch.ops import custom_ops  # noqa: E402


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _opcheck_cases():
    g = _gen(0)
    slots_TK = torch.randint(0, 5, (6, 2), generator=g)
    row_of_TK, offsets_S = custom_ops.permute_index(slots_TK, 5)
    x_TD = torch.randn(6, 8, generator=g, requires_grad=True)
    y_RD = torch.randn(12, 8, generator=g, requires_grad=True)
    gates_TK = torch.rand(6, 2, generator=g, requires_grad=True)
    x_RK = torch.randn(12, 8, generator=g, requires_grad=True)
    w_GKN = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    s2w_S = torch.tensor([0, 2, 2, 1, 0])
    return [
        (custom_ops.permute_index, (slots_TK, 5)),
        (custom_ops.permute_rows, (x_TD, row_of_TK)),
        (custom_ops.unpermute_rows, (y_RD, row_of_TK, gates_TK)),
        (custom_ops.unpermute_rows, (y_RD, row_of_TK, None)),
        (custom_ops.unpermute_rows_backward, (torch.randn(6, 8, generator=g), y_RD.detach(), row_of_TK,
                                              gates_TK.detach())),
        (custom_ops.grouped_mm, (x_RK, w_GKN, offsets_S, s2w_S)),
        (custom_ops.grouped_mm_wgrad, (x_RK.detach(), torch.randn(12, 4, generator=g), offsets_S, s2w_S, 3)),
    ]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_opcheck_every_custom_op(backend):
    with ops.use_backend(backend):
        for op, args in _opcheck_cases():
            torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration",
                                                        "test_faketensor"))


def _moe(slots_TK, x_TD, gates_TK, w1_GDF, w2_GFD, w3_GDF, s2w_S):
    x_RD, row_of_TK, offsets_S = ops.permute(slots_TK, x_TD, s2w_S.shape[0])
    y_RD = ops.expert_swiglu(x_RD, w1_GDF, w2_GFD, w3_GDF, offsets_S, s2w_S)
    return ops.unpermute(y_RD, row_of_TK, gates_TK)


@pytest.mark.slow
def test_inductor_fullgraph_matches_eager_on_both_backends(monkeypatch):
    T, K, S, G, D, F = 11, 2, 5, 3, 16, 24
    g = _gen(1)
    slots_TK = torch.randint(0, S, (T, K), generator=g)
    s2w_S = torch.tensor([0, 1, 2, 0, 1])
    inputs = [torch.randn(T, D, generator=g), torch.rand(T, K, generator=g),
              torch.randn(G, D, F, generator=g) / 4, torch.randn(G, F, D, generator=g) / 4,
              torch.randn(G, D, F, generator=g) / 4]
    dout_TD = torch.randn(T, D, generator=g)
    compiled = torch.compile(_moe, fullgraph=True, backend="inductor")

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(slots_TK, leaves[0], leaves[1], *leaves[2:], s2w_S)
        out.backward(dout_TD)
        return [out.detach()] + [t.grad for t in leaves]

    # count the Triton grouped GEMM launches to see the switch act inside the compiled graph
    from relibra_torch.ops import triton_kernels

    calls = []
    real = triton_kernels.grouped_mm
    monkeypatch.setattr(triton_kernels, "grouped_mm", lambda *a: calls.append(1) or real(*a))
    for backend in ("torch", "triton"):
        with ops.use_backend(backend):
            eager = run(_moe)
            n_eager = len(calls)
            comp = run(compiled)
        # 3 forward GEMMs + 3 input-gradient GEMMs per run, only on the Triton backend
        assert len(calls) - n_eager == (6 if backend == "triton" else 0), backend
        for name, a, b in zip(["out", "dx", "dgates", "dw1", "dw2", "dw3"], comp, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{backend} {name}")
