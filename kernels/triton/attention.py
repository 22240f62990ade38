"""Paged attention for a step's new tokens, causal or through a draft tree's mask.

The contract of `shared.model.attention.TorchAttention`: the new tokens of many sequences are
one `[T, H, D]` batch; a query row sees every cached token of its sequence and the sequence's
new tokens either causally or through the sequence's `[n, n]` boolean mask (a draft tree's
ancestor mask, each node at its own position); K/V come from the paged cache
`[num_slots, KVH, D]` through the sequence's block table. Prefill chunks, tree verification
and decode rows run in one launch.

A program takes a tile of one sequence's new tokens and one KV head; the `group` query heads
sharing that head are extra query rows (GQA without repeating K/V). It walks the visible
context in blocks of positions with the online softmax (fp32):
    s = q k^T * scale;  m' = max(m, rowmax s);  l = l e^(m-m') + sum e^(s-m');
    acc = acc e^(m-m') + e^(s-m') v;  out = acc / l.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

import torch
import triton
import triton.language as tl

BLOCK_N = 32  # context positions per step of a program's loop
ROWS = 64  # query rows a program aims for (tokens x group)


class SpanLike(Protocol):
    """`shared.model.attention.SequenceSpan`, without importing shared (which sits above)."""

    block_table: list[int]
    num_cached: int
    num_new: int
    mask: torch.Tensor | None  # [num_new, num_new] bool; None = causal


@dataclass
class AttentionPlan:
    """A step's spans as device tensors: built once per step, used by every layer."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token (its K/V goes there)
    q_start: torch.Tensor  # [S] int32: the sequence's first row among the T new tokens
    num_cached: torch.Tensor  # [S] int32
    num_new: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    mask_offset: torch.Tensor  # [S] int64: its [n, n] mask's start in `masks`; -1 = causal
    masks: torch.Tensor  # [sum n*n] int8: the masked sequences' masks, row-major
    tile_seq: torch.Tensor  # [tiles] int32: the sequence of each program's tile of new tokens
    tile_first: torch.Tensor  # [tiles] int32: the tile's first new token in that sequence
    block_size: int
    group: int  # query heads per KV head
    tile_tokens: int  # new tokens per tile


