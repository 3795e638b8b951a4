"""Replay fidelity end to end with ReplayBalancedMoE and the tiny LM (examples/tiny_lm.py).

* A rollout (batched generation with a KV cache, prompts of different lengths, sequences
  ending at different steps, with and without exploration) is recorded; the trainer's
  forward over whole packed sequences with the replayed ids reproduces the rollout's
  log-probabilities of the generated tokens (fp32, atol 1e-5) and uses exactly the recorded
  experts (recorded again during the training forward).
* Without replay, after a weight update, the router picks other experts for a share of
  the tokens (measured): replay is what keeps routing fixed.

Shape legend: T tokens, L layers, K top-k, E experts, N sequences.
Budget: ~10 s.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import tiny_lm  # noqa: E402

from relibra_torch.rollout.explore import ExplorationConfig, ExplorationPolicy  # noqa: E402
from relibra_torch.rollout.recorder import RoutingRecorder  # noqa: E402
from relibra_torch.replay.routing import load_routing  # noqa: E402

TOK = tiny_lm.Tokenizer()
ATOL_FP32 = 1e-5  # log-probabilities, fp32: packed vs cached attention differ in summation order only


def make_model(seed: int) -> tiny_lm.TinyMoELM:
    torch.manual_seed(seed)
    cfg = tiny_lm.TinyLMConfig(vocab_size=TOK.vocab_size, num_experts=8, top_k=2, n_layers=2)
    model = tiny_lm.TinyMoELM(cfg, init_std=0.3)
    # Larger weights than a real init so that routing and sampling are far from uniform.
    for name, p in model.named_parameters():
        if ".moe." not in name and p.dim() > 1:
            torch.nn.init.normal_(p, std=0.3)
    return model.eval()


def random_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [TOK.encode("".join(rng.choice(TOK.chars) for _ in range(rng.randint(1, 7)))) for _ in range(n)]


def rollout(model, prompts, seed, explore=False):
    policy = ExplorationPolicy(ExplorationConfig(enabled=True, sigma_min=0.5, sigma_max=2.0, seed=seed)) if explore else None
    with RoutingRecorder(model, model_name="tiny-moe") as rec:
        out = tiny_lm.generate(model, prompts, 8, eos=TOK.eos, generator=torch.Generator().manual_seed(seed),
                               routing_policy=policy, recorder=rec)
    return out, rec.replay(out.lengths)


def train_forward(model, sequences, prompt_lens, routed=None):
    """Trainer forward over packed whole sequences; returns log-probs and the ids it used."""
    tokens, sample, pos = tiny_lm.packed(sequences)
    with RoutingRecorder(model) as rec:
        rec.next_forward(sample, pos)
        logps = tiny_lm.sequence_logprobs(model, sequences, prompt_lens, routed_experts_TLK=routed)
    return logps, rec.replay([len(s) for s in sequences]).routed_experts_TLK.long()


@pytest.mark.parametrize("explore", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_reproduces_rollout_logprobs_and_experts(seed, explore, tmp_path):
    model = make_model(seed)
    prompts = random_prompts(6, seed)
    out, replay = rollout(model, prompts, seed, explore)
    assert replay.sample_lengths.tolist() == out.lengths  # prompt + response, every token
    assert len(set(out.lengths)) > 1 and sum(len(r) for r in out.responses()) > 6
    # Through a file, as the trainer would read it.
    path = tmp_path / "rollout.routing.safetensors"
    replay.save(path)
    replay = load_routing(path)
    assert replay.model == "tiny-moe" and replay.num_experts == 8 and replay.top_k == 2

    # Micro-batches in another order than the rollout's: select() keeps offsets right.
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    for part in (order[:3], order[3:]):
        seqs = [out.sequences[n] for n in part]
        plens = [out.prompt_lens[n] for n in part]
        routed = replay.select(part).routed_experts_TLK.long()
        logps, used = train_forward(model, seqs, plens, routed)
        assert torch.equal(used, routed)  # exactly the recorded experts
        for n, lp in zip(part, logps):
            torch.testing.assert_close(lp, out.logprobs[n], atol=ATOL_FP32, rtol=0)

    if explore:
        # Exploration changed the path: the router alone would choose differently, and
        # without replay the log-probabilities are not the rollout's.
        seqs, plens = out.sequences, out.prompt_lens
        logps_free, used_free = train_forward(model, seqs, plens)
        all_routed = replay.routed_experts_TLK.long()
        differs = (used_free.sort(-1).values != all_routed.sort(-1).values).any(-1).float().mean().item()
        assert differs > 0.1, differs
        gap = max((a - b).abs().max().item() for a, b in zip(logps_free, out.logprobs))
        assert gap > 1e-3, gap


def test_without_replay_routing_drifts_after_an_update():
    seed = 5
    model = make_model(seed)
    prompts = random_prompts(8, seed)
    out, replay = rollout(model, prompts, seed)
    routed = replay.routed_experts_TLK.long()
    # Before any update, the trainer's own router agrees with the rollout (no exploration).
    _, used_free = train_forward(model, out.sequences, out.prompt_lens)
    assert torch.equal(used_free, routed)

    # One RL-style update (raise the log-probability of the sampled tokens).
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    logps = tiny_lm.sequence_logprobs(model, out.sequences, out.prompt_lens, routed_experts_TLK=routed)
    (-torch.cat(logps).mean()).backward()
    opt.step()

    with torch.no_grad():
        _, used_free = train_forward(model, out.sequences, out.prompt_lens)
        _, used_replay = train_forward(model, out.sequences, out.prompt_lens, routed)
    differs = (used_free.sort(-1).values != routed.sort(-1).values).any(-1).float().mean().item()
    assert differs > 0.05, f"only {differs:.1%} of (token, layer) routes changed"
    assert torch.equal(used_replay, routed)


def test_exploration_ids_get_gates_from_unperturbed_scores():
    """The explored path goes in as ``routed_experts``; the layer weights the chosen experts
    with the live (unperturbed) router scores."""
    model = make_model(3)
    moe = model.blocks[0].moe
    gen = torch.Generator().manual_seed(0)
    x_TD = torch.randn(20, moe.dim, generator=gen)
    scores_TE = tiny_lm.moe_router_scores(moe, x_TD)
    ids_TK = ExplorationPolicy(ExplorationConfig(enabled=True, sigma_min=2.0, sigma_max=2.0))(scores_TE, moe.top_k)
    assert not torch.equal(ids_TK.sort(-1).values, scores_TE.topk(moe.top_k).indices.sort(-1).values)
    with torch.no_grad():
        y_TD = moe(x_TD, routed_experts=ids_TK)
        w = moe.local_expert_weights()  # one process: all experts, logical order
        ref = torch.zeros_like(x_TD)
        for k in range(moe.top_k):
            e = ids_TK[:, k]
            h = torch.nn.functional.silu(torch.einsum("td,tfd->tf", x_TD, w["w1_EFD"][e]))
            h = h * torch.einsum("td,tfd->tf", x_TD, w["w3_EFD"][e])
            ref += scores_TE.gather(1, ids_TK[:, k : k + 1]) * torch.einsum("tf,tdf->td", h, w["w2_EDF"][e])
    torch.testing.assert_close(y_TD, ref, atol=1e-6, rtol=1e-5)
