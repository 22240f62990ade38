"""What several test modules share: the prompt set, greedy settings, tiny random models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from specmesh.shared.sampling.params import SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Rewrite with snake_case names:\ndef getValue(myInput):\n    myResult = myInput * 2\n"
    "    return myResult",
    "Correct the grammar: she go to school every days and play with her freinds.",
    "Continue the list: apples, bananas, cherries, dates,",
    "Write a haiku about the sea.",
    "Explain recursion in one sentence.",
    "List the days of the week.",
    "Count from one to ten in words.",
    "Translate 'thank you very much' into French.",
    "What does HTTP stand for?",
    "Give three synonyms for happy.",
    "Write a Python function that returns the square of a number.",
    "Summarise: The cat sat on the mat. The cat was happy. The mat was red.",
    "Name the planets of the solar system in order.",
    "Say hello in five languages.",
    "What is 12 times 12?",
    "Describe a rainbow in two sentences.",
    "Fix the typo: teh weather is nice todya.",
    "Write the alphabet in capital letters.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
# A weather tool's parameters, bounded so that a small model's forced calls can finish.
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def tiny_llama(path: Path, vocab: int, seed: int, hidden: int = 32, layers: int = 1) -> str:
    """A small random Llama saved as an HF checkpoint (a draft model, or a tiny target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # peaky enough that drafts are sometimes right
    model.save_pretrained(path)
    return str(path)


# The draft layer of the published EAGLE heads for SmolLM2-135M (its target's hidden size
# and vocabulary).
SMOLLM_HEAD = {
    "hidden_size": 576,
    "intermediate_size": 256,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
    "vocab_size": 49152,
}


def write_eagle_head(
    path: Path,
    eagle3: bool,
    seed: int = 0,
    shape: dict[str, Any] = SMOLLM_HEAD,
    aux_layers: list[int] | None = None,
) -> str:
    """A head in the published EAGLE / EAGLE-3 layout, random weights: for SmolLM2-135M
    by default, or for a target of `shape` (its hidden size and vocabulary); `aux_layers`:
    the target layers an EAGLE-3 head reads, where the default ones do not fit."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    hidden, ffn, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv_heads, head_dim = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    draft_vocab = 4096
    config = {
        **shape,
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"],
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "float32",
    }
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    in_dim = 2 * hidden if eagle3 else hidden
    prefix = "midlayer." if eagle3 else "layers.0."
    w = {
        f"{prefix}self_attn.q_proj.weight": torch.randn(heads * head_dim, in_dim) * 0.05,
        f"{prefix}self_attn.k_proj.weight": torch.randn(kv_heads * head_dim, in_dim) * 0.05,
        f"{prefix}self_attn.v_proj.weight": torch.randn(kv_heads * head_dim, in_dim) * 0.05,
        f"{prefix}self_attn.o_proj.weight": torch.randn(hidden, heads * head_dim) * 0.05,
        f"{prefix}mlp.gate_proj.weight": torch.randn(ffn, hidden) * 0.05,
        f"{prefix}mlp.up_proj.weight": torch.randn(ffn, hidden) * 0.05,
        f"{prefix}mlp.down_proj.weight": torch.randn(hidden, ffn) * 0.05,
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
        f"{prefix}input_layernorm.weight": torch.ones(hidden),
    }
    if eagle3:
        kept = torch.randperm(vocab)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        w |= {
            "fc.weight": torch.randn(hidden, 3 * hidden) * 0.02,
            f"{prefix}hidden_norm.weight": torch.ones(hidden),
            "norm.weight": torch.ones(hidden),
            "lm_head.weight": torch.randn(draft_vocab, hidden) * 0.05,
            "d2t": kept - torch.arange(draft_vocab),
            "t2d": t2d,
        }
        config["draft_vocab_size"] = draft_vocab
        save_file(w, str(path / "model.safetensors"))
    else:
        w |= {"fc.weight": torch.randn(hidden, 2 * hidden) * 0.02, "fc.bias": torch.zeros(hidden)}
        torch.save(w, path / "pytorch_model.bin")
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def gguf_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's LlamaModel.permute (applied to Q and K rows of llama files)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def add_llama_metadata(writer: Any, config: Any) -> None:
    """The llama-family metadata a GGUF of a transformers model `config` carries (what
    convert_hf_to_gguf writes; `writer` a gguf.GGUFWriter)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
