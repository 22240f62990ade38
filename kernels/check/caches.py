"""Paged caches of random K/V and shuffled block tables for the checks."""

from __future__ import annotations

import torch
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.config import ModelConfig


def make_cache(device: str, dtype: torch.dtype, small: bool, gen: torch.Generator) -> KVCache:
    """Small: 2 layers, 2 KV heads of 16, blocks of 4; else 4 layers, 8 of 128, blocks of 16."""
    layers, kv_heads, dim, page, blocks = (2, 2, 16, 4, 64) if small else (4, 8, 128, 16, 256)
    hf = {"vocab_size": 64, "hidden_size": kv_heads * dim, "intermediate_size": 64}
    hf |= {"num_hidden_layers": layers, "num_attention_heads": kv_heads, "head_dim": dim}
    cache = KVCache(ModelConfig.from_hf(hf), blocks, page, torch.device(device), dtype)
    cache.storage.copy_(torch.randn(cache.storage.shape, generator=gen))
    return cache


def block_tables(lengths: list[int], cache: KVCache, gen: torch.Generator) -> list[list[int]]:
    """A table per sequence of `lengths[i]` tokens, its blocks drawn from a shuffled pool."""
    pool = torch.randperm(cache.num_blocks, generator=gen).tolist()
    tables = []
    for n in lengths:
        used = -(-n // cache.block_size)
        tables.append(pool[:used])
        pool = pool[used:]
    return tables


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
