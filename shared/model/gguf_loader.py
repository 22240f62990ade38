"""Read a llama-family GGUF file as a Hugging Face config dict and fp32 state dict.

The result is what `config.json` + `model.safetensors` of the matching
`*ForCausalLM` checkpoint would hold, so the rest of the runtime only ever
deals with one layout.
"""

from __future__ import annotations

import math
from os import PathLike
from typing import Any

import gguf
import numpy as np
import torch
from tqdm import tqdm

# What a model directory converted from a GGUF keeps the file as (quantized serving reads it).
SOURCE_GGUF = "model.gguf"

# GGUF architecture -> (HF architecture, HF model_type, Q/K rows permuted by llama.cpp).
# convert_hf_to_gguf permutes Q/K for llama-arch files only (its rotary kernel
# rotates adjacent pairs, HF rotates halves); qwen2 files keep the HF order.
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama.cpp stores Llama-3 rope scaling as this per-frequency factor tensor, not as metadata.
_ROPE_FREQS = "rope_freqs.weight"


def load_gguf(
    source: str | PathLike[str] | gguf.GGUFReader, progress: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`(config, state_dict)` with Hugging Face names, every tensor dequantized to fp32.

    `source` may be an open reader, since parsing a GGUF's metadata (the whole
    vocabulary) takes seconds and callers often need it too.
    """
    reader = source if isinstance(source, gguf.GGUFReader) else gguf.GGUFReader(source)
    arch = metadata(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {sorted(_ARCHS)})"
        )
    heads = metadata(reader, f"{arch}.attention.head_count")
    kv_heads = metadata(reader, f"{arch}.attention.head_count_kv", heads)
    permuted = _ARCHS[arch][2]

    state: dict[str, torch.Tensor] = {}
    rope_freqs = None
    for tensor in tqdm(reader.tensors, desc="converting", unit="tensor", disable=not progress):
        # np.array copies: the reader's memory-mapped data is read-only.
        weight = np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        if tensor.name == _ROPE_FREQS:
            rope_freqs = weight
            continue
        if permuted and ".attn_q." in tensor.name:
            weight = _unpermute(weight, heads)
        elif permuted and ".attn_k." in tensor.name:
            weight = _unpermute(weight, kv_heads)
        state[_hf_name(tensor.name)] = torch.from_numpy(weight)

    return _config(reader, arch, state, rope_freqs), state


_FLOAT_TYPES = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
# GGUF block types the CPU kernels multiply as they are (kernels/cpu/quant.cpp), each with
# where its blocks keep their fp16 scales (d; Q4_1, Q5_1 also m; Q4_K also dmin): (byte offset
# in the block, how many). Q4_K's 6-bit sub-block scales and Q6_K's int8 ones are always finite.
_Q = gguf.GGMLQuantizationType
FP16_SCALES = {
    _Q.Q8_0: (0, 1),
    _Q.Q4_0: (0, 1),
    _Q.Q4_1: (0, 2),
    _Q.Q5_0: (0, 1),
    _Q.Q5_1: (0, 2),
    _Q.Q4_K: (0, 2),
    _Q.Q6_K: (gguf.GGML_QUANT_SIZES[_Q.Q6_K][1] - 2, 1),  # d last, after values and scales
}
# BF16 matrices too, as bf16 column blocks (kernels/cpu/matmul.cpp); BF16 vectors (norms)
# are expanded like F32 and F16 ones.
SERVED_BLOCK_TYPES = (*FP16_SCALES, _Q.BF16)
# Symmetric 32-weight types, w = d (q - centre), that Q8_0 (w = d q, int8 q) holds exactly.
_CENTRES = {_Q.Q4_0: 8, _Q.Q5_0: 16}
HELD_BY_Q8_0 = tuple(_CENTRES)


def quantized_weights(
    reader: gguf.GGUFReader,
) -> dict[str, tuple[torch.Tensor, gguf.GGMLQuantizationType]]:
    """Hugging Face name -> (blocks as uint8 [rows, row bytes], block type) of every
    quantized matrix of the file, its rows in load_gguf's order (rows permuted by llama.cpp
    are put back: each row is whole blocks). A block type not served is an error."""
    arch = metadata(reader, "general.architecture")
    heads = metadata(reader, f"{arch}.attention.head_count")
    kv_heads = metadata(reader, f"{arch}.attention.head_count_kv", heads)
    permuted = _ARCHS[arch][2] if arch in _ARCHS else False
    blocks = {}
    for tensor in reader.tensors:
        if tensor.tensor_type in _FLOAT_TYPES or len(tensor.shape) == 1:
            continue
        if tensor.tensor_type not in SERVED_BLOCK_TYPES:
            served = ", ".join(t.name for t in SERVED_BLOCK_TYPES)
            raise ValueError(
                f"GGUF tensor {tensor.name} is {tensor.tensor_type.name}, a block type not "
                f"served as it is (served: {served}); serve the file expanded to fp32 instead"
            )
        rows = np.array(tensor.data, np.uint8)
        if not _finite(rows, tensor.tensor_type):
            raise ValueError(f"GGUF tensor {tensor.name} has non-finite scales: a corrupt file")
        if permuted and ".attn_q." in tensor.name:
            rows = _unpermute(rows, heads)
        elif permuted and ".attn_k." in tensor.name:
            rows = _unpermute(rows, kv_heads)
        blocks[_hf_name(tensor.name)] = (torch.from_numpy(rows), tensor.tensor_type)
    return blocks


def _finite(rows: np.ndarray, kind: gguf.GGMLQuantizationType) -> bool:
    """Whether every fp16 scale of a served type's blocks (d, and m or dmin where it has
    one) is finite; BF16's every value."""
    if kind == _Q.BF16:
        return bool(torch.from_numpy(rows).view(torch.bfloat16).isfinite().all())
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    at, count = FP16_SCALES[kind]
    scales = rows.reshape(-1, block_bytes)[:, at : at + 2 * count].copy().view(np.float16)
    return bool(np.isfinite(scales).all())


