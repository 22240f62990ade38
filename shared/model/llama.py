"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM, Qwen3, Qwen3-MoE) over a paged
KV cache. Qwen3 adds per-head q/k RMSNorms before RoPE; Qwen3-MoE also swaps some layers'
MLP for routed experts (`shared/model/moe.py`).

Tokens of all sequences in a step are flattened into one batch `[T]`; the
attention metadata says which cache slots each sequence reads and writes.
Q/K/V and gate/up projections are fused into single matmuls (fewer kernel
launches per layer), and the loader splices checkpoint weights into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.cpu import load as load_cpu_kernels
from shared.model.attention import AttentionBackend, AttentionMetadata
from shared.model.config import ModelConfig
from shared.model.moe import MoE
from shared.model.rope import apply_rope, rope_cos_sin


class Linear(nn.Linear):
    """nn.Linear that, once packed for inference, multiplies through the CPU kernel's
    column-blocked weight (kernels/cpu/matmul.cpp)."""

    packed: torch.Tensor | None = None

    def pack(self, keep_weight: bool) -> None:
        """Inference only (the packed path has no autograd). fp32 on CPU, where it is measured."""
        weight = self.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return
        kernel = load_cpu_kernels()
        if kernel is None:
            return
        self.packed = kernel.block_weight(weight.detach())
        if not keep_weight:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        bias = torch.empty(0) if self.bias is None else self.bias
        rows = x.reshape(-1, self.in_features).contiguous()
        y = load_cpu_kernels().blocked_linear(rows, self.packed, self.out_features, bias, None)
        return y.view(*x.shape[:-1], self.out_features)


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
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, in_features: int | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        # EAGLE-3 heads attend over [token embedding; feature], twice the hidden size.
        qkv_out = self.q_size + 2 * self.kv_size
        self.qkv_proj = Linear(in_features or cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D], q and k rotated to their positions."""
        qkv = self.qkv_proj(x)
        # q and k heads side by side [T, H + KVH, D]: one rotation for both
        qk = qkv[:, : self.q_size + self.kv_size].view(
            -1, self.num_heads + self.num_kv_heads, self.head_dim
        )
        if self.q_norm is not None:  # Qwen3: each head RMS-normed over D, before RoPE
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.o_proj(self.backend.forward(*self.rotated_qkv(x, cos, sin), *kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        bias = cfg.mlp_bias
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._tie_and_build_rope()

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Give a model built on the meta device real (uninitialised) storage."""
        self.to_empty(device=device)
        self.to(dtype)
        self._tie_and_build_rope()

    def _tie_and_build_rope(self) -> None:
        cfg = self.config
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_cos_sin(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        dtype = self.embed_tokens.weight.dtype
        self.register_buffer("rope_cos", cos.to(dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-normed hidden states [T, hidden] and the residual
        stream after each layer index in `aux_layers`, in that order (EAGLE features)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed_tokens(input_ids)
        aux = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], meta)
            if i in aux_layers:
                aux[i] = x
        return self.norm(x), [aux[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
