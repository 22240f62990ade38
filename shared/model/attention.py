"""Paged attention behind a small backend interface.

A forward pass carries new tokens of many sequences flattened into one
`[T, heads, head_dim]` batch. Each sequence sees its cached prefix in full and
its new tokens through a mask: causal for prefill and decode, or any mask
("extend with a custom mask"), which is what tree verification needs.
The torch backend below is the CPU default; the GPU backends (`triton_attention.py`
over `kernels/triton`, `flashinfer_attention.py`) are imported only when asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from specmesh.shared.model.config import ModelConfig


@dataclass
class SequenceSpan:
    """One sequence's part of a forward pass."""

    block_table: list[int]
    num_cached: int  # tokens already in the KV cache (all visible to the new ones)
    num_new: int  # new tokens; their KV goes to cache slots num_cached .. num_cached+num_new-1
    mask: torch.Tensor | None = None  # [num_new, num_new] bool among new tokens; None = causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # Sequences with one causal new token (decode) attend in one padded batch.
    decode_rows: torch.Tensor | None  # [Bd] indices into the T new tokens
    decode_slots: torch.Tensor | None  # [Bd, max_ctx] context slots, padded
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_ctx] True = attend; None = all
    # Every other sequence attends on its own: (first row, rows, context slots, mask
    # [q, ctx], or None where its new rows are causal over a fully visible prefix).
    extends: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


class AttentionBackend(Protocol):
    """`prepare` returns the backend's own metadata (AttentionMetadata for the torch
    backend), which each layer's `forward` then receives."""

    def prepare(self, spans: list[SequenceSpan], block_size: int, device: torch.device) -> Any: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: Any,
    ) -> torch.Tensor: ...


