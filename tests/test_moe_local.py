"""ReplayBalancedMoE on one process: numerics against a token-by-token reference, routing
replay, placements, optimizer-state migration, checkpoints, counters and bad input.

fp32 tolerance: max |error| <= 1e-5 x max |reference| (``_moe_fns.close``). Budget: ~15 s.
"""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import _moe_fns as fns
from relibra_torch.moe import (LayerPlan, ReplayBalancedMoE, load_expert_safetensors, moe_layers,
                               save_expert_safetensors, share_replica_memory)
from relibra_torch.moe.schedule import native_layer_plan

D, F = fns.DIM, fns.HIDDEN


def _case(E=8, K=2, seed=0, **kw) -> fns.Case:
    return fns.Case(1, 1, E, K, kw.pop("replica_slots", 0), seed, ids_per_rank=[], **kw)


def _module(case: fns.Case) -> ReplayBalancedMoE:
    m = fns.build(case, None)
    m.load_state_dict(fns.logical_state(case))
    return m


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), T=st.integers(0, 7), K=st.integers(1, 3),
       score=st.sampled_from(["softmax", "sigmoid"]), norm=st.booleans(), shared=st.booleans(),
       bias=st.booleans(), replay=st.booleans(), scale=st.sampled_from([1.0, 2.5]))
def test_matches_token_by_token_reference(seed, T, K, score, norm, shared, bias, replay, scale):
    case = _case(E=6, K=K, seed=seed, score_func=score, route_norm=norm, shared=shared,
                 expert_bias=bias, route_scale=scale)
    m = _module(case)
    sd = fns.logical_state(case)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen, requires_grad=True)
    ids = fns.make_routing("random", [T], 6, K, gen)[0] if replay else None
    out = m(x, ids)
    ref_sd = {k: v.clone().requires_grad_() for k, v in sd.items()}
    xr = x.detach().clone().requires_grad_()
    ref = fns.naive_moe(ref_sd, xr, ids, K, score, norm, scale)
    fns.close(out.detach().numpy(), ref.detach().numpy(), "output")
    if T:
        g = torch.randn(T, D, generator=gen)
        out.backward(g)
        ref.backward(g)
        fns.close(x.grad.numpy(), xr.grad.numpy(), "input gradient")
        if K == 1 and norm:
            # The gate is always 1: the router gradient is zero in exact arithmetic and both
            # sides hold rounding noise of the softmax Jacobian's cancelling terms.
            assert m.gate.weight.grad.abs().max() <= 1e-5 * xr.grad.abs().max()
        else:
            fns.close(m.gate.weight.grad.numpy(), ref_sd["gate.weight"].grad.numpy(), "router gradient")
        for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
            fns.close(m.get_parameter(n).grad.numpy(), ref_sd[n].grad.numpy(), n)
    want_ids = ids if replay else m.last_expert_ids_TK
    assert torch.equal(m.last_expert_ids_TK, want_ids)
    assert torch.equal(m.last_slot_tokens_J[:6], torch.bincount(want_ids.reshape(-1), minlength=6))


def test_replay_uses_given_experts_and_router_keeps_gradient():
    case = _case(E=8, K=2, seed=3)
    m = _module(case)
    x = torch.randn(5, D)
    ids = torch.tensor([[7, 6]] * 5)  # not what the router would choose
    assert not torch.equal(m(x).detach(), m(x, ids).detach())
    m.zero_grad()
    m(x, ids).backward(torch.randn(5, D))
    assert torch.equal(m.last_expert_ids_TK, ids)
    grad = m.gate.weight.grad
    assert grad[6:].abs().sum() > 0  # the chosen experts' scores carry gradient
    # Leading dims are kept and int16/int32 ids (replay files) are accepted.
    out = m(x.view(1, 5, D), ids.view(1, 5, 2).to(torch.int16))
    assert out.shape == (1, 5, D)


def test_placement_and_optimizer_state_move_with_the_experts():
    case = _case(E=8, K=2, seed=5, shared=True)
    a, b = _module(case), _module(case)
    b.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(1)))
    x, g = torch.randn(9, D), torch.randn(9, D)
    ids = torch.randint(0, 8, (9, 2), generator=torch.Generator().manual_seed(2))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)]
    for step in range(3):
        for m, opt in zip((a, b), opts):
            opt.zero_grad()
            m(x, ids).backward(g)
            opt.step()
        # Reorder b between steps, Adam state along.
        moved = b.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(10 + step)), opts[1])
        assert moved >= 0
        assert not b.plan
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        fns.close(sb[k].numpy(), sa[k].numpy(), k)
    for n in ("w1_EFD", "w2_EDF", "w3_EFD"):
        for key in ("exp_avg", "exp_avg_sq"):
            la = opts[0].state[a.get_parameter(n)][key]
            lb = opts[1].state[b.get_parameter(n)][key]
            perm = torch.empty(8, dtype=torch.int64)
            perm[b.native_experts()] = torch.arange(8)
            fns.close(lb[perm].numpy(), la.numpy(), f"{n} {key}")


