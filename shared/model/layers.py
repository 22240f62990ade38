"""Building blocks shared by the decoders and drafters: the CPU-kernel Linear, RMSNorm and
the SwiGLU MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.fp8 import fp8_linear
from torch import nn


class Linear(nn.Linear):
    """nn.Linear that, once packed for inference, multiplies through the CPU kernels: its
    weight in column blocks (kernels/cpu/matmul.cpp) or, given quantized blocks in GGUF's
    layout (`quant_blocks`: a GGUF's own, or made at load by shared/model/quantize.py),
    those blocks, never expanded (kernels/cpu/quant.cpp). With `weight_scale` its weight is
    fp8 (shared/model/fp8.py)."""

    packed: torch.Tensor | None = None
    block_type = 0  # of `packed`: 0 for fp32 column blocks, else a GGML block type
    # (uint8 [out_features, row bytes] in GGUF's block layout, GGML block type): set by
    # the loader to multiply these instead of the weight
    quant_blocks: tuple[torch.Tensor, int] | None = None
    # fp32 [out_features]: the weight is float8_e4m3fn, row n scaled by weight_scale[n]
    weight_scale: torch.Tensor | None = None

    def pack(self, keep_weight: bool) -> None:
        """Inference only (the packed path has no autograd): quantized blocks, or the
        weight in fp32 on CPU, where it is measured."""
        weight = self.weight
        if self.quant_blocks is not None:
            self._pack_quant_blocks()
        elif weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        elif (kernel := load_cpu_kernels()) is not None:
            self.packed = kernel.block_weight(weight.detach())
        else:
            return
        if not keep_weight:
            self.weight = None

    def _pack_quant_blocks(self) -> None:
        kernel = load_cpu_kernels()
        if kernel is None:
            raise RuntimeError("quantized blocks need the CPU kernels: none were built here")
        blocks, self.block_type = self.quant_blocks
        self.packed = kernel.quant_pack(blocks, self.block_type)
        self.quant_blocks = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        bias = torch.empty(0) if self.bias is None else self.bias
        rows = x.reshape(-1, self.in_features).contiguous()
        kernel, n = load_cpu_kernels(), self.out_features
        if self.block_type:
            y = kernel.quant_linear(rows, self.packed, self.block_type, n, bias, None)
        else:
            y = kernel.blocked_linear(rows, self.packed, n, bias, None)
        return y.view(*x.shape[:-1], n)


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
        kernel = load_cpu_kernels() if torch.is_inference_mode_enabled() else None
        if (
            kernel is not None
            and x.device.type == "cpu"
            and x.dtype == self.weight.dtype == torch.float32
        ):
            return kernel.rms_norm(x.contiguous(), self.weight, self.eps)
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
