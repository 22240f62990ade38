"""Weight-only quantization (`--quantization`, `--speculative-draft-model-quantization`;
names in shared/config.py QUANTIZATIONS): which method a checkpoint is served with, whether
the device runs it, and the methods that quantize a full-precision checkpoint's Linears at
load. gguf, awq and gptq instead read weights quantized already (gguf_loader.py,
awq_gptq.py); all but fp8 end as blocks in GGUF's layout that the CPU kernels multiply
(kernels/cpu/quant.cpp)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from specmesh.shared.config import QUANTIZATIONS
from specmesh.shared.model.fp8 import fp8_weight
from specmesh.shared.model.layers import Linear
from torch import nn

Q = gguf.GGMLQuantizationType
# Checkpoint weight name -> (uint8 [rows, row bytes] in GGUF's block layout, block type).
QuantBlocks = dict[str, tuple[torch.Tensor, Q]]

# Made at load from a weight [N, K], per 32 weights along K (gguf-py's quantizers, bit for
# bit GGML's reference ones): int8 as Q8_0, symmetric (w = d q, int8 q, fp16 d = max|w|/127);
# int4 as Q4_1, asymmetric (w = d q + m, 4-bit q, fp16 d = (max - min)/15, m = min); bf16
# each weight rounded to nearest even.
BLOCK_TYPES = {"int8": Q.Q8_0, "int4": Q.Q4_1, "bf16": Q.BF16}
# The LM head is Q8_0 under int4, as llama.cpp keeps a 4-bit file's output matrix at 8 bits
# (on SmolLM2 it is a fifth of the weights, and its argmax decides every token).
LM_HEAD_BLOCK_TYPES = {"int4": Q.Q8_0}
INT4_CHECKPOINTS = ("awq", "gptq")  # read from config.json's quantization_config, as SGLang
DRAFT_OPTION = "--speculative-draft-model-quantization"


def quantization_config(path: Path) -> dict[str, Any] | None:
    """A Hugging Face directory's config.json `quantization_config` (None: none, or a GGUF)."""
    config = path / "config.json"
    if path.suffix == ".gguf" or not config.is_file():
        return None
    return json.loads(config.read_text()).get("quantization_config")


def served_quantization(
    path: Path,
    requested: str | None,
    device: torch.device,
    dtype: torch.dtype,
    option: str = "--quantization",
) -> str | None:
    """The method the checkpoint at `path` is served with: `requested`, or the one its
    config.json declares (awq, gptq). A ValueError, before anything loads, for a method not
    served, one the checkpoint contradicts, or one `device` and `dtype` cannot run."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise ValueError(f"unknown {option} {requested!r} (served: {', '.join(QUANTIZATIONS)})")
    declared = _declared_method(path)
    if declared is not None and requested not in (None, declared):
        raise ValueError(
            f"{path} holds {declared} weights, so {option} {requested} does not apply to it "
            f"(leave {option} unset: it is read from config.json)"
        )
    if declared is None and requested in INT4_CHECKPOINTS:
        raise ValueError(
            f"{option} {requested} reads a {requested.upper()} checkpoint, and {path} declares "
            f"no quantization_config in config.json"
        )
    method = declared or requested
    if method is not None:
        check_device(method, device, dtype, option)
    return method


def _declared_method(path: Path) -> str | None:
    """The quant_method of `path`'s quantization_config; a method not served is an error."""
    quant = quantization_config(path)
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method not in INT4_CHECKPOINTS:
        raise ValueError(
            f"{path} holds {method or 'unnamed'}-quantized weights (config.json "
            f"quantization_config); served pre-quantized: {', '.join(INT4_CHECKPOINTS)}, GGUF"
        )
    return method


def check_device(method: str, device: torch.device, dtype: torch.dtype, option: str) -> None:
    """fp8 runs on CUDA (plain torch); every other method on the CPU kernels in fp32."""
    if method == "fp8":
        if device.type != "cuda":
            raise ValueError(
                f"{option} fp8 needs a CUDA GPU (weight-only fp8 e4m3 in plain torch), not "
                f"{device}; on CPU use int8 or int4"
            )
    elif device.type != "cpu" or dtype != torch.float32:
        raise ValueError(
            f"{option} {method} runs on CPU with fp32 activations (kernels/cpu/quant.cpp), "
            f"not on {device} in {dtype}"
        )


def quantize_linears(module: nn.Module, method: str) -> None:
    """Quantize every Linear of `module` (a model or drafter, loaded) from its weight:
    int8/int4/bf16 as blocks the Linear multiplies once packed (int4's LM head Q8_0), fp8 as e4m3
    rows with scales (the LM head, tied to the embedding or not, stays as SGLang's)."""
    for name, linear in module.named_modules():
        if not isinstance(linear, Linear):
            continue
        weight = linear.weight.detach()
        lm_head = name.split(".")[-1] == "lm_head"
        if method == "fp8" and not lm_head:
            w8, scale = fp8_weight(weight)
            _check_finite(name, scale)
            linear.weight, linear.weight_scale = nn.Parameter(w8, requires_grad=False), scale
        elif method in BLOCK_TYPES:
            kind = (
                LM_HEAD_BLOCK_TYPES.get(method, BLOCK_TYPES[method])
                if lm_head
                else BLOCK_TYPES[method]
            )
            linear.quant_blocks = (_blocks(name, weight, kind), int(kind))


def quantize_drafter(drafter: nn.Module, method: str | None) -> None:
    """An EAGLE head's or DFLASH draft's Linears quantized at load (`method` one of
    QUANTIZED_AT_LOAD, or None: kept), after the device check the target's get."""
    if method is not None:
        weight = next(drafter.parameters())
        check_device(method, weight.device, weight.dtype, DRAFT_OPTION)
        quantize_linears(drafter, method)


def _blocks(name: str, weight: torch.Tensor, kind: Q) -> torch.Tensor:
    """weight fp32 [N, K] -> uint8 [N, K / 32 * block bytes]: each row its blocks along K
    (bf16: [N, 2K], each weight's two bytes)."""
    if kind == Q.BF16:
        _check_finite(name, weight)
        return weight.to(torch.bfloat16).view(torch.uint8)
    if weight.shape[1] % 32:
        raise ValueError(
            f"{name} has {weight.shape[1]} inputs, not a multiple of the 32-weight blocks "
            f"{kind.name} quantizes"
        )
    rows = np.ascontiguousarray(gguf.quants.quantize(weight.numpy(), kind))
    _, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    scale_bytes = 4 if kind == Q.Q4_1 else 2  # fp16 d (and Q4_1's m) open each block
    scales = rows.reshape(-1, block_bytes)[:, :scale_bytes].copy().view(np.float16)
    _check_finite(name, torch.from_numpy(scales))
    return torch.from_numpy(rows)


def _check_finite(name: str, scales: torch.Tensor) -> None:
    """A weight's scales are non-finite where the weight is (NaN, inf) or past fp16's
    range: checking them, one per 32 weights or per row, costs far less than the weight."""
    if not torch.isfinite(scales).all():
        raise ValueError(f"{name}.weight has non-finite values or scales: a corrupt checkpoint")
