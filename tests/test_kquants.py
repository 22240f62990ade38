"""K-quant (Q4_K, Q6_K) and 5-bit (Q5_0, Q5_1) GGUF blocks served as they ship: the kernels
against the same weights dequantized (random valid K-quant blocks: gguf-py cannot quantize
to them), at the integer sums' extremes, independent of the rows beside them; tiny models
mixing the types as llama.cpp's Q4_K_M does; and what is refused."""

from __future__ import annotations

import math
import zlib
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from specmesh.kernels.cpu import load
from specmesh.shared.model.gguf_loader import FP16_SCALES, HELD_BY_Q8_0, as_q8_0
from specmesh.shared.model.loader import load_model
from test_quantized import MAX_REL_ERR, SERVED, serve_like_dequantized, write_gguf
from transformers import LlamaConfig

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K]
# The fp16 d (Q4_K: and dmin) of random blocks: weights of about 0.02, as a model's.
K_QUANT_D = {Q.Q4_K: (1e-4, 5e-4), Q.Q6_K: (2e-5,)}


def random_blocks(rng: np.random.Generator, n: int, k: int, kind: Q) -> np.ndarray:
    """uint8 [n, row bytes] of valid `kind` blocks: quantized random weights (Q5_0, Q5_1) or
    random bytes with small finite fp16 scales (K-quants: any bytes are valid values and
    integer sub-block scales)."""
    if kind not in K_QUANT_D:
        weight = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        return np.ascontiguousarray(gguf.quants.quantize(weight, kind))
    values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n * k // values, block_bytes), dtype=np.uint8)
    at, _ = FP16_SCALES[kind]
    for i, d in enumerate(K_QUANT_D[kind]):
        scales = (d * rng.uniform(0.5, 1, len(raw))).astype(np.float16)
        raw[:, at + 2 * i : at + 2 * i + 2] = scales[:, None].view(np.uint8)
    return raw.reshape(n, -1)


