"""The decoder's CPU fast paths compute what the plain formulas do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.model.layers import Linear, pack_linears
from specmesh.shared.model.rope import apply_rope, rope_cos_sin
from torch import nn

pytestmark = pytest.mark.unit

needs_kernel = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="the CPU kernels do not build here"
)


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 8, 33, 300])
@pytest.mark.parametrize("out_features", [160, 150])  # 150: a zero-padded tail block
def test_packed_linear_matches_f_linear(rows: int, bias: bool, out_features: int) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, out_features, bias=bias)
    weight = layer.weight.detach().clone()
    expected_bias = layer.bias.detach().clone() if bias else None
    x = torch.randn(rows, 96)
    layer.pack(keep_weight=False)
    assert layer.packed is not None and layer.weight is None
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, weight, expected_bias), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_blocked_linear_adds_the_residual() -> None:
    torch.manual_seed(0)
    weight, bias, x, residual = (
        torch.randn(40, 24),
        torch.randn(40),
        torch.randn(9, 24),
        torch.randn(9, 40),
    )
    kernel = load_cpu_kernels()
    got = kernel.blocked_linear(x, kernel.block_weight(weight), 40, bias, residual)
    torch.testing.assert_close(got, x @ weight.T + bias + residual, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 12, 33])  # 12, 33: AVX-512's 12-row tiles where present
def test_bf16_blocks_multiply_their_exact_weights(rows: int) -> None:
    """bf16 column blocks (`--quantization bf16`) widen each weight exactly: the products
    and sums are fp32's, as if the bf16 values were fp32 weights."""
    torch.manual_seed(rows)
    weight, bias, x = torch.randn(40, 24).bfloat16(), torch.randn(40), torch.randn(rows, 24)
    kernel = load_cpu_kernels()
    blocked = kernel.block_weight(weight)
    assert blocked.dtype == torch.bfloat16 and blocked.shape == (3, 24, 16)
    got = kernel.blocked_linear(x, blocked, 40, bias, None)
    torch.testing.assert_close(got, x @ weight.float().T + bias, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_pack_linears_keeps_lm_heads_and_skips_other_dtypes() -> None:
    model = nn.Module()
    model.proj = Linear(8, 8)
    model.lm_head = Linear(8, 16, bias=False)
    model.bf16 = Linear(8, 8).to(torch.bfloat16)
    pack_linears(model)
    assert model.proj.packed is not None and model.proj.weight is None
    assert model.lm_head.packed is not None and model.lm_head.weight is not None
    assert model.bf16.packed is None and model.bf16.weight is not None


def test_rope_matches_rotate_half() -> None:
    """HF's x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1]."""
    head_dim, positions = 64, torch.tensor([0, 5, 77])
    cos, sin = rope_cos_sin(head_dim, 10000.0, 128, None)
    x = torch.randn(3, 4, head_dim)
    freqs = torch.outer(positions.float(), 1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64))
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    rotated = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    expected = x * emb.cos() + rotated * emb.sin()
    got = apply_rope(x, cos[positions], sin[positions])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
