"""Building blocks shared by the decoders and drafters: the CPU-kernel Linear, RMSNorm and
the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import load as load_cpu_kernels
from shared.model.config import ModelConfig


class Linear(nn.Linear):
    """nn.Linear that, once packed for inference, multiplies through the CPU kernel's
    column-blocked weight (kernels/cpu/matmul.cpp)."""

    packed: torch.Tensor | None = None

    def pack(self, keep_weight: bool) -> None:
        """Inference only (the packed path has no autograd). fp32 on CPU, where it is measured."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        kernel = load_cpu_kernels()
        if kernel is None:
            return
        self.packed = kernel.block_weight(weight.detach())
        if not keep_weight:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        bias = torch.empty(0) if self.bias is None else self.bias
        rows = x.reshape(-1, self.in_features).contiguous()
        y = load_cpu_kernels().blocked_linear(rows, self.packed, self.out_features, bias, None)
        return y.view(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> None:
    """Pack every Linear of an inference-only model. LM heads keep their plain weight too:
    a tied embedding shares it, and token maps select rows of it."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.packed is None:
            module.pack(keep_weight=name.endswith("lm_head"))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias, size = cfg.mlp_bias, intermediate_size or cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * size, bias=bias)
        self.down_proj = Linear(size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
