"""The paged KV storage: per layer, K and V as `[num_blocks * block_size, kv_heads, head_dim]`."""

from __future__ import annotations

import torch

from shared.model.config import ModelConfig


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (cfg.num_layers, 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.storage = torch.zeros(shape, device=device, dtype=dtype)
        self.layers = [(layer[0], layer[1]) for layer in self.storage]

    @classmethod
    def for_memory(
        cls,
        cfg: ModelConfig,
        memory_gb: float,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        """As many blocks as fit in `memory_gb` GiB."""
        per_block = cfg.kv_elements_per_token * block_size * dtype.itemsize
        num_blocks = max(1, int(memory_gb * 2**30) // per_block)
        return cls(cfg, num_blocks, block_size, device, dtype)

    def copy_tokens(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the K/V of token positions `src` to positions `dst` of one sequence, all layers
        at once (commits an accepted draft path to the cache positions it now occupies)."""
        bs = self.block_size
        slots = [[block_table[i // bs] * bs + i % bs for i in pos] for pos in (src, dst)]
        src_t, dst_t = (torch.tensor(s, device=self.storage.device) for s in slots)
        self.storage[:, :, dst_t] = self.storage[:, :, src_t]