def _reordered_layer_and_its_counts():
    """A one-process layer with 8 experts on a shuffled placement, its input, routed ids,
    their local output and their counts ``[1, E]``."""
    case = _case(E=8, K=2, seed=7, replica_slots=2)
    m = _module(case)
    m.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(3)))
    x = torch.randn(6, D)
    ids = torch.randint(0, 8, (6, 2), generator=torch.Generator().manual_seed(4))
    local = m(x, ids).detach()
    return m, x, ids, local, torch.bincount(ids.reshape(-1), minlength=8).view(1, 8)


def test_one_process_plan_executes_like_local_path():
    m, x, ids, local, counts = _reordered_layer_and_its_counts()
    m.set_plan(native_layer_plan(m.topology, m.placement_E.cpu(), counts))
    fns.close(m(x, ids).detach().numpy(), local.numpy(), "planned output")
    assert m.last_expert_tokens == 12
    # A plan made from other counts: by default the forward degrades (correct result on the
    # placement without replicas, a warning, a count); on_mismatch="raise" refuses it.
    other = (ids + 1) % 8
    m.set_plan(None)
    want = m(x, other).detach()
    m.set_plan(native_layer_plan(m.topology, m.placement_E.cpu(), counts))
    with pytest.warns(RuntimeWarning, match="do not match the installed plan"):
        import relibra_torch.moe.plan_check as check_mod
        check_mod._MISMATCH_WARNED = False
        got = m(x, other).detach()
    fns.close(got.numpy(), want.numpy(), "degraded output")
    assert m.engine.degraded_forwards == 1 and m.engine.degraded_micro_batches == {-1}
    m.engine.on_mismatch = "raise"
    with pytest.raises(ValueError, match="do not match the installed plan"):
        m(x, other)
    m.set_plan(None)
    assert m.plan is None


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10**6), T=st.integers(0, 7), K=st.integers(1, 3), norm=st.booleans(),
       shared=st.booleans(), placed=st.booleans())
def test_pad_ids_are_skipped_and_keep_shared_experts(seed, T, K, norm, shared, placed):
    """-1 ids: no expert for that (token, k); gate 0, not counted, not computed; a token whose
    ids are all -1 gets only the shared experts. Checked against the token-by-token reference,
    on the local path and on a one-process plan made from pad-free counts."""
    case = _case(E=6, K=K, seed=seed, route_norm=norm, shared=shared, replica_slots=1)
    m = _module(case)
    if placed:
        m.apply_placement(torch.randperm(6, generator=torch.Generator().manual_seed(seed)))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    ids = fns.with_pads(fns.make_routing("random", [T], 6, K, gen), gen, 0.3, 0.3)[0]
    ref = fns.naive_moe(fns.logical_state(case), x, ids, K, route_norm=norm)
    m.train()
    fns.close(m(x, ids).detach().numpy(), ref.numpy(), "local output with pads")
    want_counts = fns.loads_of([ids], 6).view(6)
    assert torch.equal(m.tokens_per_expert_E.long(), want_counts)
    assert m.last_expert_tokens == int(want_counts.sum())
    m.set_plan(native_layer_plan(m.topology, m.placement_E.cpu(), want_counts.view(1, 6)))
    fns.close(m(x, ids).detach().numpy(), ref.numpy(), "planned output with pads")
    assert m.last_expert_tokens == int(want_counts.sum()) and m.engine.degraded_forwards == 0
    all_pad = (ids < 0).all(1)
    if all_pad.any():
        shared_only = (m.shared_experts(x[all_pad]) if shared else torch.zeros(int(all_pad.sum()), D))
        fns.close(ref[all_pad].numpy(), shared_only.detach().numpy(), "all-pad tokens")
    with pytest.raises(ValueError, match=r"allowed: \[0, num_experts=6\), or -1"):
        m.set_plan(None)
        m(torch.randn(1, D), torch.full((1, K), -2))


def test_state_dict_is_logical_and_loads_across_placements(tmp_path):
    case = _case(E=8, K=2, seed=11)
    a = _module(case)
    a.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(5)))
    sd = a.state_dict()
    ref = fns.logical_state(case)
    for k in ref:
        assert torch.equal(sd[k], ref[k]), k  # bit-exact, logical order
    assert "placement_E" not in sd and "tokens_per_expert_E" not in sd
    b = fns.build(case, None)
    b.apply_placement(torch.randperm(8, generator=torch.Generator().manual_seed(6)))
    b.load_state_dict(sd)
    x, ids = torch.randn(4, D), torch.randint(0, 8, (4, 2))
    fns.close(b(x, ids).detach().numpy(), a(x, ids).detach().numpy(), "output after load")

    # safetensors: logical order, bit-exact round trip through another placement.
    model = torch.nn.ModuleDict({"l0": a, "l1": _module(dataclasses.replace(case, seed=12))})
    path = str(tmp_path / "experts.safetensors")
    written = save_expert_safetensors(model, path)
    assert torch.equal(written["l0.w1_EFD"], ref["w1_EFD"])
    other = torch.nn.ModuleDict({"l0": fns.build(case, None), "l1": fns.build(case, None)})
    other["l1"].apply_placement(torch.arange(8).flip(0))
    load_expert_safetensors(other, path)
    again = save_expert_safetensors(other, str(tmp_path / "again.safetensors"))
    assert written.keys() == again.keys()
    for k in written:
        assert torch.equal(written[k], again[k]), k
    assert [n for n, _ in moe_layers(other)] == ["l0", "l1"]
    with pytest.raises(ValueError, match="missing tensor"):
        load_expert_safetensors(torch.nn.ModuleDict({"zz": fns.build(case, None)}), path)


