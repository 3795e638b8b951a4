"""RoutingRecorder: assembly of interleaved forwards into per-sequence samples, errors, files,
the torchtitan router integration.

Uses a protocol-only MoE layer (tests/_recorder_fakes.py); the end-to-end fidelity tests
with ReplayBalancedMoE and the tiny LM are in test_recorder_fidelity.py.
Shape legend: T tokens, L layers, K top-k, E experts, D dim, B batch, S sequence length.
Budget: ~10 s (most of it importing torchtitan once).
"""

from __future__ import annotations

import random

import pytest
import torch
from _recorder_fakes import ProtocolMoE, TwoLayer
from hypothesis import given, settings
from hypothesis import strategies as st

from relibra_torch.rollout.recorder import RoutingRecorder, find_moe_layers, layout_for_batch
from relibra_torch.replay.routing import load_routing

D, E, K = 8, 6, 2


def run_schedule(model, forwards, seed=0):
    """Run ``forwards`` (list of (sample_T, position_T)) through ``model`` while recording;
    return the recorder and the ground truth {(sample, pos): ids_LK} kept independently."""
    gen = torch.Generator().manual_seed(seed)
    truth = {}
    with RoutingRecorder(model) as rec:
        for sample, pos in forwards:
            rec.next_forward(sample, pos)
            model(torch.randn(len(sample), D, generator=gen))
            ids_TLK = torch.stack([m.last_expert_ids_TK for m in model.moes], dim=1)
            for t, (s, p) in enumerate(zip(sample, pos)):
                if s >= 0:
                    truth[(s, p)] = ids_TLK[t].clone()
    return rec, truth


def random_schedule(lengths, rng: random.Random, pad_prob=0.2):
    """Prefill a random prefix of each sequence, then feed the rest in random chunks, many
    sequences per forward, interleaved, with padding tokens mixed in."""
    next_pos = [0] * len(lengths)
    forwards = []
    while any(n < L for n, L in zip(next_pos, lengths)):
        sample, pos = [], []
        for s in rng.sample(range(len(lengths)), len(lengths)):
            if next_pos[s] >= lengths[s] or rng.random() < 0.3:
                continue
            take = rng.randint(1, lengths[s] - next_pos[s])
            for _ in range(take):
                if rng.random() < pad_prob:
                    sample.append(-1)
                    pos.append(rng.randint(-5, 5))  # ignored
                sample.append(s)
                pos.append(next_pos[s])
                next_pos[s] += 1
        if sample:
            forwards.append((sample, pos))
    return forwards


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 7), min_size=1, max_size=5), seed=st.integers(0, 10**6))
def test_interleaved_forwards_assemble_per_sequence(lengths, seed):
    torch.manual_seed(0)
    model = TwoLayer(D, E, K)
    rec, truth = run_schedule(model, random_schedule(lengths, random.Random(seed)), seed)
    replay = rec.replay(sample_lengths=lengths)
    assert replay.num_samples == len(lengths)
    assert replay.sample_lengths.tolist() == lengths
    assert (replay.num_layers, replay.top_k, replay.num_experts) == (2, K, E)
    for s, n in enumerate(lengths):
        expected = torch.stack([truth[(s, p)] for p in range(n)])
        assert torch.equal(replay.sample(s).long(), expected)


def test_kv_cache_style_decoding_matches_truth_and_order_within_topk():
    # Prefill 3 prompts of different lengths in one forward, then 1 token per sequence per
    # step, sequences finishing at different steps.
    torch.manual_seed(1)
    model = TwoLayer(D, E, K)
    prompt, total = [3, 1, 4], [6, 2, 9]
    forwards = [([s for s in range(3) for _ in range(prompt[s])], [p for s in range(3) for p in range(prompt[s])])]
    cur = list(prompt)
    while any(c < t for c, t in zip(cur, total)):
        live = [s for s in range(3) if cur[s] < total[s]]
        forwards.append((live, [cur[s] for s in live]))
        for s in live:
            cur[s] += 1
    rec, truth = run_schedule(model, forwards)
    ids, offsets = rec.routed_experts()
    assert offsets.tolist() == [0, 6, 8, 17]
    for s in range(3):
        for p in range(total[s]):
            # The ids keep the layer's order inside the top-k (not sorted).
            assert torch.equal(ids[offsets[s] + p], truth[(s, p)])


