"""Build a model from a Hugging Face directory (safetensors, sharded or not) or a GGUF file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from specmesh.shared.config import QUANTIZED_AT_LOAD
from specmesh.shared.model.attention import get_attention_backend
from specmesh.shared.model.awq_gptq import Int4Layout, int4_weights
from specmesh.shared.model.config import OFFSET_NORM_ARCHITECTURES, ModelConfig
from specmesh.shared.model.gguf_loader import (
    HELD_BY_Q8_0,
    SOURCE_GGUF,
    as_q8_0,
    load_gguf,
    quantized_weights,
)
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.mistral3 import Mistral3Vision
from specmesh.shared.model.mistral3 import parameter_name as mistral3_parameter_name
from specmesh.shared.model.quantize import (
    INT4_CHECKPOINTS,
    QuantBlocks,
    quantization_config,
    quantize_linears,
    served_quantization,
)


def _safetensors_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _read_checkpoint(path: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    if path.suffix == ".gguf":
        hf_config, state = load_gguf(path)
        return ModelConfig.from_hf(hf_config), iter(state.items())
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a directory with config.json")
    return ModelConfig.from_file(path / "config.json"), _safetensors_tensors(path)


def fused_slices(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection name -> (our fused parameter, row offset, rows)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    ffn = cfg.intermediate_size
    slices = {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, ffn),
        "up_proj": ("gate_up_proj", ffn, ffn),
    }
    if cfg.attn_output_gate:  # taken out of q_proj by _checkpoint_parts
        slices["q_gate"] = ("qkv_proj", q + 2 * kv, q)
    return slices


def checkpoint_parts(
    cfg: ModelConfig, name: str, tensor: torch.Tensor
) -> list[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as what our parameters hold: a gated attention's q_proj
    [H * (D q rows, D gate rows), ...] split into q and `q_gate`; a (1 + weight) RMSNorm's
    weight with the 1 added (the gated norm of linear attention scales by its weight)."""
    if cfg.attn_output_gate and name.split(".")[-2:-1] == ["q_proj"]:
        halves = tensor.view(cfg.num_heads, 2, cfg.head_dim, *tensor.shape[1:]).unbind(1)
        q, gate = (h.reshape(cfg.num_heads * cfg.head_dim, *tensor.shape[1:]) for h in halves)
        return [(name, q), (name.replace("q_proj", "q_gate"), gate)]
    offset = cfg.architecture in OFFSET_NORM_ARCHITECTURES
    if offset and name.endswith("norm.weight") and "linear_attn" not in name:
        return [(name, tensor + 1)]
    return [(name, tensor)]


# One expert's projection as Hugging Face checkpoints store it, e.g.
# layers.3.mlp.experts.5.up_proj.weight -> (our stacked parameter, is it gate_up's up half).
EXPERT_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", False),
    "up_proj": ("gate_up_proj", True),
    "down_proj": ("down_proj", False),
}


def _expert_target(name: str, params: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor] | None:
    """Checkpoint tensor `...mlp.experts.{e}.{proj}.weight` -> (our stacked parameter
    `...mlp.experts.{gate_up_proj|down_proj}` [E, rows, cols], its rows for expert e);
    None for any other name."""
    parts = name.split(".")
    if len(parts) < 4 or parts[-4] != "experts" or not parts[-3].isdigit():
        return None
    if parts[-2] not in EXPERT_PROJECTIONS or parts[-1] != "weight":
        return None
    stacked, second_half = EXPERT_PROJECTIONS[parts[-2]]
    param = ".".join([*parts[:-3], stacked])
    if param not in params or int(parts[-3]) >= len(params[param]):
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    target = params[param].data[int(parts[-3])]
    if stacked == "gate_up_proj":  # [2I, H]: gate rows, then up rows
        target = target.chunk(2)[second_half]
    return param, target


def expert_checkpoint_names(param: str, num_experts: int) -> list[str]:
    """The per-expert checkpoint tensors that fill stacked expert parameter `param`."""
    prefix, stacked = param.rsplit(".", 1)
    projs = [p for p, (target, _) in EXPERT_PROJECTIONS.items() if target == stacked]
    return [f"{prefix}.{e}.{p}.weight" for e in range(num_experts) for p in projs]


