"""A step's spans in FlashInfer's paged-KV terms: page lists in CSR form, and its custom mask.

Our cache holds, per layer, K and V as `[num_blocks * block_size, kv_heads, head_dim]`; viewed
as `[num_blocks, block_size, kv_heads, head_dim]` that is FlashInfer's NHD page layout, block
b being page b. A sequence with `total = num_cached + num_new` tokens (its new K/V is written
before attention) reads the first ceil(total / block_size) blocks of its table, the last of
them holding `total - (pages - 1) * block_size` tokens (1..block_size). Plain torch on the
host: it runs, and is tested, without FlashInfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from specmesh.shared.model.attention import SequenceSpan, context_slots


@dataclass
class PageTable:
    qo_indptr: torch.Tensor  # [S + 1] int32: sequence i's new tokens are rows [i] .. [i + 1]
    kv_indptr: torch.Tensor  # [S + 1] int32: its pages are kv_indices[kv_indptr[i] .. [i + 1]]
    kv_indices: torch.Tensor  # [sum of pages] int32: block ids, in the sequence's order
    last_page_len: torch.Tensor  # [S] int32: tokens in each sequence's last page
    slot_mapping: torch.Tensor  # [T] long: the cache slot of each new token


def page_table(spans: list[SequenceSpan], block_size: int) -> PageTable:
    """The spans' pages, on the host (FlashInfer's plan copies what it needs)."""
    totals = [s.num_cached + s.num_new for s in spans]
    pages = [(total + block_size - 1) // block_size for total in totals]
    indices = [b for s, n in zip(spans, pages, strict=True) for b in s.block_table[:n]]
    slots = [
        context_slots(s.block_table, total, block_size)[s.num_cached :]
        for s, total in zip(spans, totals, strict=True)
    ]
    return PageTable(
        qo_indptr=_ints([0, *accumulate(s.num_new for s in spans)]),
        kv_indptr=_ints([0, *accumulate(pages)]),
        kv_indices=_ints(indices),
        last_page_len=_ints([t - (n - 1) * block_size for t, n in zip(totals, pages, strict=True)]),
        slot_mapping=torch.cat(slots),
    )


def custom_mask(spans: list[SequenceSpan]) -> torch.Tensor:
    """[sum of num_new * total] bool, FlashInfer's `custom_mask`: each sequence's
    [num_new, total] mask, row-major, one after another. A new token sees the whole cached
    prefix, and the new tokens through the span's mask (a draft tree's) or causally."""
    masks = []
    for span in spans:
        new = span.mask
        if new is None:
            new = torch.ones(span.num_new, span.num_new, dtype=torch.bool).tril()
        prefix = torch.ones(span.num_new, span.num_cached, dtype=torch.bool)
        masks.append(torch.cat([prefix, new.cpu()], dim=1).flatten())
    return torch.cat(masks)


def _ints(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
