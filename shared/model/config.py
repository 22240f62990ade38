"""Model architecture settings read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from specmesh.shared.model.vision_config import VisionConfig

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM",
    "Mistral3ForConditionalGeneration",
)
# Architectures whose attention RMS-normalises each query and key head before RoPE.
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM")
# Architectures mixing Gated DeltaNet layers with gated full attention.
HYBRID_ARCHITECTURES = ("Qwen3NextForCausalLM",)
# Architectures whose RMSNorms scale by (1 + weight): the loader adds the 1 once.
OFFSET_NORM_ARCHITECTURES = ("Qwen3NextForCausalLM",)


@dataclass(frozen=True)
class MoEConfig:
    """Top-k routed experts (Qwen3-MoE): no shared expert; `sparse_layers` are the layers
    whose MLP is the routed one (the others keep the dense `intermediate_size` MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...]
    shared_expert_size: int = 0  # a shared SwiGLU expert under a sigmoid gate (Qwen3-Next)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        # As transformers' Qwen3MoeDecoderLayer: every `decoder_sparse_step`-th layer,
        # less `mlp_only_layers`.
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        # Hub configs say num_experts; transformers>=5 writes num_local_experts.
        num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
        sparse = tuple(
            i
            for i in range(cfg["num_hidden_layers"])
            if i not in dense and num_experts > 0 and (i + 1) % step == 0
        )
        return cls(
            num_experts=num_experts,
            top_k=cfg["num_experts_per_tok"],
            intermediate_size=cfg["moe_intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", False),
            sparse_layers=sparse,
            shared_expert_size=cfg.get("shared_expert_intermediate_size", 0),
        )


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet token mixing (Qwen3-Next's `linear_attention` layers): a short causal
    convolution, then a delta-rule recurrent state [v_heads, head_k_dim, head_v_dim] per
    sequence in place of a KV cache."""

    layers: tuple[int, ...]  # the layers that mix tokens this way
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LinearAttentionConfig:
        types = cfg.get("layer_types") or [
            "full_attention"
            if (i + 1) % cfg.get("full_attention_interval", 4) == 0
            else "linear_attention"
            for i in range(cfg["num_hidden_layers"])
        ]
        if cfg["linear_num_value_heads"] % cfg["linear_num_key_heads"]:
            raise ValueError(
                "linear_num_value_heads must be a multiple of linear_num_key_heads (each key "
                f"head serves a group of value heads), not {cfg['linear_num_value_heads']} "
                f"and {cfg['linear_num_key_heads']}"
            )
        return cls(
            layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
            num_k_heads=cfg["linear_num_key_heads"],
            num_v_heads=cfg["linear_num_value_heads"],
            head_k_dim=cfg["linear_key_head_dim"],
            head_v_dim=cfg["linear_value_head_dim"],
            conv_kernel=cfg["linear_conv_kernel_dim"],
        )

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values side by side."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim

    @property
    def state_elements(self) -> int:
        """Elements of one sequence's state in one layer: conv window and recurrent state."""
        conv = self.conv_dim * (self.conv_kernel - 1)
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim


def _refuse_sliding_window(arch: str, cfg: dict[str, Any]) -> None:
    """Sliding-window attention is not implemented: refuse configs that turn it on."""
    sliding = cfg.get("use_sliding_window", False) or "sliding_attention" in (
        cfg.get("layer_types") or ()
    )
    if sliding:
        raise ValueError(
            f"{arch} with sliding-window attention (use_sliding_window / layer_types) "
            "is not supported; only full attention is"
        )


def _mistral3(cls: type[ModelConfig], cfg: dict[str, Any]) -> ModelConfig:
    """A Mistral text model (`text_config`) with the image path (`vision_config`)."""
    text = {"eos_token_id": cfg.get("eos_token_id"), "bos_token_id": cfg.get("bos_token_id")}
    text |= {**cfg["text_config"], "architectures": ["MistralForCausalLM"]}
    text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    arch = "Mistral3ForConditionalGeneration"
    return replace(cls.from_hf(text), architecture=arch, vision=VisionConfig.from_hf(cfg))


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    moe: MoEConfig | None = None  # routed experts (Qwen3-MoE); None: every MLP is dense
    vision: VisionConfig | None = None  # Mistral3's image encoder; None: text only
    linear: LinearAttentionConfig | None = None  # Gated DeltaNet layers (Qwen3-Next)
    rotary_dim: int = 0  # leading dims of each head that RoPE rotates; 0: all (`rope_dim`)
    attn_output_gate: bool = False  # attention output times sigmoid(gate from q_proj)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "Mistral3ForConditionalGeneration":
            return _mistral3(cls, cfg)
        _refuse_sliding_window(arch, cfg)
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = cfg.get("rope_scaling")
        # transformers>=5 folds rope_theta into rope_parameters.
        rope_params = cfg.get("rope_parameters") or {}
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases and no o_proj bias; Llama's attention_bias
            # covers all four projections.
            qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
            o_proj_bias=arch != "Qwen2ForCausalLM" and cfg.get("attention_bias", False),
            mlp_bias=cfg.get("mlp_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            moe=MoEConfig.from_hf(cfg) if arch in MOE_ARCHITECTURES else None,
            linear=LinearAttentionConfig.from_hf(cfg) if arch in HYBRID_ARCHITECTURES else None,
            rotary_dim=int(
                head_dim
                * cfg.get("partial_rotary_factor", rope_params.get("partial_rotary_factor", 1.0))
            ),
            attn_output_gate=arch in HYBRID_ARCHITECTURES,
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_hf(json.loads(Path(path).read_text()))

    def hf_shape(self) -> dict[str, Any]:
        """The decoder's shape under config.json's keys (what a saved drafter's config
        repeats of its layers)."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
        }

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on queries and keys before RoPE (Qwen3's `q_norm`, `k_norm`).
        Follows `architecture`, so a Llama-architecture copy of the config drops it."""
        return self.architecture in QK_NORM_ARCHITECTURES

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def rope_dim(self) -> int:
        return self.rotary_dim or self.head_dim

    def is_linear_layer(self, layer: int) -> bool:
        return self.linear is not None and layer in self.linear.layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with full attention, hence with K/V in the paged cache."""
        return tuple(i for i in range(self.num_layers) if not self.is_linear_layer(i))

    @property
    def attention_tokens(self) -> int:
        """Tokens of context that one token attends over for the work of its matmuls:
        multiply-adds per token of every layer's projections and (dense) MLP, over those
        per context token of the attention layers (2 x heads x head_dim: q.k and p.v).
        The scheduler weighs prompt chunks by it."""
        q_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_context_token = 2 * self.num_heads * self.head_dim * len(self.attention_layers)
        return max(1, (q_o + k_v + mlp) * self.num_layers // per_context_token)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token occupies across all layers (times dtype size = bytes)."""
        return len(self.attention_layers) * 2 * self.num_kv_heads * self.head_dim