def test_save_round_trip(tmp_path):
    torch.manual_seed(2)
    model = TwoLayer(D, E, K)
    rec, _ = run_schedule(model, [([0, 0, 1], [0, 1, 0]), ([1, 0], [1, 2])])
    path = tmp_path / "rollout.safetensors"
    replay = rec.save(path, [3, 2], sample_step=[4, 4], sample_task=[0, 1])
    loaded = load_routing(path)
    assert torch.equal(loaded.routed_experts_TLK.long(), replay.routed_experts_TLK.long())
    assert loaded.sample_offsets.tolist() == [0, 3, 5]
    assert loaded.sample_step.tolist() == [4, 4] and loaded.sample_task.tolist() == [0, 1]


def test_replayed_forward_reports_the_replayed_ids():
    # During training with replay the layer reports the ids it was given, so recording the
    # training forward proves which experts were used.
    torch.manual_seed(3)
    model = TwoLayer(D, E, K)
    x = torch.randn(5, D)
    forced = torch.tensor([[[0, 1], [2, 3]], [[5, 4], [1, 0]], [[3, 2], [0, 5]], [[1, 2], [3, 4]], [[4, 0], [5, 1]]])
    with RoutingRecorder(model) as rec:
        rec.next_forward([0] * 5, range(5))
        model(x, routed_experts_TLK=forced)
    assert torch.equal(rec.replay().sample(0).long(), forced)


def test_find_layers_order_nesting_and_explicit_layers():
    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = ProtocolMoE(D, E, K)
            self.a.inner = ProtocolMoE(D, E, K)  # nested: not a second layer
            self.b = ProtocolMoE(D, E, K)

    m = Outer()
    assert [r.name for r in find_moe_layers(m)] == ["a", "b"]
    rec = RoutingRecorder(layers=[m.b, m.a])
    assert [r.module for r in rec.layers] == [m.b, m.a]
    with pytest.raises(TypeError, match=r"layers\[0\] is Linear"):
        RoutingRecorder(layers=[torch.nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="no MoE layers"):
        RoutingRecorder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="exactly one of model and layers"):
        RoutingRecorder()


def test_num_experts_must_be_known():
    m = ProtocolMoE(D, E, K)
    del m.num_experts
    with pytest.raises(ValueError, match="cannot tell num_experts"):
        RoutingRecorder(layers=[m])
    assert RoutingRecorder(layers=[m], num_experts=E).num_experts == E


def test_hooks_are_removed_on_exit():
    model = TwoLayer(D, E, K)
    with RoutingRecorder(model) as rec:
        rec.next_forward([0], [0])
        model(torch.randn(1, D))
    model(torch.randn(4, D))  # no layout declared, but the hooks are gone: no error, no record
    assert rec.num_recorded_tokens == 1
    assert all(not m._forward_hooks for m in model.moes)


@pytest.mark.parametrize(
    "forwards, lengths, exc, pattern",
    [
        ([([0, 0], [0, 2])], None, ValueError, "sequence 0 is missing position 1"),
        ([([0, 0], [0, 1]), ([0], [1])], None, ValueError, "sequence 0 position 1 was recorded twice"),
        ([([1], [0])], None, ValueError, "sequence 0 has no recorded tokens"),
        ([([0, 0], [0, 1])], [3], ValueError, r"sequence 0 has 2 recorded tokens but sample_lengths\[0\] = 3"),
        ([([0, 1], [0, 0])], [2], ValueError, "sequence 1 was recorded but sample_lengths has 1"),
        ([([-1], [0])], None, ValueError, "only padding tokens"),
    ],
)
def test_assembly_errors(forwards, lengths, exc, pattern):
    model = TwoLayer(D, E, K)
    rec, _ = run_schedule(model, forwards)
    with pytest.raises(exc, match=pattern):
        rec.replay(lengths)


