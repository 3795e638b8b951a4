"""A minimal MoE layer that follows the recorder protocol (``last_expert_ids_TK``).

Used by the recorder tests to check the recorder itself independently of
``ReplayBalancedMoE``. Shape legend: T tokens, D dim, E experts, K top-k.
"""

import torch
from torch import nn


class ProtocolMoE(nn.Module):
    """Softmax router + per-expert linear maps; routes with ``routed_experts`` when given."""

    def __init__(self, dim: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_EDD = nn.Parameter(torch.randn(num_experts, dim, dim) / dim**0.5)
        self.last_expert_ids_TK = None

    def forward(self, x, routed_experts=None):
        x_TD = x.reshape(-1, x.shape[-1])
        scores_TE = torch.softmax(self.router(x_TD), dim=-1)
        ids_TK = torch.topk(scores_TE, self.top_k, dim=-1).indices if routed_experts is None else routed_experts.long()
        self.last_expert_ids_TK = ids_TK
        gates_TK = scores_TE.gather(1, ids_TK)
        y_TKD = torch.einsum("td,tkde->tke", x_TD, self.w_EDD[ids_TK])
        return (gates_TK[..., None] * y_TKD).sum(1).reshape(x.shape)


class TwoLayer(nn.Module):
    def __init__(self, dim=8, num_experts=6, top_k=2):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.moes = nn.ModuleList([ProtocolMoE(dim, num_experts, top_k) for _ in range(2)])

    def forward(self, x, routed_experts_TLK=None):
        x = self.inp(x)
        for l, m in enumerate(self.moes):
            x = x + m(x, None if routed_experts_TLK is None else routed_experts_TLK[:, l])
        return x
