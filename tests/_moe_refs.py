"""ReplayBalancedMoE test references: a token-by-token MoE, one-process runs of the same
cases, and the comparisons the distributed tests make against them.

Legend: T tokens, D dim, E experts, K top-k, S source ranks, G GPUs, M micro-batches, L layers.
"""

from __future__ import annotations

import numpy as np
import torch

from _moe_cases import Case, build, inputs, logical_state

def naive_moe(sd: dict, x_TD: torch.Tensor, ids_TK: torch.Tensor | None, top_k: int,
              score_func: str = "softmax", route_norm: bool = False, route_scale: float = 1.0) -> torch.Tensor:
    """Token-by-token MoE from a logical state dict: the independent reference."""
    scores = x_TD.float() @ sd["gate.weight"].float().t()
    scores = scores.softmax(-1) if score_func == "softmax" else scores.sigmoid()
    if ids_TK is None:
        choice = scores + sd["expert_bias_E"] if "expert_bias_E" in sd else scores
        ids_TK = choice.topk(top_k, dim=-1).indices
    gates = scores.gather(1, ids_TK.clamp(min=0)) * (ids_TK >= 0)  # -1: a pad, no expert
    if route_norm:
        gates = gates / (gates.sum(-1, keepdim=True) + 1e-20)
    gates = gates * route_scale
    rows = []
    for t in range(x_TD.shape[0]):
        acc = torch.zeros(x_TD.shape[1])
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            h = torch.nn.functional.silu(sd["w1_EFD"][e] @ x_TD[t]) * (sd["w3_EFD"][e] @ x_TD[t])
            acc = acc + gates[t, k] * (sd["w2_EDF"][e] @ h)
        if "shared_experts.w1.weight" in sd:
            h = (torch.nn.functional.silu(sd["shared_experts.w1.weight"] @ x_TD[t])
                 * (sd["shared_experts.w3.weight"] @ x_TD[t]))
            acc = acc + sd["shared_experts.w2.weight"] @ h
        rows.append(acc)
    return torch.stack(rows) if rows else x_TD.new_zeros(0, x_TD.shape[1])


def reference(case: Case) -> dict[str, np.ndarray]:
    """The same layer on one process over all ranks' tokens: outputs and gradients."""
    torch.manual_seed(0)
    m = build(case, None)
    m.load_state_dict(logical_state(case))
    xs, gs = inputs(case)
    x = torch.cat(xs).requires_grad_()
    ids = None if case.self_route else torch.cat(case.ids_per_rank)
    out = m(x, ids)
    out.backward(torch.cat(gs))
    res = {"out": out.detach().numpy(), "x_grad": x.grad.numpy(), "gate_grad": m.gate.weight.grad.numpy()}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = m.get_parameter(n).grad.numpy()
    if case.shared:
        res["shared_grad"] = m.shared_experts.w1.weight.grad.numpy()
    return res


def assemble_logical(results: list[dict], name: str, num_experts: int) -> np.ndarray:
    """Logical ``[E, ...]`` from every rank's physical local rows."""
    first = results[0][name]
    out = np.zeros((num_experts, *first.shape[1:]), dtype=first.dtype)
    seen = np.zeros(num_experts, dtype=bool)
    for res in results:
        for i, e in enumerate(res["native"]):
            out[e] = res[name][i]
            seen[e] = True
    assert seen.all()
    return out


def close(a: np.ndarray, b: np.ndarray, what: str, rel: float = 1e-5, floor: float = 1e-6) -> None:
    """fp32 check: max |a - b| <= rel * max |b| + floor.

    Relative to the tensor's scale; the absolute ``floor`` (far below ``rel`` for the O(1)
    tensors of these tests) only matters for tensors that are zero in exact arithmetic
    (e.g. the router gradient with top_k = 1 and route_norm, where the gate is always 1).
    """
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    scale = float(np.abs(b).max()) if b.size else 0.0
    err = float(np.abs(a - b).max()) if b.size else 0.0
    assert err <= rel * scale + floor, f"{what}: max abs error {err:.3g} > {rel:g} x scale {scale:.3g} + {floor:g}"


def check_case(case: Case, results: list[dict]) -> None:
    """Compare rank results with the one-process reference."""
    ref = reference(case)
    start = 0
    for r, res in enumerate(results):
        T = case.ids_per_rank[r].shape[0]
        close(res["out"], ref["out"][start : start + T], f"rank {r} output")
        close(res["x_grad"], ref["x_grad"][start : start + T], f"rank {r} input gradient")
        start += T
    gate_grad = sum(res["gate_grad"] for res in results)
    if case.top_k == 1 and case.route_norm:
        # Gates are always 1: zero in exact arithmetic, rounding noise on both sides.
        assert np.abs(gate_grad).max() <= 1e-5 * np.abs(ref["x_grad"]).max()
    else:
        close(gate_grad, ref["gate_grad"], "router gradient")
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        close(assemble_logical(results, n, case.num_experts), ref[n], f"expert gradient {n}")
    if case.shared:
        close(sum(res["shared_grad"] for res in results), ref["shared_grad"], "shared expert gradient")


def reference_stack(cases: list[Case]) -> dict:
    mods = []
    for case in cases:
        m = build(case, None)
        m.load_state_dict(logical_state(case))
        mods.append(m)
    xs, gs = inputs(cases[0])
    x = torch.cat(xs).requires_grad_()
    h = x
    for m, case in zip(mods, cases):
        h = h + m(h, torch.cat(case.ids_per_rank))
    h.backward(torch.cat(gs))
    res = {"out": h.detach().numpy(), "x_grad": x.grad.numpy(),
           "gate_grad": [m.gate.weight.grad.numpy() for m in mods]}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        res[n] = [m.get_parameter(n).grad.numpy() for m in mods]
    return res


def reference_training(case: Case, steps: int, lr: float = 1e-2) -> dict:
    m = build(case, None)
    m.load_state_dict(logical_state(case))
    opt = torch.optim.AdamW(m.parameters(), lr=lr, foreach=False)
    xs, gs = inputs(case)
    for _ in range(steps):
        opt.zero_grad()
        m(torch.cat(xs), torch.cat(case.ids_per_rank)).backward(torch.cat(gs))
        opt.step()
    res = {k: v.numpy() for k, v in m.state_dict().items()}
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        for key in ("exp_avg", "exp_avg_sq"):
            res[f"{n}.{key}"] = opt.state[m.get_parameter(n)][key].numpy()
    return res
