"""The decoder's forward in one call into the C++ CPU kernel (`kernels/cpu/decoder.cpp`):
the same blocked matmuls as the packed `Linear`s, with no Python between them and
attention reading the paged cache in place (tiled for prefill chunks, row by row for
decode rows and draft trees). Same maths as `LlamaForCausalLM.forward`, and as an EAGLE-3
head's layer (`EagleHead.decode`), whose attention also reads the normed feature."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.layers import Linear, RMSNorm
from specmesh.shared.model.llama import LlamaForCausalLM
from torch import nn

KVLayers = Sequence[tuple[torch.Tensor, ...]]
NO_MASKS = torch.empty(0, dtype=torch.bool)
NO_FEATURES = torch.empty(0)


def _linears(layer: nn.Module) -> tuple[Linear, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _weights(layer: nn.Module) -> list[torch.Tensor]:
    """The 10 tensors decoder.cpp reads per layer (packed matmul weights; an absent bias
    is an empty tensor)."""
    linears = _linears(layer)
    none = torch.empty(0)
    qkv, o, gate_up, down = ((m.packed, none if m.bias is None else m.bias) for m in linears)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    return [norms[0], *qkv, *o, norms[1], *gate_up, *down]


def _kernel(
    cfg: ModelConfig,
    layers: Sequence[nn.Module],
    kv_layers: KVLayers,
    embedding: torch.Tensor,
    kernel: object | None,
) -> object | None:
    """`kernel` (default: this checkout's compiled kernels) where it computes these layers,
    else None (layers other than plain Llama ones: Qwen3's q/k norms, routed experts; a
    head size not a multiple of 8; unpacked weights: not fp32 on CPU; a KV cache or
    embedding not in fp32, which the kernel reads in place; no compiled kernel)."""
    if cfg.qk_norm or cfg.moe is not None or cfg.linear is not None:
        return None  # decoder.cpp computes plain Llama layers only
    if cfg.head_dim % 8:
        return None  # its attention reads heads 8 floats at a time
    if any(m.packed is None for layer in layers for m in _linears(layer)):
        return None
    if any(t.dtype != torch.float32 for kv in kv_layers for t in kv):
        return None
    if embedding.dtype != torch.float32 or embedding.device.type != "cpu":
        return None
    from specmesh.kernels.cpu import load

    return kernel or load()


def _span_table(
    spans: list[SequenceSpan], block_size: int
) -> tuple[list[int], list[int], torch.Tensor]:
    """decoder.cpp's view of a step's spans: the [count * 5] table (first row, new rows,
    cached tokens, offset into the block ids, offset into the masks or -1), each span's
    block ids (as many as its tokens fill; decoder.cpp derives the slots from them) and the
    flattened masks."""
    table, block_ids, masks = [], [], []
    row = mask_offset = 0
    for span in spans:
        total = span.num_cached + span.num_new
        blocks = -(-total // block_size)
        if len(span.block_table) < blocks:  # the kernel trusts its slots: never past them
            raise IndexError(f"block table of {len(span.block_table)} blocks < {total} tokens")
        mask_at = -1
        if span.mask is not None:
            mask_at, mask_offset = mask_offset, mask_offset + span.num_new**2
            masks.append(span.mask.flatten())
        table += (row, span.num_new, span.num_cached, len(block_ids), mask_at)
        block_ids += span.block_table[:blocks]
        row += span.num_new
    return table, block_ids, torch.cat(masks) if masks else NO_MASKS


class FusedDecoder:
    """Decoder layers and their KV caches held by the C++ decoder, which reads them in place."""

    def __init__(
        self,
        kernel: object,
        cfg: ModelConfig,
        layers: Sequence[nn.Module],
        norm: RMSNorm,
        kv_layers: KVLayers,
        embedding: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        feature_norm: RMSNorm | None = None,
        lm_head: Linear | None = None,
    ) -> None:
        weights = [[w.detach() for w in _weights(layer)] for layer in layers]
        none = torch.empty(0)
        self.has_lm_head = lm_head is not None
        self.decoder = kernel.Decoder(
            [w + list(kv) for w, kv in zip(weights, kv_layers, strict=True)],
            [[m.block_type for m in _linears(layer)] for layer in layers],
            embedding.detach().contiguous(),
            norm.weight.detach(),
            none if feature_norm is None else feature_norm.weight.detach(),
            *(t.reshape(-1, cfg.head_dim).contiguous() for t in rope),  # [positions, dim]
            none if lm_head is None else lm_head.packed,
            0 if lm_head is None else lm_head.block_type,
            0 if lm_head is None else lm_head.out_features,
            cfg.rms_norm_eps,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_layers: KVLayers, kernel: object | None = None
    ) -> FusedDecoder | None:
        """A fused decoder for this model once `pack_linears` packed it, or None where the
        kernel does not apply (`_kernel`). `kernel`: another build of the kernels (a
        benchmark comparing builds)."""
        embedding = model.embed_tokens.weight
        kernel = _kernel(model.config, model.layers, kv_layers, embedding, kernel)
        if kernel is None:
            return None
        rope = (model.rope_cos, model.rope_sin)
        head = model.lm_head if model.lm_head.packed is not None else None
        layers, norm = model.layers, model.norm
        return cls(kernel, model.config, layers, norm, kv_layers, embedding, rope, None, head)

    @classmethod
    def eagle3(
        cls, head: nn.Module, kv_layers: KVLayers, embedding: torch.Tensor
    ) -> FusedDecoder | None:
        """An EAGLE-3 head's layer (`EagleHead`, packed), its `norm` the final one, its
        tokens looked up in `embedding`; None where the kernel does not apply."""
        kernel = _kernel(head.config, [head], kv_layers, embedding, None)
        if kernel is None:
            return None
        rope = (head.rope_cos, head.rope_sin)
        feature_norm = head.hidden_norm
        return cls(kernel, head.config, [head], head.norm, kv_layers, embedding, rope, feature_norm)

    def forward(
        self,
        ids: list[int],
        positions: list[int],
        spans: list[SequenceSpan],
        block_size: int,
        out_rows: list[int],
        aux_layers: tuple[int, ...] = (),
        features: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """As `LlamaForCausalLM.forward` from token ids [T] (and an EAGLE-3 head's features
        [T, hidden]), but the hidden states only at `out_rows` ([R] row indices): the last
        layer skips the other rows past their K and V. Returns those rows final-normed
        (their logits where the decoder holds the model's LM head, `has_lm_head`) and
        before the norm, and the aux layers' outputs (all rows)."""
        table, block_ids, masks = _span_table(spans, block_size)
        out = self.decoder.forward(
            ids,
            NO_FEATURES if features is None else features,
            positions,
            table,
            block_ids,
            block_size,
            masks,
            list(aux_layers),
            out_rows,
        )
        return out[0], out[1], out[2:]
