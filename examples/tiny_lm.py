"""A tiny MoE language model with a KV cache, a toy arithmetic task, and batched generation.

Used by ``examples/grpo_toy.py`` and by the recorder tests. Everything runs on CPU in fp32.

* :class:`Tokenizer`: digits, ``+ - =``, ``<bos>``, ``<eos>``.
* :class:`TinyMoELM`: token + learned position embedding, ``n_layers`` blocks of (causal
  self-attention with a KV cache, MoE feed-forward), LM head. The model consumes *packed*
  tokens: a flat list of tokens with the sequence id and position of each, so a prefill of
  prompts of different lengths and a decoding step over the sequences still running are the
  same call, no padding goes through the MoE layers, and the MoE layers see exactly the
  tokens the routing recorder is told about. Attention masks keys of other sequences and
  later positions.
* :func:`generate`: batched sampling with a KV cache, optional routing policy (exploration)
  and :class:`~relibra_torch.rollout.recorder.RoutingRecorder`; returns the sequences and the
  log-probabilities of the sampled tokens.
* :func:`sequence_logprobs`: the trainer's forward over whole sequences (optionally with
  replayed routing), giving the same log-probabilities.

Shape legend:
  T  packed tokens of one forward     C  cached tokens (keys/values)     D  model dim
  H  heads      Dh  head dim      V  vocabulary      L  MoE layers     K  top-k     E  experts
  N  sequences
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

# ---------------------------------------------------------------------------- tokenizer


class Tokenizer:
    """Characters ``0-9 + - =`` plus ``<bos>`` and ``<eos>``."""

    chars = "0123456789+-="

    def __init__(self):
        self.itos = list(self.chars) + ["<bos>", "<eos>"]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.bos = self.stoi["<bos>"]
        self.eos = self.stoi["<eos>"]

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        bad = [c for c in text if c not in self.stoi]
        if bad:
            raise ValueError(f"text {text!r} has character {bad[0]!r}; allowed: {self.chars!r}")
        return ([self.bos] if bos else []) + [self.stoi[c] for c in text]

    def decode(self, ids) -> str:
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos:
                break
            if i != self.bos:
                out.append(self.itos[i])
        return "".join(out)


@dataclass(frozen=True)
class AdditionTask:
    """Prompts ``a+b=`` (or ``a-b=`` with ``a >= b``); the verifiable answer is the result.

    ``max_operand`` bounds ``a`` and ``b``; prompt lengths vary with the number of digits.
    """

    max_operand: int = 9
    ops: str = "+"

    def sample(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        op = rng.choice(self.ops)
        if op == "-":
            a, b = max(a, b), min(a, b)
            return f"{a}-{b}=", str(a - b)
        return f"{a}+{b}=", str(a + b)

    def reward(self, answer: str, completion: str) -> float:
        """1 for the exact answer (the completion up to ``<eos>``), else 0."""
        return float(completion == answer)


# ---------------------------------------------------------------------------- model


@dataclass(frozen=True)
class TinyLMConfig:
    vocab_size: int = 15
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    hidden_dim: int = 32
    num_experts: int = 8
    top_k: int = 2
    max_len: int = 24


@dataclass
class KVCache:
    """Keys/values of every token fed so far, packed like the tokens (one entry per layer)."""

    n_layers: int
    k_CHDh: list = field(default_factory=list)
    v_CHDh: list = field(default_factory=list)
    sample_C: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    pos_C: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    def __post_init__(self):
        if not self.k_CHDh:
            self.k_CHDh = [None] * self.n_layers
            self.v_CHDh = [None] * self.n_layers


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x_TD, sample_T, pos_T, cache: KVCache | None, layer: int, key_sample_C, key_pos_C):
        T, D = x_TD.shape
        H = self.n_heads
        q, k, v = self.qkv(x_TD).view(T, 3, H, D // H).unbind(1)
        if cache is not None:
            if cache.k_CHDh[layer] is not None:
                k = torch.cat([cache.k_CHDh[layer], k])
                v = torch.cat([cache.v_CHDh[layer], v])
            cache.k_CHDh[layer], cache.v_CHDh[layer] = k, v
        # Packed sequences: a query sees keys of its own sequence at positions <= its own.
        mask_TC = (key_sample_C[None, :] == sample_T[:, None]) & (key_pos_C[None, :] <= pos_T[:, None])
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask_TC)
        return self.out(o.transpose(0, 1).reshape(T, D))


def make_moe(cfg: TinyLMConfig, **kwargs) -> nn.Module:
    """The model's MoE layer: :class:`relibra_torch.moe.ReplayBalancedMoE`."""
    from relibra_torch.moe import ReplayBalancedMoE

    return ReplayBalancedMoE(cfg.dim, cfg.hidden_dim, cfg.num_experts, cfg.top_k, **kwargs)