def new_slots(span: SpanLike, block_size: int) -> torch.Tensor:
    """[num_new] cache slots of positions num_cached .. num_cached + num_new - 1."""
    pos = torch.arange(span.num_cached, span.num_cached + span.num_new)
    table = torch.tensor(span.block_table, dtype=torch.long)
    return table[pos // block_size] * block_size + pos % block_size


def plan_attention(
    spans: Sequence[SpanLike], block_size: int, group: int, device: torch.device | str
) -> AttentionPlan:
    """What `paged_attention` reads for `spans`, as `TorchAttention.prepare` is for its
    forward; `group` (query heads per KV head) sets how many new tokens a tile takes."""
    tile_tokens = min(max(1, ROWS // group), max(s.num_new for s in spans))
    news = [s.num_new for s in spans]
    starts = [0, *accumulate(news)][:-1]
    tiles = [(i, f) for i, s in enumerate(spans) for f in range(0, s.num_new, tile_tokens)]
    offsets, masks, used = [], [], 0
    for s in spans:
        offsets.append(-1 if s.mask is None else used)
        if s.mask is not None:
            masks.append(s.mask.to(device="cpu", dtype=torch.int8).flatten())
            used += s.num_new**2
    width = max(len(s.block_table) for s in spans)
    tables = [s.block_table + [0] * (width - len(s.block_table)) for s in spans]

    def ints(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    return AttentionPlan(
        slot_mapping=torch.cat([new_slots(s, block_size) for s in spans]).to(device),
        q_start=ints(starts, torch.int32),
        num_cached=ints([s.num_cached for s in spans], torch.int32),
        num_new=ints(news, torch.int32),
        block_tables=ints(tables, torch.int32),
        mask_offset=ints(offsets, torch.int64),
        masks=torch.cat(masks or [torch.zeros(1, dtype=torch.int8)]).to(device),
        tile_seq=ints([t[0] for t in tiles], torch.int32),
        tile_first=ints([t[1] for t in tiles], torch.int32),
        block_size=block_size,
        group=group,
        tile_tokens=tile_tokens,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D], written to the caches [num_slots, KVH, D] first.
    Returns [T, H*D], as `TorchAttention.forward`."""
    k_cache.index_copy_(0, plan.slot_mapping, k)
    v_cache.index_copy_(0, plan.slot_mapping, v)
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if num_heads != plan.group * kv_heads or q.stride(2) != 1 or k_cache.stride(2) != 1:
        raise ValueError("heads do not match the plan's group, or head_dim is not contiguous")
    out = q.new_empty(num_tokens, num_heads, head_dim)
    _attention_kernel[(plan.tile_seq.numel(), kv_heads)](
        q, k_cache, v_cache, out,
        plan.q_start, plan.num_cached, plan.num_new, plan.block_tables,
        plan.mask_offset, plan.masks, plan.tile_seq, plan.tile_first,
        head_dim**-0.5, head_dim, plan.block_tables.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=plan.group,
        TILE_TOKENS=plan.tile_tokens,
        PAGE=plan.block_size,
        BLOCK_R=max(16, triton.next_power_of_2(plan.tile_tokens * plan.group)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 rounding
    )  # fmt: skip
    return out.view(num_tokens, num_heads * head_dim)


@triton.jit
def _visible(pos, pos_ok, token, row_ok, cached, new, mask_offset, masks_ptr):
    """[BLOCK_R, BLOCK_N] bool: which context positions `pos` each query row attends to.
    Cached positions are all visible; new token j is visible to new token i if j <= i
    (causal) or mask[i, j] (a tree's sequence, whose mask starts at `mask_offset`)."""
    j = pos - cached  # index among the new tokens; < 0: cached
    tree = mask_offset >= 0
    # where(), not `tree & ...`: the scalar's `&` makes int64 under triton 3.9's interpreter,
    # and a load's mask must be boolean
    in_mask = tl.where(tree, row_ok[:, None] & (pos_ok & (j >= 0))[None, :], False)
    bits = tl.load(masks_ptr + mask_offset + token[:, None] * new + j[None, :], in_mask, 0)
    sees_new = tl.where(tree, bits != 0, j[None, :] <= token[:, None])
    return pos_ok[None, :] & ((j < 0)[None, :] | sees_new)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    q_start_ptr, num_cached_ptr, num_new_ptr, tables_ptr,
    mask_offset_ptr, masks_ptr, tile_seq_ptr, tile_first_ptr,
    scale, head_dim, table_stride,
    q_stride_t, q_stride_h, kv_stride_s, kv_stride_h, out_stride_t, out_stride_h,
    GROUP: tl.constexpr, TILE_TOKENS: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_first_ptr + tile)
    cached = tl.load(num_cached_ptr + seq)
    new = tl.load(num_new_ptr + seq)
    mask_offset = tl.load(mask_offset_ptr + seq)
    # Row r: new token first + r // GROUP, query head kv_head * GROUP + r % GROUP.
    r = tl.arange(0, BLOCK_R)
    token = first + r // GROUP
    row_ok = (r < TILE_TOKENS * GROUP) & (token < new)
    row = tl.load(q_start_ptr + seq) + token
    head = kv_head * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    q_off = row[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q_ok = row_ok[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + q_off, q_ok, other=0.0)  # [BLOCK_R, BLOCK_D]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    # Causal rows see up to their own position; a tree's rows whatever their mask allows.
    end = tl.where(mask_offset < 0, cached + tl.minimum(first + TILE_TOKENS, new), cached + new)
    for start in range(0, end, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pos_ok = pos < end
        block = tl.load(tables_ptr + seq * table_stride + pos // PAGE, pos_ok, other=0)
        slot = block.to(tl.int64) * PAGE + pos % PAGE
        kv_off = slot[:, None] * kv_stride_s + kv_head * kv_stride_h + d[None, :]
        kv_ok = pos_ok[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_ptr + kv_off, kv_ok, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [BLOCK_R, BLOCK_N]
        s = s.to(tl.float32)  # torch.compile passes the float `scale` as fp64
        seen = _visible(pos, pos_ok, token, row_ok, cached, new, mask_offset, masks_ptr)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + kv_off, kv_ok, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    out_off = row[:, None] * out_stride_t + head[:, None] * out_stride_h + d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), q_ok)
