"""Offline data for demos and tests: synthetic tokens, optionally with skewed replayed routing.

Legend: B rows per micro-batch, S sequence length, N MoE layers, E experts, K top-k.

Real RL training feeds the rollout's tokens and ``routed_experts``; these stand-ins make
the integration runnable without datasets or a tokenizer download. The routing mimics RL
post-training: a few hot experts per layer that shift every ``shift_every`` micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.components.tokenizer import BaseTokenizer

__all__ = ["NullTokenizer", "SyntheticDataLoader", "skewed_routing"]


class NullTokenizer(BaseTokenizer):
    """A tokenizer that only knows its vocabulary size (synthetic token ids need no text)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        vocab_size: int = 2048

    def __init__(self, config: Config, tokenizer_path: str | None = None, **_: Any):
        super().__init__()
        self.vocab_size = config.vocab_size

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError("NullTokenizer has no text encoding (synthetic data only)")

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError("NullTokenizer has no text decoding (synthetic data only)")

    def get_vocab_size(self) -> int:
        return self.vocab_size


def skewed_routing(num_tokens: int, num_layers: int, num_experts: int, top_k: int, *, skew: float,
                   generator: torch.Generator, hot_logits_NE: torch.Tensor | None = None) -> torch.Tensor:
    """int64 ``[T, N, K]`` distinct expert ids per token, drawn with per-layer preferences.

    Expert ``e`` of layer ``n`` is chosen with probability growing with
    ``hot_logits_NE[n, e]`` (default: ``skew`` times standard normal draws): Gumbel top-k,
    so every token gets ``K`` distinct experts.
    """
    if hot_logits_NE is None:
        hot_logits_NE = torch.randn(num_layers, num_experts, generator=generator) * skew
    u = torch.rand(num_tokens, num_layers, num_experts, generator=generator).clamp(1e-9, 1 - 1e-9)
    keys = hot_logits_NE.unsqueeze(0) - torch.log(-torch.log(u))
    return keys.topk(top_k, dim=-1).indices


class SyntheticDataLoader(BaseDataLoader):
    """Deterministic random tokens per data-parallel rank, optionally with replayed routing.

    With ``num_moe_layers > 0`` every ``input_dict`` also holds ``routed_experts``
    (int64 ``[B, S, N, K]``) for :class:`~integrations.torchtitan.trainer.RelibraTrainer`
    with ``relibra.source="dataloader"``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 2048
        seed: int = 0
        num_moe_layers: int = 0
        num_experts: int = 0
        top_k: int = 0
        skew: float = 3.0
        """Spread of the per-layer expert preferences (0: uniform routing)."""
        shift_every: int = 1
        """Micro-batches between changes of the hot experts."""

    def __init__(self, config: Config, *, dp_world_size: int = 1, dp_rank: int = 0,
                 tokenizer: BaseTokenizer | None = None, seq_len: int = 16, local_batch_size: int = 1,
                 **_: Any):
        if config.num_moe_layers and (config.num_experts < 1 or not 1 <= config.top_k <= config.num_experts):
            raise ValueError(f"routing needs num_experts >= 1 and 1 <= top_k <= num_experts, got "
                             f"num_experts={config.num_experts}, top_k={config.top_k}")
        self.config = config
        self.dp_world_size, self.dp_rank = dp_world_size, dp_rank
        self.seq_len, self.batch = seq_len, local_batch_size
        self.position = 0

    def _micro_batch(self, index: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        c = self.config
        gen = torch.Generator().manual_seed(hash((c.seed, index, self.dp_rank)) % (2**63))
        x = torch.randint(0, c.vocab_size, (self.batch, self.seq_len + 1), generator=gen)
        input_dict = {"input": x[:, :-1].contiguous()}
        if c.num_moe_layers:
            # The same hot experts on every rank for a phase, as in one RL batch.
            phase = torch.Generator().manual_seed(hash((c.seed, index // c.shift_every)) % (2**63))
            hot = torch.randn(c.num_moe_layers, c.num_experts, generator=phase) * c.skew
            ids = skewed_routing(self.batch * self.seq_len, c.num_moe_layers, c.num_experts, c.top_k,
                                 skew=c.skew, generator=gen, hot_logits_NE=hot)
            input_dict["routed_experts"] = ids.view(self.batch, self.seq_len, c.num_moe_layers, c.top_k)
        return input_dict, x[:, 1:].contiguous()

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            item = self._micro_batch(self.position)
            self.position += 1
            yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.position = int(state_dict["position"])
