"""The decoder's forward in one call into the C++ CPU kernel (`kernels/cpu/decoder.cpp`):
the same blocked matmuls as the packed `Linear`s, with no Python between them and
attention reading the paged cache in place (tiled for prefill chunks, row by row for
decode rows and draft trees). Same maths as `LlamaForCausalLM.forward`."""

from __future__ import annotations

import torch
from specmesh.shared.model.attention import SequenceSpan, context_slots
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.llama import LlamaForCausalLM
from torch import nn


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


class FusedDecoder:
    """A model's layers and KV caches held by the C++ decoder, which reads them in place."""

    def __init__(
        self, kernel: object, model: LlamaForCausalLM, kv_layers: list[tuple[torch.Tensor, ...]]
    ) -> None:
        cfg = model.config
        layers = [
            [w.detach() for w in _weights(layer)] + list(kv)
            for layer, kv in zip(model.layers, kv_layers, strict=True)
        ]
        self.model = model
        self.decoder = kernel.Decoder(
            layers,
            [[m.block_type for m in _linears(layer)] for layer in model.layers],
            model.norm.weight.detach(),
            cfg.rms_norm_eps,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )

    @classmethod
    def build(
        cls, model: LlamaForCausalLM, kv_layers: list[tuple[torch.Tensor, ...]]
    ) -> FusedDecoder | None:
        """A fused decoder for this model once `pack_linears` packed it, or None where the
        kernel does not apply (layers other than plain Llama ones: Qwen3's q/k norms,
        routed experts; a head size not a multiple of 8; unpacked weights: not fp32 on
        CPU; a KV cache not in fp32, which the kernel reads in place; no compiled kernel)."""
        cfg = model.config
        if cfg.qk_norm or cfg.moe is not None or cfg.linear is not None:
            return None  # decoder.cpp computes plain Llama layers only
        if cfg.head_dim % 8:
            return None  # its attention reads heads 8 floats at a time
        linears = [m for m in model.layers.modules() if isinstance(m, Linear)]
        if any(m.packed is None for m in linears):
            return None
        if any(t.dtype != torch.float32 for kv in kv_layers for t in kv):
            return None
        from specmesh.kernels.cpu import load

        kernel = load()
        return None if kernel is None else cls(kernel, model, kv_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        spans: list[SequenceSpan],
        block_size: int,
        out_rows: torch.Tensor,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """As `LlamaForCausalLM.forward`, but the final hidden states only at `out_rows`
        ([R] row indices): the last layer skips the other rows past their K and V."""
        table, slots, new_slots, masks = [], [], [], []
        row = slot_offset = mask_offset = 0
        for span in spans:
            total = span.num_cached + span.num_new
            ctx = context_slots(span.block_table, total, block_size)
            if len(ctx) < total:  # the kernel trusts its slots: never let it write past them
                raise IndexError(f"block table of {len(span.block_table)} blocks < {total} tokens")
            mask_at = -1
            if span.mask is not None:
                mask_at, mask_offset = mask_offset, mask_offset + span.num_new**2
                masks.append(span.mask.flatten())
            table.append((row, span.num_new, span.num_cached, slot_offset, mask_at))
            slots.append(ctx)
            new_slots.append(ctx[span.num_cached :])
            row, slot_offset = row + span.num_new, slot_offset + total
        model = self.model
        head_dim = model.config.head_dim
        cos = model.rope_cos[positions].view(-1, head_dim)
        sin = model.rope_sin[positions].view(-1, head_dim)
        out = self.decoder.forward(
            model.embed_tokens(input_ids),
            cos,
            sin,
            torch.cat(new_slots),
            torch.tensor(table, dtype=torch.long),
            torch.cat(slots),
            torch.cat(masks) if masks else torch.empty(0, dtype=torch.bool),
            list(aux_layers),
            out_rows,
        )
        return out[0], out[1:]