def _fused_part(
    fused: dict[str, tuple[str, int, int]], proj: str, param_rows: int
) -> tuple[int, int]:
    """(row offset, rows) of checkpoint projection `proj` in its fused parameter of
    `param_rows` rows. A SwiGLU's gate and up are its halves whatever its size: the table
    gives the dense MLP's, and a shared expert's is another."""
    module, start, rows = fused[proj]
    if module == "gate_up_proj":
        rows = param_rows // 2
        start = 0 if proj == "gate_proj" else rows
    return start, rows


def _fused_target(
    name: str, params: dict[str, torch.Tensor], fused: dict[str, tuple[str, int, int]]
) -> tuple[str, torch.Tensor]:
    """Checkpoint tensor `name` -> (our parameter, the rows it fills: all, or a fused slice)."""
    parts = name.split(".")
    fused_part = len(parts) >= 2 and parts[-2] in fused
    param = ".".join([*parts[:-2], fused[parts[-2]][0], parts[-1]]) if fused_part else name
    if param not in params:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    target = params[param].data
    if not fused_part:
        return param, target
    start, rows = _fused_part(fused, parts[-2], len(target))
    return param, target[start : start + rows]


def copy_into(
    params: dict[str, torch.Tensor],
    fused: dict[str, tuple[str, int, int]],
    name: str,
    tensor: torch.Tensor,
) -> None:
    """Copy checkpoint tensor `name` into our parameter, the right rows of a fused one
    (or one expert's rows of the stacked expert weights)."""
    param, target = _expert_target(name, params) or _fused_target(name, params, fused)
    if tensor.shape != target.shape:
        # copy_ would broadcast or fill only part of the parameter, silently.
        raise ValueError(
            f"checkpoint tensor for {param!r} has shape {tuple(tensor.shape)}, "
            f"the config implies {tuple(target.shape)}"
        )
    target.copy_(tensor)


def split_fused(
    name: str, tensor: torch.Tensor, fused: dict[str, tuple[str, int, int]]
) -> list[tuple[str, torch.Tensor]]:
    """Our parameter as the checkpoint tensors it was spliced from (the inverse of copy_into)."""
    *prefix, module, kind = name.split(".") if "." in name else ("", name, "")
    parts = [proj for proj, (m, *_) in fused.items() if m == module]
    if not parts:
        return [(name, tensor)]
    slices = [(proj, *_fused_part(fused, proj, len(tensor))) for proj in parts]
    return [(".".join([*prefix, proj, kind]), tensor[s : s + n]) for proj, s, n in slices]


def checkpoint_names(param: str, fused: dict[str, tuple[str, int, int]]) -> list[str]:
    """The checkpoint tensors that fill one of our parameters."""
    if "." not in param:  # e.g. EAGLE-3's d2t map
        return [param]
    *prefix, module, kind = param.split(".")
    parts = [proj for proj, (target, *_) in fused.items() if target == module]
    return [".".join([*prefix, proj, kind]) for proj in parts] or [param]


def _is_mtp_layer(name: str, cfg: ModelConfig) -> bool:
    """A tensor of a layer past the decoder's (DeepSeek-style MTP layers follow them), or
    of Qwen3-Next's `mtp.*` module."""
    parts = name.split(".")
    past = parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= cfg.num_layers
    return past or parts[0] == "mtp"


