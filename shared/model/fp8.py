"""Weight-only fp8 (`--quantization fp8`, SGLang's name; CUDA only): each Linear's weight
as float8_e4m3fn with one fp32 scale per output row, expanded to the activations' dtype
inside the matmul (activations stay unquantized). Plain torch, so importing this needs no
GPU; the loader refuses fp8 off CUDA (shared/model/quantize.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# e4m3's largest finite value: each row's largest magnitude is mapped onto it.
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (w8 float8_e4m3fn [N, K], scale fp32 [N]): weight ~ scale[:, None]
    * w8, e4m3's 3 mantissa bits giving each weight a relative error of at most 2^-4."""
    amax = weight.detach().abs().amax(dim=1).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (weight.detach().float() / scale[:, None]).to(torch.float8_e4m3fn), scale


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] @ (scale * w8).T + bias, as (x @ w8.T) * scale + bias: one matmul in x's
    dtype, the per-row scale applied to its output columns in fp32."""
    y = (F.linear(x, weight.to(x.dtype)).float() * scale).to(x.dtype)
    return y if bias is None else y + bias