def moe_router_scores(moe: nn.Module, x_TD: torch.Tensor) -> torch.Tensor:
    """Live router scores ``[T, E]`` of ``moe`` for tokens ``x_TD``: the scores its gates use."""
    return moe.router_scores(x_TD)


class Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig, moe_kwargs: dict):
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.n_heads)
        self.norm2 = nn.RMSNorm(cfg.dim)
        self.moe = make_moe(cfg, **moe_kwargs)

    def forward(self, x_TD, sample_T, pos_T, cache, layer, key_sample_C, key_pos_C, routed_TK, policy):
        x_TD = x_TD + self.attn(self.norm1(x_TD), sample_T, pos_T, cache, layer, key_sample_C, key_pos_C)
        h_TD = self.norm2(x_TD)
        if routed_TK is None and policy is not None:
            # Exploration: the policy picks the experts from the live scores; the layer then
            # computes the gate weights of those experts from the same unperturbed scores.
            routed_TK = policy(moe_router_scores(self.moe, h_TD).detach(), self.moe.top_k)
        return x_TD + self.moe(h_TD, routed_experts=routed_TK)


class TinyMoELM(nn.Module):
    """Embedding, ``n_layers`` x (attention + MoE), RMSNorm, LM head. Packed-token forward."""

    def __init__(self, cfg: TinyLMConfig, **moe_kwargs):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg, moe_kwargs) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def new_cache(self) -> KVCache:
        return KVCache(self.cfg.n_layers)

    def forward(self, tokens_T, sample_T, pos_T, *, cache: KVCache | None = None,
                routed_experts_TLK: torch.Tensor | None = None, routing_policy=None) -> torch.Tensor:
        """Logits ``[T, V]`` for packed tokens.

        Args:
            tokens_T, sample_T, pos_T: int64 ``[T]``: token, sequence id, position.
            cache: if given, keys/values of earlier tokens (appended to in place).
            routed_experts_TLK: replayed expert ids ``[T, L, K]`` (training with replay).
            routing_policy: ``policy(scores_TE, top_k) -> ids_TK`` used when not replaying
                (e.g. :class:`~relibra_torch.rollout.explore.ExplorationPolicy`).
        """
        if int(pos_T.max()) >= self.cfg.max_len:
            raise ValueError(f"position {int(pos_T.max())} >= max_len = {self.cfg.max_len}")
        x_TD = self.tok_emb(tokens_T) + self.pos_emb(pos_T)
        if cache is not None:
            key_sample_C = torch.cat([cache.sample_C, sample_T])
            key_pos_C = torch.cat([cache.pos_C, pos_T])
            cache.sample_C, cache.pos_C = key_sample_C, key_pos_C
        else:
            key_sample_C, key_pos_C = sample_T, pos_T
        for layer, block in enumerate(self.blocks):
            routed_TK = None if routed_experts_TLK is None else routed_experts_TLK[:, layer]
            x_TD = block(x_TD, sample_T, pos_T, cache, layer, key_sample_C, key_pos_C, routed_TK, routing_policy)
        return self.head(self.norm(x_TD))


# ---------------------------------------------------------------------------- rollout