def wanted_names(
    param: str, cfg: ModelConfig, fused: dict[str, tuple[str, int, int]], seen: set[str]
) -> list[str]:
    """The checkpoint tensors that fill `param`: stacked expert weights come either as
    such (transformers' own names) or one tensor per expert and projection (the Hub's)."""
    if cfg.moe is not None and ".experts." in param and param not in seen:
        return expert_checkpoint_names(param, cfg.moe.num_experts)
    return checkpoint_names(param, fused)


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    attention_backend: str = "torch",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """`quantization` (checked before anything loads, shared/model/quantize.py): "gguf"
    multiplies the GGUF's blocks as the file holds them (`path` a .gguf file, or a directory
    converted from one, which keeps it); "awq"/"gptq", or unset for a checkpoint whose
    config.json declares either, their int4 groups as Q4_1 blocks (awq_gptq.py);
    "int8"/"int4"/"fp8" quantize the loaded weights."""
    path = Path(path)
    method = served_quantization(path, quantization, device, dtype)
    blocks = _gguf_blocks(path) if method == "gguf" else {}
    cfg, tensors = _read_checkpoint(path)
    if method in INT4_CHECKPOINTS:
        layout = Int4Layout.from_config(method, quantization_config(path) or {})
        tensors = int4_weights(tensors, layout, blocks)
    backend = get_attention_backend(attention_backend, cfg, device, dtype)  # on the real device
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, backend)
        if cfg.vision is not None:  # Mistral3: the image encoder and projector
            model.vision = Mistral3Vision(cfg.vision)
    model.materialize(device, dtype)
    params = dict(model.named_parameters())
    fused = fused_slices(cfg)
    seen: set[str] = set()
    for name, tensor in tensors:
        if cfg.vision is not None:
            name = mistral3_parameter_name(name)
            if name.startswith("vision."):  # unfused: the encoder keeps q/k/v apart
                copy_into(params, {}, name, tensor)
                seen.add(name)
                continue
        name = name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        if _is_mtp_layer(name, cfg):
            continue  # the checkpoint's MTP layers: NEXTN's drafter reads them
        for part, value in checkpoint_parts(cfg, name, tensor):
            copy_into(params, fused, part, value)
            seen.add(part)
    missing = [c for n in params for c in wanted_names(n, cfg, fused, seen) if c not in seen]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"checkpoint lacks weights for {missing[:5]}{more}")
    if blocks:
        use_quant_blocks(model, blocks)
    if method in QUANTIZED_AT_LOAD:
        quantize_linears(model, method)
    return model.eval()


def _gguf_blocks(path: Path) -> QuantBlocks:
    """The quantized matrices `--quantization gguf` serves, checked before anything loads:
    from `path` itself (a .gguf) or the GGUF its conversion kept."""
    source = path if path.suffix == ".gguf" else path / SOURCE_GGUF
    if not source.is_file():
        raise ValueError(
            f"--quantization gguf multiplies a GGUF's blocks, and {path} holds no "
            f"{SOURCE_GGUF}: pass --model FILE.gguf"
        )
    return quantized_weights(gguf.GGUFReader(source))


def use_quant_blocks(model: LlamaForCausalLM, blocks: QuantBlocks) -> None:
    """Give every Linear whose checkpoint weights `blocks` holds (all parts of a fused one
    in one block type, see `_one_block_type`) those blocks, which it multiplies once packed;
    the others keep their weights."""
    cfg, fused = model.config, fused_slices(model.config)
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        tied = name == "lm_head" and cfg.tie_word_embeddings
        param = "embed_tokens.weight" if tied else f"{name}.weight"
        names = [
            c if c.startswith("lm_head") else f"model.{c}" for c in checkpoint_names(param, fused)
        ]
        parts = [blocks.get(n) for n in names]
        if None not in parts:
            module.quant_blocks = _one_block_type(parts)


def _one_block_type(
    parts: list[tuple[torch.Tensor, gguf.GGMLQuantizationType]],
) -> tuple[torch.Tensor, int] | None:
    """A fused Linear's parts' blocks as one matrix (rows concatenated: a row is whole
    blocks) in one block type: theirs, or Q8_0 where they mix Q8_0 with types it holds
    exactly (llama.cpp's Q4_K_M of a model whose rows are not whole 256-weight superblocks
    falls back to Q5_0 for q/k and Q8_0 for some v). Other mixes (Q4_K with Q6_K): None, the
    Linear keeps its fp32 weights."""
    kinds = {kind for _, kind in parts}
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    if len(kinds) > 1:
        if not kinds <= {q8_0, *HELD_BY_Q8_0}:
            return None
        parts = [(rows if kind == q8_0 else as_q8_0(rows, kind), q8_0) for rows, kind in parts]
    return torch.cat([rows for rows, _ in parts]), int(parts[0][1])


def save_model(model: LlamaForCausalLM, path: Path, hf_config: dict[str, Any]) -> None:
    """Write `model` as a Hugging Face Llama checkpoint in bf16 (`model.*` tensors, q/k/v and
    gate/up split again): `hf_config` with the model's own shape and layer count over it."""
    path.mkdir(parents=True, exist_ok=True)
    cfg, fused = model.config, fused_slices(model.config)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        for part, value in split_fused(name, tensor, fused):
            key = part if part.startswith("lm_head") else f"model.{part}"
            tensors[key] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = {
        **hf_config,
        **cfg.hf_shape(),
        "architectures": [cfg.architecture],
        "num_hidden_layers": cfg.num_layers,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "torch_dtype": "bfloat16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