def as_q8_0(rows: torch.Tensor, kind: gguf.GGMLQuantizationType) -> torch.Tensor:
    """Q4_0 or Q5_0 blocks (uint8 [N, row bytes]) as Q8_0 blocks of the same weights exactly:
    each block's d, then its 32 q - centre as int8 (a fused matmul whose parts mix these
    with Q8_0 multiplies them all as Q8_0)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    blocks = rows.numpy().reshape(-1, block_bytes)
    nibbles = blocks[:, -16:]  # value j in byte j's low nibble, j + 16 in its high one
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.int16)
    if kind == _Q.Q5_0:  # value j's fifth bit: bit j of the 4 bytes after d
        fifth = blocks[:, 2:6].copy().view("<u4")
        q |= ((fifth >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
    values = (q - _CENTRES[kind]).astype(np.int8).view(np.uint8)
    q8_0 = np.concatenate([blocks[:, :2], values], axis=1)
    return torch.from_numpy(q8_0.reshape(rows.shape[0], -1))


def metadata(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of GGUF metadata field `key`, or `default` when the file lacks it."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _f32(value: float) -> float:
    # GGUF stores floats as f32; the shortest f32 repr gives back the config's
    # original value (1e-05 rather than 9.999999747378752e-06).
    return float(str(np.float32(value)))


def _hf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)  # kind is "weight" or "bias"
    try:
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    except KeyError:
        raise ValueError(f"unexpected GGUF tensor {name!r}") from None


def _unpermute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute`: per head, llama.cpp interleaves
    the two rotary halves; put them back as halves."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _config(
    reader: gguf.GGUFReader,
    arch: str,
    state: dict[str, torch.Tensor],
    rope_freqs: np.ndarray | None,
) -> dict[str, Any]:
    hf_arch, model_type, _ = _ARCHS[arch]
    hidden = metadata(reader, f"{arch}.embedding_length")
    heads = metadata(reader, f"{arch}.attention.head_count")
    head_dim = metadata(reader, f"{arch}.attention.key_length", hidden // heads)
    rope_theta = _f32(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": metadata(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": metadata(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": metadata(reader, f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "max_position_embeddings": metadata(reader, f"{arch}.context_length"),
        "vocab_size": state["model.embed_tokens.weight"].shape[0],
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in state,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in state,
        "tie_word_embeddings": "lm_head.weight" not in state,
        "bos_token_id": metadata(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }
    if rope_freqs is not None:
        config["rope_scaling"] = _llama3_rope_scaling(rope_freqs, rope_theta, head_dim)
    elif (kind := metadata(reader, f"{arch}.rope.scaling.type", "none")) != "none":
        if kind not in ("linear", "yarn"):
            raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")
        config["rope_scaling"] = {
            "rope_type": kind,
            "factor": _f32(metadata(reader, f"{arch}.rope.scaling.factor")),
        }
        original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            config["rope_scaling"]["original_max_position_embeddings"] = original
    return config


def _llama3_rope_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover HF's llama3 `rope_scaling` from llama.cpp's per-frequency factors.

    Only `factor` is visible directly (the largest one); the other three are the
    values every Llama 3.x release uses, checked by recomputing the factors the
    way convert_hf_to_gguf does.
    """
    factor, low, high, original = _f32(factors.max()), 1.0, 4.0, 8192
    expected = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            expected.append(1.0)
        elif wavelen > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError("GGUF rope_freqs do not match Llama-3 rope scaling; cannot convert")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }
