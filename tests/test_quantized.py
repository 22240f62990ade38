"""GGUF blocks served as they ship (`--quantization gguf`): the kernels against the same
weights dequantized, a tiny model on both paths, and the inputs refused before serving."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch
from helpers import add_llama_metadata, gguf_permute
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.loader import load_model
from specmesh.shared.runner.model_runner import ModelRunner
from transformers import LlamaConfig, LlamaForCausalLM

CPU = torch.device("cpu")
Q = gguf.GGMLQuantizationType
SERVED = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
# Relative error of a matmul with activations quantized to int16 per 32 values.
MAX_REL_ERR = 1e-3


def blocks(weight: np.ndarray, kind: Q) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(weight, kind)))


@pytest.mark.parametrize("kind", SERVED, ids=lambda k: k.name)
@pytest.mark.parametrize(("n", "k"), [(576, 1536), (61, 96)], ids=["model-sized", "ragged-n"])
def test_quant_linear_matches_the_dequantized_weight(
    kind: Q, n: int, k: int, quant_kernel: ModuleType
) -> None:
    """Any row count (past a job's 64 rows too), an output count not a multiple of the
    16-column panels, bias and residual: within the int16 activations' error of x @ W.T."""
    kernel = quant_kernel
    rng = np.random.default_rng(n)
    raw = blocks(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    weight = torch.from_numpy(np.array(gguf.quants.dequantize(raw.numpy(), kind), np.float32))
    packed = kernel.quant_pack(raw, int(kind))
    for rows in (1, 2, 3, 70):
        x, bias, residual = torch.randn(rows, k), torch.randn(n), torch.randn(rows, n)
        ours = kernel.quant_linear(x, packed, int(kind), n, bias, residual)
        ref = x @ weight.T + bias + residual
        assert ((ours - ref).abs().max() / ref.abs().max()).item() < MAX_REL_ERR, rows


TINY = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)


# HF name and (Q/K-permuted) fp32 weight of a matrix -> its GGUF blocks and their type.
BlocksOf = Callable[[str, np.ndarray], tuple[np.ndarray, Q]]


def in_blocks(kind: Q, embedding: Q = Q.Q8_0) -> BlocksOf:
    """The matrices quantized to `kind` blocks, the (tied) token embedding to `embedding`."""

    def blocks_of(name: str, weight: np.ndarray) -> tuple[np.ndarray, Q]:
        block = embedding if "embed_tokens" in name else kind
        return gguf.quants.quantize(weight, block), block

    return blocks_of


def write_gguf(path: Path, blocks_of: BlocksOf, config: LlamaConfig = TINY) -> Path:
    """A tiny random llama as a GGUF: its matrices in `blocks_of`'s blocks, norms in F32."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    add_llama_metadata(writer, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        weight = tensor.numpy()
        if ".q_proj." in name:
            weight = gguf_permute(weight, config.num_attention_heads)
        elif ".k_proj." in name:
            weight = gguf_permute(weight, config.num_key_value_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if weight.ndim == 1:
            writer.add_tensor(gguf_name, weight)
            continue
        blocks, block = blocks_of(name, weight)
        writer.add_tensor(gguf_name, blocks, raw_dtype=block)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def greedy(runner: ModelRunner, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after `prompt` (prefilled in one chunk, then one token a step), and the
    prefill's logits at every position."""
    table = list(range(16))
    positions = list(range(len(prompt)))
    span = SequenceSpan(table, 0, len(prompt))
    logits, _ = runner.forward([span], prompt, positions, positions)
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        at = len(prompt) + len(tokens) - 1
        step, _ = runner.forward([SequenceSpan(table, at, 1)], tokens[-1:], [at], [0])
        tokens.append(int(step[0].argmax()))
    return tokens, logits


def runner(path: Path, quantization: str | None, fused: bool = True) -> ModelRunner:
    model = load_model(path, CPU, torch.float32, quantization=quantization)
    runner = ModelRunner(model, KVCache(model.config, 16, 4, CPU, torch.float32))
    assert runner.fused is not None
    if not fused:
        runner.fused = None
    return runner


@pytest.mark.parametrize("kind", SERVED, ids=lambda k: k.name)
def test_tiny_model_on_gguf_blocks_matches_its_dequantized_weights(kind: Q, tmp_path: Path) -> None:
    """Every matrix in one block type, the tied LM head the embedding's Q8_0."""
    path = write_gguf(tmp_path / "tiny.gguf", in_blocks(kind))
    model = serve_like_dequantized(path)
    assert model.lm_head.block_type == int(Q.Q8_0)
    assert model.layers[0].mlp.down_proj.block_type == int(kind)


def test_a_bf16_gguf_serves_on_bf16_blocks(tmp_path: Path) -> None:
    """A BF16 GGUF's matrices (the tied LM head too) multiplied as bf16, not expanded to
    fp32: the same values, so the same logits up to the order of fp32 sums."""
    path = write_gguf(tmp_path / "tiny.gguf", in_blocks(Q.BF16, Q.BF16))
    model = serve_like_dequantized(path)
    assert model.lm_head.block_type == model.layers[0].mlp.down_proj.block_type == int(Q.BF16)
    assert model.layers[0].mlp.down_proj.packed.dtype == torch.bfloat16


def serve_like_dequantized(path: Path) -> torch.nn.Module:
    """Runs the GGUF at `path` on its blocks (fused decoder and torch path) beside the same
    file expanded to fp32 (today's path): prefill logits within tolerance, greedy tokens
    the same on all but at most one of 10 prompts (a near tie of a random model may flip).
    Returns the model on the blocks, whose Linears' block types the caller checks."""
    full = runner(path, None)
    assert all(m.block_type == 0 for m in full.model.modules() if hasattr(m, "block_type"))
    quantized = [runner(path, "gguf"), runner(path, "gguf", fused=False)]
    same = 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        prompt = torch.randint(3, full.model.config.vocab_size, (12,), generator=gen).tolist()
        ref_tokens, ref_logits = greedy(full, prompt, 6)
        outputs = [greedy(r, prompt, 6) for r in quantized]
        for _, logits in outputs:
            err = (logits - ref_logits).abs().max() / ref_logits.abs().max()
            assert err < MAX_REL_ERR, err.item()
        assert outputs[0][0] == outputs[1][0]  # fused and torch paths: the same kernels
        same += outputs[0][0] == ref_tokens
    assert same >= 9
    return quantized[0].model


def test_refused_before_serving(tmp_path: Path) -> None:
    """A block type not served, non-finite scales, a model directory without its GGUF, and
    a device or dtype the kernels cannot run: each a clear error from the loader."""
    path = write_gguf(tmp_path / "mxfp4.gguf", in_blocks(Q.MXFP4))
    with pytest.raises(ValueError, match="MXFP4, a block type not served"):
        load_model(path, CPU, torch.float32, quantization="gguf")
    path = write_gguf(tmp_path / "nan.gguf", in_blocks(Q.Q4_1))
    reader = gguf.GGUFReader(path, "r+")
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    down.data[0, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)  # block 0's d
    reader.data.flush()
    del reader
    with pytest.raises(ValueError, match="blk.1.ffn_down.weight has non-finite scales"):
        load_model(path, CPU, torch.float32, quantization="gguf")
    with pytest.raises(ValueError, match="holds no model.gguf"):
        load_model(tmp_path, CPU, torch.float32, quantization="gguf")
    with pytest.raises(ValueError, match="runs on CPU with fp32"):
        load_model(path, CPU, torch.bfloat16, quantization="gguf")
