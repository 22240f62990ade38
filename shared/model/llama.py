"""Llama-family decoder (Llama, Mistral, Qwen2, SmolLM, Qwen3, Qwen3-MoE, Qwen3-Next) over a
paged KV cache. Qwen3 adds per-head q/k RMSNorms before RoPE; Qwen3-MoE also swaps some
layers' MLP for routed experts (`shared/model/moe.py`); Qwen3-Next mixes tokens in most
layers by Gated DeltaNet over a recurrent state (`shared/model/gated_deltanet.py`) and gates
its attention output, rotating only part of each head.

Tokens of all sequences in a step are flattened into one batch `[T]`; the
attention metadata says which cache slots each sequence reads and writes.
Q/K/V and gate/up projections are fused into single matmuls (fewer kernel
launches per layer), and the loader splices checkpoint weights into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specmesh.shared.model.attention import AttentionBackend, AttentionMetadata
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.gated_deltanet import GatedDeltaNet, LinearMetadata, LinearStates
from specmesh.shared.model.layers import MLP, Linear, RMSNorm
from specmesh.shared.model.moe import MoE
from specmesh.shared.model.rope import apply_rope, rope_cos_sin
from torch import nn


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
        self.rope_dim = cfg.rope_dim
        # Qwen3-Next gates the output per channel: the gate's rows follow v's (the loader
        # takes them out from between q_proj's heads).
        self.gate_size = self.q_size if cfg.attn_output_gate else 0
        # EAGLE-3 heads attend over [token embedding; feature], twice the hidden size.
        qkv_out = self.q_size + 2 * self.kv_size + self.gate_size
        self.qkv_proj = Linear(in_features or cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = backend

    def rotated_qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D], q and k rotated to their positions."""
        return self._split_rotate(self.qkv_proj(x), cos, sin)

    def unrotated_keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k and v [T, kv_size] of x before any norm or rotation, from their rows of
        `qkv_proj` alone: for entries only attended to (training's context)."""
        rows = slice(self.q_size, self.q_size + 2 * self.kv_size)
        bias = self.qkv_proj.bias
        kv = F.linear(x, self.qkv_proj.weight[rows], None if bias is None else bias[rows])
        k, v = kv.split(self.kv_size, dim=-1)
        return k, v

    def _split_rotate(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # q and k heads side by side [T, H + KVH, D]: one rotation for both
        qk_end = self.q_size + self.kv_size
        qk = qkv[:, :qk_end].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: each head RMS-normed over D, before RoPE
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        if self.rope_dim < self.head_dim:  # partial rotary: the leading dims of each head
            rotated = apply_rope(qk[..., : self.rope_dim], cos, sin)
            qk = torch.cat([rotated, qk[..., self.rope_dim :]], dim=-1)
        else:
            qk = apply_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, qk_end : qk_end + self.kv_size].view(-1, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        out = self.backend.forward(*self._split_rotate(qkv, cos, sin), *kv_cache, meta)
        if self.gate_size:
            gate = qkv[:, self.q_size + 2 * self.kv_size :]
            out = out.view(len(x), -1) * torch.sigmoid(gate)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Token mixing: paged attention, or (Qwen3-Next) a Gated DeltaNet over a state.
        self.self_attn = self.linear_attn = None
        if cfg.is_linear_layer(index):
            self.linear_attn = GatedDeltaNet(cfg, index)
        else:
            self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: tuple[torch.Tensor, torch.Tensor] | LinearStates,
        meta: AttentionMetadata,
        linear: LinearMetadata | None = None,
    ) -> torch.Tensor:
        """`cache`: the layer's K/V, or its state slots for a linear-attention layer."""
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(h, cache, linear)
        else:
            x = x + self.self_attn(h, cos, sin, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.attention_backend = backend  # what every attention layer runs on
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
            cfg.rope_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        weight = self.embed_tokens.weight  # the tables live where and as the weights do
        self.register_buffer("rope_cos", cos.to(weight.device, weight.dtype), persistent=False)
        self.register_buffer("rope_sin", sin.to(weight.device, weight.dtype), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor] | LinearStates],
        meta: AttentionMetadata,
        aux_layers: tuple[int, ...] = (),
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
        linear: LinearMetadata | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final-normed hidden states [T, hidden] and the residual
        stream after each layer index in `aux_layers`, in that order (EAGLE features).
        `embeds`: (rows [R], vectors [R, hidden]) that replace those rows' token embeddings
        (image features at image-token rows). `linear`: the step's metadata for
        linear-attention layers (hybrid models)."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = self.embed_tokens(input_ids)
        if embeds is not None:
            rows, vectors = embeds
            x = x.index_copy(0, rows, vectors.to(x.dtype))
        aux = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_caches[i], meta, linear)
            if i in aux_layers:
                aux[i] = x
        return self.norm(x), [aux[i] for i in aux_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