def test_protocol_errors():
    model = TwoLayer(D, E, K)
    with RoutingRecorder(model) as rec:
        with pytest.raises(RuntimeError, match="no token layout was declared"):
            model(torch.randn(2, D))
    with RoutingRecorder(model) as rec:
        rec.next_forward([0, 0, 0], [0, 1, 2])
        with pytest.raises(ValueError, match="routed 2 tokens but next_forward declared 3"):
            model(torch.randn(2, D))
    with RoutingRecorder(model) as rec:
        rec.next_forward([0, 0], [0, 1])
        model.moes[0](torch.randn(2, D))
        with pytest.raises(ValueError, match=r"MoE layers \['moes.1'\] did not run"):
            rec.next_forward([0], [2])
    with RoutingRecorder(model) as rec:
        rec.next_forward([0, 0], [0, 1])
        model.moes[0](torch.randn(2, D))
        with pytest.raises(ValueError, match="ran twice for one declared forward"):
            model.moes[0](torch.randn(2, D))
        rec.reset()
    rec = RoutingRecorder(model)
    with pytest.raises(ValueError, match="position_T contains -1"):
        rec.next_forward([0], [-1])
    with pytest.raises(ValueError, match="sample_T contains -2"):
        rec.next_forward([-2], [0])
    with pytest.raises(ValueError, match="sample_T has 2 tokens but position_T has 1"):
        rec.next_forward([0, 0], [0])
    with pytest.raises(ValueError, match="sample_T has dtype torch.float32"):
        rec.next_forward(torch.zeros(1), [0])
    with pytest.raises(ValueError, match="nothing was recorded"):
        rec.replay()


def test_layout_for_batch():
    s, p = layout_for_batch([2, 0], [3, 0], 2)
    assert s.tolist() == [2, 2, 0, 0] and p.tolist() == [3, 4, 0, 1]


def _titan_moe_config():
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import GroupedExperts, MoE, RoutedExperts, TokenChoiceTopKRouter
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    return MoE.Config(
        num_experts=E,
        routed_experts=RoutedExperts.Config(
            inner_experts=GroupedExperts.Config(dim=D, hidden_dim=16, num_experts=E),
            token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
        ),
        router=TokenChoiceTopKRouter.Config(num_experts=E, gate=Linear.Config(in_features=D, out_features=E),
                                            top_k=K, score_func="softmax"),
        load_balance_coeff=None,
    )


class _TitanToy(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.layers = torch.nn.ModuleList([make(), make()])

    def forward(self, x_BSD):
        ins = []
        for layer in self.layers:
            ins.append(x_BSD)
            x_BSD = x_BSD + layer(x_BSD)
        return x_BSD, ins


def test_torchtitan_moe_layers():
    import warnings

    torch.manual_seed(4)
    model = _TitanToy(lambda: _titan_moe_config().build())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    refs = find_moe_layers(model)
    assert [(r.name, r.kind) for r in refs] == [("layers.0", "torchtitan"), ("layers.1", "torchtitan")]
    x1, x2 = torch.randn(2, 3, D), torch.randn(2, 1, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchtitan's CPU autocast notice
        with RoutingRecorder(model) as rec:
            rec.next_forward(*layout_for_batch([0, 1], [0, 0], 3))  # prefill [B=2, S=3]
            _, ins1 = model(x1)
            rec.next_forward(*layout_for_batch([0, 1], [3, 3], 1))  # one decoding step
            _, ins2 = model(x2)
        # Independent truth: each layer's router on the input that layer saw.
        expected = []
        for ins in (ins1, ins2):
            per_layer = [model.layers[l].router(ins[l])[1].reshape(-1, K) for l in range(2)]
            expected.append(torch.stack(per_layer, dim=1))  # [B*S, L, K]
    replay = rec.replay([4, 4])
    e1 = expected[0].view(2, 3, 2, K)
    e2 = expected[1].view(2, 1, 2, K)
    for b in range(2):
        assert torch.equal(replay.sample(b).long(), torch.cat([e1[b], e2[b]]))


def test_torchtitan_relibra_moe_records_replayed_ids():
    # integrations.torchtitan.RelibraMoE replays without calling router.forward: the
    # recorder must still see the ids the experts ran with.
    from integrations.torchtitan import RelibraMoE, relibra_moe_config

    torch.manual_seed(5)
    model = _TitanToy(lambda: relibra_moe_config(_titan_moe_config(), expert_dtype=None).build())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    assert all(isinstance(m, RelibraMoE) for m in model.layers)
    assert [r.kind for r in find_moe_layers(model)] == ["torchtitan", "torchtitan"]
    gen = torch.Generator().manual_seed(0)
    forced_BSLK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(2 * 3 * 2)]).view(2, 3, 2, K)
    for l, layer in enumerate(model.layers):
        layer.set_replay(forced_BSLK[:, :, l])
    with RoutingRecorder(model) as rec:
        rec.next_forward(*layout_for_batch([0, 1], [0, 0], 3))
        model(torch.randn(2, 3, D))
    replay = rec.replay([3, 3])
    for b in range(2):
        assert torch.equal(replay.sample(b).long(), forced_BSLK[b])