def test_replica_memory_shared_across_layers_is_zero_without_fills():
    case = _case(E=4, K=2, seed=1)
    model = torch.nn.Sequential(fns.build(case, None), fns.build(case, None))
    mem = share_replica_memory(model)
    assert model[0].replica_memory is mem is model[1].replica_memory
    model(torch.randn(3, D)).sum().backward()
    assert mem.peak_bytes == 0 and mem.live_bytes == 0


def test_bad_input_raises_value_error_naming_the_problem():
    case = _case(E=8, K=2, seed=0, replica_slots=1)
    m = _module(case)
    x = torch.randn(4, D)
    with pytest.raises(ValueError, match=r"ids in \[0, 8\].*num_experts=8"):
        m(x, torch.tensor([[0, 8]] * 4))
    with pytest.raises(ValueError, match=r"ids in \[-3, 1\].*or -1 for a pad"):
        m(x, torch.tensor([[0, 1]] * 3 + [[-3, 1]]))
    with pytest.raises(ValueError, match=r"shape \(4, 3\), expected \(4, 2\)"):
        m(x, torch.zeros(4, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"shape \(3, 2\), expected \(4, 2\)"):
        m(x, torch.zeros(3, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer"):
        m(x, torch.zeros(4, 2))
    with pytest.raises(ValueError, match="last dim"):
        m(torch.randn(4, D + 1))
    # A plan for a 2 x 2 topology on a one-process layer.
    other = native_layer_plan(fns.Case(2, 2, 8, 2, 1, 0, []).topology(), torch.arange(8),
                              torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="another topology"):
        m.set_plan(other)
    with pytest.raises(TypeError, match="LayerPlan"):
        m.set_plan("plan")
    with pytest.raises(ValueError, match="permutation"):
        m.apply_placement(torch.zeros(8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"top_k = 9; allowed: an int in \[1, 8\]"):
        ReplayBalancedMoE(D, F, 8, 9)
    with pytest.raises(TypeError, match=r"replica_slots is bool True; allowed: an int >= 0"):
        ReplayBalancedMoE(D, F, 8, 2, replica_slots=True)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['replica_slot'\]"):
        ReplayBalancedMoE(D, F, 8, 2, replica_slot=1)
    with pytest.raises(ValueError, match="score_func"):
        ReplayBalancedMoE(D, F, 8, 2, score_func="relu")
    with pytest.raises(ValueError, match="placement"):
        lp = native_layer_plan(m.topology, torch.arange(8), torch.ones(1, 8, dtype=torch.int64))
        m.apply_placement(torch.arange(8).flip(0))
        m.set_plan(lp)
    assert isinstance(lp, LayerPlan)


def test_a_native_plan_runs_the_native_path_and_checks_its_counts():
    """``set_plan(plan, NATIVE)`` (what ``rank_schedules`` gives a layer it keeps): the
    forward counts at run time (no schedule installed) and gives the local result; routed
    ids other than the plan's are recorded under the plan's micro-batch (the forward is
    correct either way), or raise with ``on_mismatch="raise"``."""
    import dataclasses

    import relibra_torch.moe.plan_check as check_mod
    from relibra_torch.moe.native import NATIVE

    m, x, ids, local, counts = _reordered_layer_and_its_counts()
    plan = dataclasses.replace(native_layer_plan(m.topology, m.placement_E.cpu(), counts), micro_batch=2)
    m.set_plan(plan, NATIVE)
    assert m.plan is plan and m.engine._schedule is None
    fns.close(m(x, ids).detach().numpy(), local.numpy(), "native output")
    assert m.engine.degraded_forwards == 0
    other = (ids + 1) % 8
    m.set_plan(None)
    want = m(x, other).detach()
    m.set_plan(plan, NATIVE)
    check_mod._MISMATCH_WARNED = False
    with pytest.warns(RuntimeWarning, match="EP ranks \\[0\\]"):
        got = m(x, other).detach()
    fns.close(got.numpy(), want.numpy(), "native output of other ids")
    assert m.engine.degraded_forwards == 1 and m.engine.degraded_micro_batches == {2}
    m.engine.on_mismatch = "raise"
    with pytest.raises(ValueError, match="do not match the installed plan"):
        m(x, other)