def context_slots(block_table: list[int], length: int, block_size: int) -> torch.Tensor:
    blocks = torch.tensor(block_table[: (length + block_size - 1) // block_size], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
    return slots[:length]


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] in `dtype` (a --kv-cache-dtype cache is read back in the model's), via
    index_select, which is several times faster than advanced indexing."""
    rows = cache.index_select(0, slots.flatten()).view(*slots.shape, *cache.shape[1:])
    return rows.to(dtype)


def _store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache[slots] = rows, cast to the cache's dtype (--kv-cache-dtype) and saturated to its
    range: fp8 with a scale of 1.0, as SGLang's default without scales."""
    if rows.dtype != cache.dtype:
        info = torch.finfo(cache.dtype)
        rows = rows.clamp(info.min, info.max).to(cache.dtype)
    if cache.element_size() == 1:  # index_copy_ has no CPU fp8 kernel: move the bytes
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    cache.index_copy_(0, slots, rows)


class TorchAttention:
    """Plain-torch paged attention (scaled_dot_product_attention over gathered slots)."""

    def prepare(
        self, spans: list[SequenceSpan], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        slot_mapping, decode_rows, decode_ctx, extends = [], [], [], []
        row = 0
        for span in spans:
            total = span.num_cached + span.num_new
            slots = context_slots(span.block_table, total, block_size)
            slot_mapping.append(slots[span.num_cached :])
            if span.num_new == 1 and span.mask is None:
                decode_rows.append(row)
                decode_ctx.append(slots)
            else:
                mask = None
                if span.mask is not None or device.type != "cpu":
                    mask = torch.ones(span.num_new, total, dtype=torch.bool).tril(span.num_cached)
                    if span.mask is not None:
                        mask[:, span.num_cached :] = span.mask.cpu()
                extends.append((row, span.num_new, slots.to(device), _to(mask, device)))
            row += span.num_new
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_mapping).to(device),
            decode_rows=None,
            decode_slots=None,
            decode_mask=None,
            extends=extends,
        )
        if decode_rows:
            lengths = torch.tensor([len(s) for s in decode_ctx])
            padded = torch.nn.utils.rnn.pad_sequence(decode_ctx, batch_first=True)
            mask = torch.arange(padded.shape[1])[None, :] < lengths[:, None]
            meta.decode_rows = torch.tensor(decode_rows, device=device)
            meta.decode_slots = padded.to(device)
            if not mask.all():  # sequences of one length need no mask
                meta.decode_mask = mask[:, None, None, :].to(device)
        return meta

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H*D]."""
        _store(k_cache, meta.slot_mapping, k)
        _store(v_cache, meta.slot_mapping, v)
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = k.shape[1]
        group = num_heads // kv_heads
        od = None
        if meta.decode_rows is not None:
            # One query per sequence: a KV group's query heads act as `group` query rows.
            # In a pure decode step every row is a decode row, in order: no gather needed.
            qd = q[meta.decode_rows] if meta.extends else q
            qd = qd.view(-1, kv_heads, group, head_dim)
            kd, vd = (
                _gather(c, meta.decode_slots, q.dtype).transpose(1, 2) for c in (k_cache, v_cache)
            )
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
            if not meta.extends:
                return od.reshape(num_tokens, num_heads * head_dim)
        out = q.new_empty(num_tokens, num_heads, head_dim)
        if od is not None:
            out[meta.decode_rows] = od.reshape(-1, num_heads, head_dim)
        for start, n, slots, mask in meta.extends:
            ke, ve = (_gather(c, slots, q.dtype).transpose(0, 1) for c in (k_cache, v_cache))
            qe = q[start : start + n]
            out[start : start + n] = (
                _causal_over_prefix(qe, ke, ve) if mask is None else _masked(qe, ke, ve, mask)
            )
        return out.view(num_tokens, num_heads * head_dim)


def _to(mask: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if mask is None else mask.to(device)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[n, H, D] -> [1, KVH, group * n, D]: the query heads of each KV group folded into
    rows (head kv * group + g, row i at g * n + i), so K/V need no repeat."""
    n, heads, dim = q.shape
    return (
        q.view(n, kv_heads, heads // kv_heads, dim)
        .permute(1, 2, 0, 3)
        .reshape(1, kv_heads, -1, dim)
    )


def _ungrouped(o: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `_grouped` for outputs: [..., KVH, group * n, D] -> [n, H, D]."""
    return o.reshape(-1, n, o.shape[-1]).transpose(0, 1)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] over k, v [KVH, ctx, D] through mask [n, ctx]. 4-D, so that CPU SDPA
    takes its tiled (flash) kernel rather than one that materializes all scores."""
    group = q.shape[1] // k.shape[0]
    o = F.scaled_dot_product_attention(
        _grouped(q, k.shape[0]), k[None], v[None], attn_mask=mask.repeat(group, 1)
    )
    return _ungrouped(o, len(q))


def _causal_over_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """New rows q [n, H, D] causal among themselves over a prefix they all see (k, v
    [KVH, ctx, D], the new tokens last), with no mask at all: the unmasked prefix and the
    causal diagonal block each through CPU's flash kernel, which returns its log-sum-exp
    L per row, merged as o = o1 e^(L1 - L) + o2 e^(L2 - L) with L = log(e^L1 + e^L2)."""
    n, heads, _ = q.shape
    kv_heads = k.shape[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    group = heads // kv_heads
    kd, vd = (x[:, -n:].repeat_interleave(group, 0)[None] for x in (k, v))
    o2, l2 = flash(q.transpose(0, 1)[None], kd, vd, 0.0, True)  # [1, H, n, D], [1, H, n]
    o2, l2 = o2[0].transpose(0, 1), l2[0].transpose(0, 1)
    if k.shape[1] == n:
        return o2
    o1, l1 = flash(_grouped(q, kv_heads), k[None, :, :-n], v[None, :, :-n], 0.0, False)
    o1, l1 = _ungrouped(o1, n), _ungrouped(l1[..., None], n)[..., 0]
    lse = torch.logaddexp(l1, l2)
    return o1 * (l1 - lse).exp()[..., None] + o2 * (l2 - lse).exp()[..., None]


# Backends by name, each imported only when chosen, so CPU use never needs a GPU backend's
# packages. GPU backends are built for one model (their plans need its heads) on one device and
# dtype, and refuse there, at start-up, what they cannot run.
_BACKENDS = {
    "torch": "specmesh.shared.model.attention:TorchAttention",
    "triton": "specmesh.shared.model.triton_attention:TritonAttention",
    "flashinfer": "specmesh.shared.model.flashinfer_attention:FlashInferAttention",
}
ATTENTION_BACKENDS = tuple(_BACKENDS)


def get_attention_backend(
    name: str = "torch",
    cfg: ModelConfig | None = None,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> AttentionBackend:
    try:
        module, cls = _BACKENDS[name].split(":")
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}"
        ) from None
    try:
        backend = getattr(importlib.import_module(module), cls)
    except ImportError as exc:  # a GPU backend's package (Triton) is not installed
        raise ValueError(f"the {name} attention backend cannot be loaded here: {exc}") from exc
    return TorchAttention() if backend is TorchAttention else backend(cfg, device, dtype)
