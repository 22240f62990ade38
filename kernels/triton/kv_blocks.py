"""Paged KV blocks to and from one contiguous transport buffer (prefill exports, decode loads).

The cache is `KVCache.storage`, `[L, 2, num_slots, KVH, D]` (slot = block * block_size +
offset). A block holding n tokens travels as `storage[:, :, slots of its n tokens]`, laid out
`[L, 2, n, KVH, D]` (what `KVExchange` stores under the block's key; a partial last block has
n < block_size). The buffer is those blobs back to back: blob i is
`buffer[offsets[i] : offsets[i] + L * 2 * n_i * KVH * D]`, so one launch gathers (or
scatters) every block of a step and the transport sends or receives slices of it.

In both, a run of n_i * KVH * D elements per (block, layer, K or V) is contiguous on each
side; a program copies one chunk of one such run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # elements per program


def blob_offsets(storage: torch.Tensor, num_tokens: list[int]) -> list[int]:
    """Where each block's blob starts in the buffer, plus the buffer's length at the end."""
    per_token = storage.shape[0] * storage.shape[1] * storage[0, 0, 0].numel()
    offsets = [0]
    for n in num_tokens:
        offsets.append(offsets[-1] + n * per_token)
    return offsets


def pack_blocks(
    storage: torch.Tensor, block_ids: list[int], num_tokens: list[int], block_size: int
) -> torch.Tensor:
    """The blobs of blocks `block_ids` (n_i tokens each) back to back: [sum of blob sizes]."""
    offsets = blob_offsets(storage, num_tokens)
    buffer = storage.new_empty(offsets[-1])
    _launch(storage, buffer, block_ids, num_tokens, offsets, block_size, to_buffer=True)
    return buffer


def unpack_blocks(
    buffer: torch.Tensor,
    storage: torch.Tensor,
    block_ids: list[int],
    num_tokens: list[int],
    block_size: int,
) -> None:
    """Write the blobs in `buffer` (as `pack_blocks` lays them out) into blocks `block_ids`."""
    offsets = blob_offsets(storage, num_tokens)
    if buffer.numel() != offsets[-1] or buffer.dtype != storage.dtype:
        raise ValueError(f"buffer holds {buffer.numel()} {buffer.dtype}, not {offsets[-1]}")
    _launch(storage, buffer, block_ids, num_tokens, offsets, block_size, to_buffer=False)


def _launch(
    storage: torch.Tensor,
    buffer: torch.Tensor,
    block_ids: list[int],
    num_tokens: list[int],
    offsets: list[int],
    block_size: int,
    to_buffer: bool,
) -> None:
    if not storage.is_contiguous() or max(num_tokens) > block_size:
        raise ValueError("storage must be contiguous and blocks at most block_size tokens")
    layers, _, num_slots = storage.shape[:3]
    width = storage[0, 0, 0].numel()  # KVH * D elements per token
    meta = torch.tensor([block_ids, num_tokens, offsets[:-1]], device=storage.device)
    grid = (len(block_ids), layers * 2, triton.cdiv(block_size * width, BLOCK))
    _blocks_kernel[grid](
        storage, buffer, meta[0], meta[1], meta[2], num_slots * width, width,
        PAGE=block_size, TO_BUFFER=to_buffer, BLOCK=BLOCK,
    )  # fmt: skip


@triton.jit
def _blocks_kernel(
    storage_ptr, buffer_ptr, block_ids_ptr, num_tokens_ptr, offsets_ptr, plane_size, width,
    PAGE: tl.constexpr, TO_BUFFER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i, plane = tl.program_id(0), tl.program_id(1).to(tl.int64)  # plane: layer * 2 + (K or V)
    block = tl.load(block_ids_ptr + i)
    run = tl.load(num_tokens_ptr + i) * width  # elements of this block in one plane
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = e < run
    cache = storage_ptr + plane * plane_size + block * PAGE * width + e
    blob = buffer_ptr + tl.load(offsets_ptr + i) + plane * run + e
    if TO_BUFFER:
        tl.store(blob, tl.load(cache, ok), ok)
    else:
        tl.store(cache, tl.load(blob, ok), ok)
