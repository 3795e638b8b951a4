"""torchtitan integration, one process: the swap is exact, replay works, checkpoints are logical.

Budget: ~25 s on one core (two small model pairs, a handful of forward/backward passes).
Tolerance: fp32 everywhere, 1e-5 relative to each tensor's largest magnitude.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import titan_fixtures as tf
from integrations.torchtitan import (OVERRIDE_TARGET, RelibraMoE, RelibraRoutedExperts, apply_relibra,
                                     clear_routing_replay, record_routing, relibra_moe_config,
                                     relibra_moe_layers, replay_router_scores, set_routing_replay)

RTOL = 1e-5  # fp32
# deepseek_v3 debugmodel at full size (6 layers, the first dense; 8 experts, top-3, 2 shared
# experts); qwen3 debugmodel_moe with its structure (64 experts, top-8, softmax + norm) but
# 2 of its 8 layers and expert hidden 32 instead of 768 (316 M parameters do not fit the
# CPU test budget; every layer is built from the same config).
FLAVOR_SIZE = {"qwen3": dict(n_layers=2, moe_hidden_dim=32),
               "deepseek_v3": dict(n_layers=None, moe_hidden_dim=None)}


def _pair(name: str, seed: int = 1, **options):
    """(original fp32-reference model, swapped model) with the same weights."""
    size = FLAVOR_SIZE[name]
    ref = tf.build(tf.model_config(name, fp32_reference=True, **size), seed=seed)
    sw = tf.build(tf.relibra_config(name, **size, **options), seed=seed + 1)
    sw.load_state_dict(ref.state_dict(), strict=True)
    return ref, sw


def _fwd_bwd(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = tf.loss_fn(model(x), y)
    loss.backward()
    # zero_grad(set_to_none=True) gives the next call new tensors: no copy needed.
    return loss.detach(), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_swap_matches_original_loss_and_grads(name):
    ref, sw = _pair(name)
    assert {k: v.shape for k, v in ref.state_dict().items()} == {k: v.shape for k, v in sw.state_dict().items()}
    layers = relibra_moe_layers(sw)
    assert layers and all(isinstance(m.routed_experts, RelibraRoutedExperts) for m in layers)
    x, y = tf.tokens(2, 16, ref.config.vocab_size, seed=0)

    loss_ref, grads_ref = _fwd_bwd(ref, x, y)
    with record_routing(sw) as rec:
        loss_sw, grads_sw = _fwd_bwd(sw, x, y)
    tf.assert_close(loss_sw, loss_ref, RTOL, "loss")
    assert grads_ref.keys() == grads_sw.keys()
    for k in grads_ref:
        tf.assert_close(grads_sw[k], grads_ref[k], RTOL, f"grad {k}")
    # The aux-loss-free balancing counters see the same routing.
    bufs_sw = dict(sw.named_buffers())
    counters = [k for k, _ in ref.named_buffers() if k.endswith("tokens_per_expert_E")]
    assert counters
    for k in counters:
        assert torch.equal(dict(ref.named_buffers())[k], bufs_sw[k]), k

    # Replaying the routing the model chose gives the same loss and gradients.
    ids_BSNK = torch.stack([r[0] for r in rec], dim=2)
    assert ids_BSNK.shape == (2, 16, len(layers), layers[0].router.top_k)
    set_routing_replay(sw, ids_BSNK)
    loss_rp, grads_rp = _fwd_bwd(sw, x, y)
    tf.assert_close(loss_rp, loss_ref, RTOL, "replayed loss")
    for k in grads_ref:
        tf.assert_close(grads_rp[k], grads_ref[k], RTOL, f"replayed grad {k}")


def test_full_qwen3_debugmodel_moe_matches_original():
    """The qwen3 flavor at full size (8 layers, 64 experts of hidden 768, 316 M parameters).

    Memory: the original model shares the swapped model's parameter storage
    (``assign=True``), and only the first and last MoE layers' expert weights collect
    gradients (the other six would add 0.9 GB per model for the same check); every other
    parameter's gradient is compared.
    """
    size = dict(n_layers=None, moe_hidden_dim=None)
    sw = tf.build(tf.relibra_config("qwen3", **size), seed=3)
    with torch.device("meta"):
        ref = tf.model_config("qwen3", fp32_reference=True, **size).build()
    ref.load_state_dict(sw.state_dict(), assign=True)
    for m in ref.modules():  # non-persistent buffers (RoPE caches, MoE counters)
        if hasattr(m, "_init_self_buffers"):
            m._init_self_buffers(buffer_device=torch.device("cpu"))
    assert not any(t.is_meta for t in [*ref.parameters(), *ref.buffers()])
    frozen = [f"layers.{i}.moe.routed_experts.inner_experts." for i in range(1, 7)]
    for model in (sw, ref):
        for k, p in model.named_parameters():
            p.requires_grad_(not any(k.startswith(f) for f in frozen))
    x, y = tf.tokens(2, 16, ref.config.vocab_size, seed=4)
    loss_ref, grads_ref = _fwd_bwd(ref, x, y)
    loss_sw, grads_sw = _fwd_bwd(sw, x, y)
    tf.assert_close(loss_sw, loss_ref, RTOL, "loss")
    compared = 0
    for k, g in grads_ref.items():
        if g is not None:
            tf.assert_close(grads_sw[k], g, RTOL, f"grad {k}")
            compared += 1
    assert compared == sum(p.requires_grad for p in ref.parameters()) > 60


def test_replay_changes_routing_and_can_be_cleared():
    _, sw = _pair("deepseek_v3")
    x, y = tf.tokens(1, 8, sw.config.vocab_size, seed=1)
    with torch.no_grad(), record_routing(sw) as rec:
        own = sw(x)
        E = relibra_moe_layers(sw)[0].routed_experts.num_experts
        K = relibra_moe_layers(sw)[0].router.top_k
        ids = torch.stack([r[0] for r in rec], dim=2)
        other = (ids + 1) % E  # still K distinct experts per token
        set_routing_replay(sw, other)
        replayed = sw(x)
        clear_routing_replay(sw)
        again = sw(x)
    assert torch.equal(rec[0][1], other[:, :, 0]) and rec[0][1].shape[-1] == K
    assert not torch.allclose(replayed, own)
    assert torch.equal(again, own)


@settings(max_examples=25, deadline=None)
@given(score_func=st.sampled_from(["softmax", "sigmoid"]), route_norm=st.booleans(),
       route_scale=st.sampled_from([1.0, 2.5]), with_bias=st.booleans(), seed=st.integers(0, 1000))
def test_replayed_router_reproduces_router_on_its_own_choice(score_func, route_norm, route_scale,
                                                            with_bias, seed):
    from torchtitan.models.common.config_utils import make_router_config
    torch.manual_seed(seed)
    cfg = make_router_config(dim=16, num_experts=8, gate_param_init={}, top_k=3, score_func=score_func,
                             route_norm=route_norm, route_scale=route_scale)
    router = cfg.build()
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(2, 5, 16)
    bias = torch.randn(8) * 0.3 if with_bias else None
    scores, ids, full = router(x, bias)
    r_scores, r_ids, r_full = replay_router_scores(router, x, ids)
    assert torch.equal(r_ids, ids)
    torch.testing.assert_close(r_scores, scores, rtol=0, atol=0)
    torch.testing.assert_close(r_full, full, rtol=0, atol=0)


def test_override_options_and_errors():
    cfg = tf.model_config("deepseek_v3", n_layers=3)
    moe_cfg = cfg.layers[1].moe
    new = relibra_moe_config(moe_cfg, planner="eplb", replica_slots=2, reorder=False, gpus_per_node=4,
                             planner_options={"window": 3})
    assert isinstance(new, RelibraMoE.Config)
    assert (new.planner, new.reorder, new.planner_options) == ("eplb", False, {"window": 3})
    assert (new.routed_experts.replica_slots, new.routed_experts.gpus_per_node) == (2, 4)
    # Everything else is the original's: router, experts, shared experts, init, sharding.
    assert new.router is moe_cfg.router and new.shared_experts is moe_cfg.shared_experts
    assert new.routed_experts.inner_experts is moe_cfg.routed_experts.inner_experts
    assert "placement_E" in new.routed_experts.sharding_config.state_shardings
    with pytest.raises(ValueError, match="planner = 'greedy'; allowed: one of 'static'"):
        relibra_moe_config(moe_cfg, planner="greedy")
    with pytest.raises(ValueError, match="expert_dtype = 'int8'; allowed: one of 'bfloat16'"):
        relibra_moe_config(moe_cfg, expert_dtype="int8")
    assert relibra_moe_config(moe_cfg, dispatch="hierarchical").routed_experts.dispatch == "hierarchical"
    assert new.routed_experts.dispatch == "flat"
    with pytest.raises(ValueError, match="dispatch = 'deepep'; allowed: one of 'flat', 'hierarchical'"):
        relibra_moe_config(moe_cfg, dispatch="deepep").routed_experts.build()
    with pytest.raises(ValueError, match="replica_slots = -1; allowed: an int >= 0"):
        relibra_moe_config(moe_cfg, replica_slots=-1).routed_experts.build()
    with pytest.raises(TypeError, match="MoE.Config"):
        relibra_moe_config(cfg.layers[0].feed_forward)
    # Through torchtitan's override machinery, as a Trainer would apply it.
    lines = apply_relibra(cfg, replica_slots=3)
    assert len(lines) == 2 and all(OVERRIDE_TARGET in line for line in lines)
    assert cfg.layers[0].moe is None and isinstance(cfg.layers[2].moe, RelibraMoE.Config)
    assert cfg.layers[2].moe.routed_experts.replica_slots == 3


def test_replay_input_errors():
    _, sw = _pair("deepseek_v3")
    N, E, K = 5, 8, 3  # full deepseek_v3 debugmodel: 5 MoE layers
    with pytest.raises(ValueError, match="MoE layers"):
        set_routing_replay(sw, torch.zeros(1, 8, N + 1, K, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[B, Q, K=3\]"):
        set_routing_replay(sw, torch.zeros(1, 8, N, K + 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 7\] \(or -1 for a pad\)"):
        set_routing_replay(sw, torch.full((1, 8, N, K), E, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"values in \[-2, -2\]"):
        set_routing_replay(sw, torch.full((1, 8, N, K), -2, dtype=torch.int64))
    set_routing_replay(sw, torch.zeros(1, 4, N, K, dtype=torch.int64))
    x, _ = tf.tokens(1, 8, sw.config.vocab_size, seed=2)
    with pytest.raises(ValueError, match="this micro-batch is"):
        sw(x)
    with pytest.raises(ValueError, match="no RelibraMoE"):
        set_routing_replay(tf.build(tf.model_config("deepseek_v3", n_layers=2)), None)


def test_pad_ids_in_replay_skip_experts():
    """-1 pads through the swapped model. In the first MoE layer (whose input does not depend
    on routing): a token padded in every slot gets no routed output (shared experts only),
    a token padded in one slot loses exactly that expert's share, the other tokens are
    unchanged, and the expert counts skip the pads."""
    _, sw = _pair("deepseek_v3", seed=11)
    N, K = 5, 3
    x, _ = tf.tokens(1, 8, sw.config.vocab_size, seed=4)
    ids = torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:K]
                       for t in range(8 * N)]).view(1, 8, N, K)
    layer = relibra_moe_layers(sw)[0]
    outs = []
    h = layer.routed_experts.register_forward_hook(lambda _m, _i, out: outs.append(out.detach().clone()))
    set_routing_replay(sw, ids)
    sw(x)
    padded = ids.clone()
    padded[0, 3] = -1              # token 3: no routed expert in any layer
    padded[0, 5, :, 1] = -1        # token 5: its second expert dropped
    set_routing_replay(sw, padded)
    before = layer.tokens_per_expert_E.clone()
    sw.train()
    sw(x)
    h.remove()
    full, pad = outs[0][0], outs[-1][0]
    assert torch.count_nonzero(pad[3]) == 0
    keep = [t for t in range(8) if t not in (3, 5)]
    torch.testing.assert_close(pad[keep], full[keep])
    assert not torch.allclose(pad[5], full[5])
    added = layer.tokens_per_expert_E - before
    assert int(added.sum()) == 8 * K - K - 1


def _shuffle_placements(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for m in relibra_moe_layers(model):
        m.routed_experts.apply_placement(torch.randperm(m.routed_experts.num_experts, generator=gen))


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_dcp_checkpoint_swapped_to_original_and_back(name, tmp_path):
    ref, sw = _pair(name, seed=5)
    x, y = tf.tokens(1, 8, ref.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = ref(x)
    # Rows stored in a non-trivial placement; the checkpoint must still be logical.
    _shuffle_placements(sw, seed=0)
    assert any(not torch.equal(m.routed_experts.placement_E, torch.arange(m.routed_experts.num_experts))
               for m in relibra_moe_layers(sw))
    with torch.no_grad():
        tf.assert_close(sw(x), expected, RTOL, "swapped output under a shuffled placement")
    dcp.save(sw.state_dict(), checkpoint_id=str(tmp_path / "swapped"))

    fresh = tf.build(tf.model_config(name, fp32_reference=True, **FLAVOR_SIZE[name]), seed=9)
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "swapped"))
    fresh.load_state_dict(sd, strict=True)
    for (k, a), (_, b) in zip(fresh.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), f"{k} differs after swapped -> original"

    # And back: the original's checkpoint into a swapped model with another placement.
    dcp.save(fresh.state_dict(), checkpoint_id=str(tmp_path / "original"))
    back = tf.build(tf.relibra_config(name, **FLAVOR_SIZE[name]), seed=11)
    _shuffle_placements(back, seed=1)
    sd = back.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "original"))
    back.load_state_dict(sd, strict=True)
    for (k, a), (_, b) in zip(back.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(a, b), f"{k} differs after original -> swapped"
    with torch.no_grad():
        tf.assert_close(back(x), expected, RTOL, "output after the round trip")


def test_hf_adapter_sees_the_original_keys():
    from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
    ref, sw = _pair("qwen3")
    _shuffle_placements(sw, seed=3)
    adapter = Qwen3StateDictAdapter(tf.model_config("qwen3", n_layers=2), None)
    hf_ref, hf_sw = adapter.to_hf(ref.state_dict()), adapter.to_hf(sw.state_dict())
    assert hf_ref.keys() == hf_sw.keys()
    for k in hf_ref:
        assert torch.equal(hf_ref[k], hf_sw[k]), k


def test_step_file_routing_slices_and_errors(tmp_path):
    from relibra_torch.replay import save_routing
    from integrations.torchtitan.trainer import micro_batch_routing_from_file, step_file

    M, P, B, S, N, K, E = 2, 2, 2, 4, 3, 2, 8
    samples = M * P * B
    ids = torch.stack([torch.stack([torch.arange(K) + (i * 3 + n) % (E - K) for n in range(N)])
                       for i in range(samples) for _ in range(S)])  # [samples*S, N, K], sample-coded
    path = step_file(str(tmp_path), 7)
    assert path.endswith("step_000007.safetensors")
    save_routing(path, ids, torch.arange(samples + 1) * S, E)
    for p in range(P):
        mbs = micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=p, batch=B,
                                            seq_len=S, num_layers=N)
        assert len(mbs) == M and all(t.shape == (B, S, N, K) for t in mbs)
        for m in range(M):
            for b in range(B):
                i = (m * P + p) * B + b
                assert torch.equal(mbs[m][b], ids[i * S:(i + 1) * S].long())
    with pytest.raises(ValueError, match="8 samples, expected .* = 16"):
        micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=0, batch=B + 2,
                                      seq_len=S, num_layers=N)
    with pytest.raises(ValueError, match="expected seq_len=2"):
        micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=0, batch=B,
                                      seq_len=2, num_layers=N)
    with pytest.raises(ValueError, match="the model has 2 MoE layers"):
        micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=0, batch=B,
                                      seq_len=S, num_layers=2)
    # a file recorded for another model: refused before any plan is made from it
    for field, value in (("num_experts", 16), ("top_k", 4)):
        with pytest.raises(ValueError, match=f"{field}={dict(num_experts=E, top_k=K)[field]}, but the model's MoE "
                                             f"layers have {field}={value}; the file was recorded for another model"):
            micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=0, batch=B, seq_len=S,
                                          num_layers=N, **{field: value})
    assert len(micro_batch_routing_from_file(path, micro_batches=M, dp_degree=P, dp_rank=0, batch=B, seq_len=S,
                                             num_layers=N, num_experts=E, top_k=K)) == M


def test_planner_options_and_synthetic_data():
    from relibra_torch.planning import ReLibraConfig
    from integrations.torchtitan.balancer import planner_kwargs_for
    from integrations.torchtitan.data import SyntheticDataLoader

    layer = relibra_moe_layers(tf.build(tf.relibra_config("deepseek_v3", n_layers=2, reorder=False,
                                                          planner_options={"max_swap_rounds": 3})))[0]
    kw = planner_kwargs_for(layer)
    assert kw == {"config": ReLibraConfig(reorder=False, max_swap_rounds=3)}
    layer.planner = "eplb"
    with pytest.raises(ValueError, match="reorder=False"):
        planner_kwargs_for(layer)

    cfg = SyntheticDataLoader.Config(vocab_size=50, num_moe_layers=2, num_experts=8, top_k=3, skew=2.0)
    a = iter(SyntheticDataLoader(cfg, dp_rank=1, seq_len=6, local_batch_size=2))
    b = iter(SyntheticDataLoader(cfg, dp_rank=1, seq_len=6, local_batch_size=2))
    (xa, ya), (xb, yb) = next(a), next(b)
    assert torch.equal(xa["input"], xb["input"]) and torch.equal(xa["routed_experts"], xb["routed_experts"])
    ids = xa["routed_experts"]
    assert ids.shape == (2, 6, 2, 3) and int(ids.min()) >= 0 and int(ids.max()) < 8
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all()  # K distinct experts per token
    assert torch.equal(xa["input"][:, 1:], ya[:, :-1])


def test_config_functions_activate_the_override():
    from torchtitan.config.override import apply_overrides
    from integrations.torchtitan.config_registry import relibra_qwen3_debugmodel_moe
    from integrations.torchtitan.example.config_registry import relibra_qwen3_cpu_small
    from integrations.torchtitan.trainer import RelibraTrainer

    for fn, source in ((relibra_qwen3_debugmodel_moe, "dataloader"), (relibra_qwen3_cpu_small, "files")):
        config = fn()
        assert isinstance(config, RelibraTrainer.Config) and config.relibra.source == source
        assert [e[0] for e in config.override.imports] == [OVERRIDE_TARGET]
        lines = apply_overrides(config.override, config)
        moes = [layer.moe for layer in config.model_spec.model.layers]
        assert len(lines) == len(moes) and all(isinstance(m, RelibraMoE.Config) for m in moes)


def test_routed_experts_hold_the_shared_engine():
    """torchtitan's routed experts hold relibra's engine and share the layer's code (no copy
    that could drift): the same ExpertEngine class, the same EngineHost methods and the same
    checkpoint hooks as ReplayBalancedMoE, and no inheritance from the layer."""
    from relibra_torch.moe import EngineHost, ExpertEngine, ReplayBalancedMoE

    layer = relibra_moe_layers(tf.build(tf.relibra_config("deepseek_v3", n_layers=2)))[0].routed_experts
    assert isinstance(layer.engine, ExpertEngine) and layer.topology.replica_slots == 1
    assert not isinstance(layer, ReplayBalancedMoE)
    for name in ("set_plan", "native_experts", "logical_expert_weights", "load_logical_expert_weights",
                 "_run_experts", "_register_logical_checkpoint"):
        assert getattr(type(layer), name) is getattr(ReplayBalancedMoE, name) is getattr(EngineHost, name)
    assert set(layer.expert_params()) == {"w1_EFD", "w2_EDF", "w3_EFD"}
    assert all(p is getattr(layer.inner_experts, n) for n, p in layer.expert_params().items())