def dequantized(raw: np.ndarray, kind: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, kind), np.float32))


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize(("n", "k"), [(576, 1536), (61, 512)], ids=["model-sized", "ragged-n"])
def test_quant_linear_matches_the_dequantized_weight(
    kind: Q, n: int, k: int, quant_kernel: ModuleType
) -> None:
    """Any row count (past a job's 64 rows too), bias and residual: within the int16
    activations' error of x @ W.T; packed in about the file's bytes (Q4_K's 6-bit sub-block
    scales and mins take a byte each: 1/8 bit a weight more)."""
    kernel = quant_kernel
    raw = random_blocks(np.random.default_rng(n), n, k, kind)
    weight = dequantized(raw, kind)
    packed = kernel.quant_pack(torch.from_numpy(raw), int(kind))
    values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    file_bits = 8 * block_bytes / values + (1 / 8 if kind == Q.Q4_K else 0)
    assert packed.numel() * 8 == file_bits * math.ceil(n / 16) * 16 * k  # 16-column panels
    for rows in (1, 2, 3, 70):
        x, bias, residual = torch.randn(rows, k), torch.randn(n), torch.randn(rows, n)
        ours = kernel.quant_linear(x, packed, int(kind), n, bias, residual)
        ref = x @ weight.T + bias + residual
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < MAX_REL_ERR, rows


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_extreme_blocks_stay_in_int32(kind: Q, quant_kernel: ModuleType) -> None:
    """Every value and sub-block scale at its largest (all bits set; Q6_K's scales -128)
    against rows of one repeated value (every int16 activation +-32767): the integer sums'
    worst case stays right (an int32 overflow would be off by 2^32)."""
    kernel, k = quant_kernel, 512
    values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = np.full((8 * k // values, block_bytes), 255, np.uint8)
    at, count = FP16_SCALES[kind]  # finite scales (all bits set is NaN)
    blocks[:, at : at + 2 * count] = np.full((len(blocks), count), 1e-3, np.float16).view(np.uint8)
    if kind == Q.Q6_K:
        blocks[:, at - 16 : at] = 0x80  # its 16 int8 scales, just before d: -128
    raw = blocks.reshape(8, -1)
    x = torch.tensor([[1.0], [-1.0], [0.5]]).expand(3, k).contiguous()
    ours = kernel.quant_linear(
        x, kernel.quant_pack(torch.from_numpy(raw), int(kind)), int(kind), 8, torch.empty(0), None
    )
    ref = x @ dequantized(raw, kind).T
    assert ((ours - ref).abs().max() / ref.abs().max()).item() < MAX_REL_ERR


@pytest.mark.parametrize("kind", [*SERVED, *TYPES], ids=lambda k: k.name)
def test_a_row_does_not_depend_on_its_batch(kind: Q, quant_kernel: ModuleType) -> None:
    """Each row alone gives bit for bit what it gives among 5 (speculation stays lossless)."""
    kernel = quant_kernel
    raw = torch.from_numpy(random_blocks(np.random.default_rng(1), 24, 512, kind))
    packed, none = kernel.quant_pack(raw, int(kind)), torch.empty(0)
    x = torch.randn(5, 512)
    together = kernel.quant_linear(x, packed, int(kind), 24, none, None)
    for i in range(5):
        alone = kernel.quant_linear(x[i : i + 1], packed, int(kind), 24, none, None)
        assert torch.equal(alone[0], together[i])


def test_k_quants_need_whole_superblocks() -> None:
    """K not a multiple of 256 is refused with a message, not read past the weight."""
    kernel = load()
    raw = torch.from_numpy(random_blocks(np.random.default_rng(2), 8, 256, Q.Q4_K))
    packed = kernel.quant_pack(raw, int(Q.Q4_K))
    with pytest.raises(RuntimeError, match="K = 288 is not whole blocks of 256"):
        kernel.quant_linear(torch.randn(1, 288), packed, int(Q.Q4_K), 8, torch.empty(0), None)


@pytest.mark.parametrize("kind", HELD_BY_Q8_0, ids=lambda k: k.name)
def test_q8_0_holds_the_symmetric_types_exactly(kind: Q) -> None:
    raw = gguf.quants.quantize(np.random.default_rng(3).standard_normal((4, 64), np.float32), kind)
    q8_0 = as_q8_0(torch.from_numpy(np.ascontiguousarray(raw)), kind).numpy()
    assert torch.equal(dequantized(q8_0, Q.Q8_0), dequantized(raw, kind))


# Rows of whole 256-weight superblocks, as K-quants need.
TINY_K = LlamaConfig(
    vocab_size=128,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


def q4_k_m(name: str, weight: np.ndarray) -> tuple[np.ndarray, Q]:
    """Blocks as llama.cpp's Q4_K_M picks them: Q6_K for v and, in some layers, down;
    Q4_K for the other matrices; the (tied) token embedding here Q8_0."""
    if "embed_tokens" in name:
        return gguf.quants.quantize(weight, Q.Q8_0), Q.Q8_0
    kind = Q.Q6_K if ".v_proj." in name or "layers.1.mlp.down_proj" in name else Q.Q4_K
    return random_blocks(
        np.random.default_rng(zlib.crc32(name.encode())), *weight.shape, kind
    ), kind


def test_tiny_q4_k_m_model_serves_like_its_dequantized_weights(tmp_path: Path) -> None:
    """K-quant blocks through the fused decoder and the torch path; q/k/v mix Q4_K with Q6_K
    and keep fp32 weights (the one fused Linear not on blocks)."""
    model = serve_like_dequantized(write_gguf(tmp_path / "k.gguf", q4_k_m, TINY_K))
    layer = model.layers[1]
    assert layer.self_attn.qkv_proj.block_type == 0
    assert layer.self_attn.o_proj.block_type == layer.mlp.gate_up_proj.block_type == Q.Q4_K
    assert layer.mlp.down_proj.block_type == Q.Q6_K
    assert model.layers[0].mlp.down_proj.block_type == Q.Q4_K


def q4_k_m_fallbacks(name: str, weight: np.ndarray) -> tuple[np.ndarray, Q]:
    """What llama.cpp's Q4_K_M makes of a model whose rows are not whole superblocks
    (SmolLM2-135M's 576): Q5_0 for Q4_K, Q8_0 for Q6_K (v, the embedding); down here Q5_1."""
    kind = Q.Q5_1 if ".down_proj." in name else Q.Q5_0
    if ".v_proj." in name or "embed_tokens" in name:
        kind = Q.Q8_0
    return gguf.quants.quantize(weight, kind), kind


def test_tiny_fallback_model_serves_like_its_dequantized_weights(tmp_path: Path) -> None:
    """5-bit blocks; q/k/v mixing Q5_0 with Q8_0 multiply as Q8_0, which holds Q5_0 exactly."""
    model = serve_like_dequantized(write_gguf(tmp_path / "q5.gguf", q4_k_m_fallbacks))
    layer = model.layers[0]
    assert layer.self_attn.qkv_proj.block_type == Q.Q8_0
    assert layer.self_attn.o_proj.block_type == layer.mlp.gate_up_proj.block_type == Q.Q5_0
    assert layer.mlp.down_proj.block_type == Q.Q5_1


@pytest.mark.parametrize(("kind", "field"), [(Q.Q4_K, 1), (Q.Q6_K, 0)], ids=["dmin", "d"])
def test_non_finite_k_quant_scales_are_refused(kind: Q, field: int, tmp_path: Path) -> None:
    """Q4_K's dmin (its second fp16) and Q6_K's d (at the block's end) are checked too."""
    path = write_gguf(tmp_path / "k.gguf", q4_k_m, TINY_K)
    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.tensor_type == kind)
    at, name = FP16_SCALES[kind][0] + 2 * field, tensor.name
    tensor.data[0, at : at + 2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
    reader.data.flush()
    del reader, tensor
    with pytest.raises(ValueError, match=f"{name} has non-finite scales"):
        load_model(path, torch.device("cpu"), torch.float32, quantization="gguf")
