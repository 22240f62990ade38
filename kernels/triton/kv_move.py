"""Commit accepted draft paths: move their K/V to the positions the paths now occupy.

Verification wrote tree node i of sequence b at position start_b + i. Once a path is
accepted, its k-th node belongs at position start_b + k, so for every k < length_b with
path[b, k] != k, all layers' K and V move from start_b + path[b, k] to start_b + k (what
`Speculator.verify` does through `KVCache.copy_tokens`), straight from the accept kernels'
output: no host round trip between accepting and committing.

A program takes one sequence, one plane (layer, K or V) and a chunk of a token's KVH * D
elements, and moves the path's nodes in order. That equals copying all at once: path nodes
increase, path[k] >= k, so a node's source start + path[k] lies beyond every position an
earlier move wrote; sequences own disjoint blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements of a token's row per program


def commit_paths(
    storage: torch.Tensor,
    block_tables: torch.Tensor,
    starts: torch.Tensor,
    path: torch.Tensor,
    length: torch.Tensor,
    block_size: int,
) -> None:
    """storage: [L, 2, num_slots, KVH, D] (`KVCache.storage`); block_tables: [B, max_blocks];
    starts: [B] position of each tree's root; path: [B, N], length: [B] (`Accepted`)."""
    if not storage.is_contiguous():
        raise ValueError("storage must be contiguous")
    layers, _, num_slots = storage.shape[:3]
    width = storage[0, 0, 0].numel()
    tables, starts, path, length = (
        t.to(device=storage.device, dtype=torch.int32).contiguous()
        for t in (block_tables, starts, path, length)
    )
    grid = (len(path), layers * 2, triton.cdiv(width, BLOCK))
    _commit_kernel[grid](
        storage, tables, starts, path, length,
        num_slots * width, width, tables.stride(0), path.stride(0),
        PAGE=block_size, BLOCK=BLOCK,
    )  # fmt: skip


@triton.jit
def _slot(table_row, pos, PAGE: tl.constexpr):
    """The cache slot of a sequence's position (int64)."""
    return tl.load(table_row + pos // PAGE).to(tl.int64) * PAGE + pos % PAGE


@triton.jit
def _commit_kernel(
    storage_ptr, tables_ptr, starts_ptr, path_ptr, length_ptr,
    plane_size, width, table_stride, path_stride,
    PAGE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    seq, plane = tl.program_id(0), tl.program_id(1).to(tl.int64)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    plane_ptr = storage_ptr + plane * plane_size
    table_row = tables_ptr + seq * table_stride
    start = tl.load(starts_ptr + seq)
    for k in range(1, tl.load(length_ptr + seq)):
        node = tl.load(path_ptr + seq * path_stride + k)
        ok = tl.where(node != k, e < width, False)  # boolean under every interpreter too
        row = tl.load(plane_ptr + _slot(table_row, start + node, PAGE) * width + e, ok)
        tl.store(plane_ptr + _slot(table_row, start + k, PAGE) * width + e, row, ok)