@dataclass
class Rollout:
    """Generated sequences: ``sequences[n]`` = prompt + response token ids,
    ``prompt_lens[n]``, and ``logprobs[n]`` (fp32 ``[len(response)]``) of the sampled tokens."""

    sequences: list[list[int]]
    prompt_lens: list[int]
    logprobs: list[torch.Tensor]

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.sequences]

    def responses(self) -> list[list[int]]:
        return [s[p:] for s, p in zip(self.sequences, self.prompt_lens)]


def packed(sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tokens_T, sample_T, pos_T)`` of whole sequences packed one after the other."""
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    sample = torch.tensor([n for n, s in enumerate(sequences) for _ in s], dtype=torch.int64)
    pos = torch.tensor([i for s in sequences for i in range(len(s))], dtype=torch.int64)
    return tokens, sample, pos


@torch.no_grad()
def generate(model: TinyMoELM, prompts: list[list[int]], max_new_tokens: int, *, eos: int,
             generator: torch.Generator, routing_policy=None, recorder=None, greedy: bool = False) -> Rollout:
    """Sample responses for ``prompts`` with a KV cache (temperature 1, or greedy).

    Step 0 prefills all prompts packed; each later step feeds the last token of every
    sequence whose last token has not been fed yet. A sequence stops after ``<eos>`` or
    ``max_new_tokens`` tokens, and its final token is still fed once, so the routing of
    every token of ``prompt + response`` is recorded (the trainer runs all of them).
    ``recorder`` (a :class:`RoutingRecorder` already entered) is told the layout of every
    forward; sequence ids are prompt indices.
    """
    seqs = [list(p) for p in prompts]
    prompt_lens = [len(p) for p in prompts]
    logprobs: list[list[float]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    cache = model.new_cache()
    tokens, sample, pos = packed(seqs)
    while tokens.numel():
        if recorder is not None:
            recorder.next_forward(sample, pos)
        logits_TV = model(tokens, sample, pos, cache=cache, routing_policy=routing_policy)
        # The last fed token of each sequence predicts its next token.
        last = torch.ones_like(sample, dtype=torch.bool)
        last[:-1] = sample[1:] != sample[:-1]
        feed = []
        for t in last.nonzero()[:, 0].tolist():
            n = int(sample[t])
            if done[n]:
                continue
            logp_V = torch.log_softmax(logits_TV[t].float(), dim=-1)
            if greedy:
                tok = int(logp_V.argmax())
            else:
                tok = int(torch.multinomial(logp_V.exp(), 1, generator=generator))
            seqs[n].append(tok)
            logprobs[n].append(float(logp_V[tok]))
            if tok == eos or len(seqs[n]) - prompt_lens[n] >= max_new_tokens:
                done[n] = True
            feed.append(n)  # the new token is fed next step (also when it ends the sequence)
        tokens = torch.tensor([seqs[n][-1] for n in feed], dtype=torch.int64)
        sample = torch.tensor(feed, dtype=torch.int64)
        pos = torch.tensor([len(seqs[n]) - 1 for n in feed], dtype=torch.int64)
    return Rollout(seqs, prompt_lens, [torch.tensor(lp, dtype=torch.float32) for lp in logprobs])


def sequence_logprobs(model: TinyMoELM, sequences: list[list[int]], prompt_lens: list[int], *,
                      routed_experts_TLK: torch.Tensor | None = None, routing_policy=None) -> list[torch.Tensor]:
    """The trainer's forward: log-probabilities ``[len(response)]`` of each response token.

    All sequences are packed into one forward (no cache). ``routed_experts_TLK`` is the
    replay for these sequences in the same order (``RoutingReplay.select(...).routed_experts_TLK``).
    Differentiable when called with grad enabled.
    """
    tokens, sample, pos = packed(sequences)
    logits_TV = model(tokens, sample, pos, routed_experts_TLK=routed_experts_TLK, routing_policy=routing_policy)
    logp_TV = torch.log_softmax(logits_TV.float(), dim=-1)
    out, start = [], 0
    for s, p in zip(sequences, prompt_lens):
        n = len(s)
        # Token i (i >= p) is predicted by the logits at i - 1.
        idx = torch.arange(start + p - 1, start + n - 1)
        out.append(logp_TV[idx, torch.tensor(s[p:], dtype=torch.int64)])
        start += n
    return out
