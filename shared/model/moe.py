"""Top-k routed SwiGLU experts (Qwen3-MoE's sparse MLP) over the flat token layout [T],
plus, where the family has one (Qwen3-Next), a shared expert every row passes through,
scaled by sigmoid(shared_expert_gate(x)).

Each row picks its `top_k` experts by router softmax; the (row, expert) assignments are
sorted by expert so that every expert multiplies all of its rows in one matmul (a loop
over the experts hit, never over tokens), and the weighted outputs are added back per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.layers import MLP
from torch import nn


class Experts(nn.Module):
    """The experts' SwiGLU weights stacked as transformers stores them: `gate_up_proj`
    [E, 2I, H] (gate rows, then up rows) and `down_proj` [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` on its rows x [N, H] -> [N, H]."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down_proj[e])


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None, "MoE layer of a config without experts"
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.experts = Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(cfg, moe.shared_expert_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k]): the k most probable
        experts under softmax(router(x)) (fp32), renormalised to sum 1 if norm_topk_prob."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> sum over each row's experts of weight * expert(x) [T, H]."""
        weights, experts = self.route(x)
        flat = experts.flatten()  # [T*k] assignment i: row i // k
        order = flat.argsort(stable=True)  # assignments grouped by expert, ascending
        counts = torch.bincount(flat, minlength=len(self.experts.gate_up_proj)).tolist()
        rows, row_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = rows[start : start + n]
            y = self.experts.expert(e, x[idx]) * row_weights[start : start + n, None]
            out.index_add_(0, idx, y)
            start += n
        if self.shared_expert is not None:
            out += torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
