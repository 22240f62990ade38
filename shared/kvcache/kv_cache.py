"""The paged KV storage: per layer, K and V as `[num_blocks * block_size, kv_heads, head_dim]`.

The storage dtype may be narrower than the model's (`--kv-cache-dtype`): attention casts new
K/V into it and reads it back in the model's dtype.
"""

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

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block, all layers' K and V."""
        return cfg.kv_elements_per_token * block_size * dtype.itemsize

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
        num_blocks = max(1, int(memory_gb * 2**30) // cls.block_bytes(cfg, block_size, dtype))
        return cls(cfg, num_blocks, block_size, device, dtype)

    def copy_tokens(self, block_table: list[int], src: list[int], dst: list[int]) -> None:
        """Copy the K/V of token positions `src` to positions `dst` of one sequence, all layers
        at once (commits an accepted draft path to the cache positions it now occupies)."""
        bs = self.block_size
        slots = [[block_table[i // bs] * bs + i % bs for i in pos] for pos in (src, dst)]
        src_t, dst_t = (torch.tensor(s, device=self.storage.device) for s in slots)
        self.storage[:, :, dst_t] = self.storage[:, :, src_t]


def blocks_for_mem_fraction(
    fraction: float,
    free_at_start: int,
    free_after_weights: int,
    block_bytes: int,
    min_blocks: int = 1,
) -> int:
    """SGLang's `--mem-fraction-static`: the weights and the KV cache together take `fraction`
    of the device memory free before the weights were loaded (bytes); the KV cache gets the
    whole blocks that the weights leave of that share. ValueError when they are fewer than
    `min_blocks` (one sequence)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], not {fraction}")
    weights = free_at_start - free_after_weights
    kv_bytes = fraction * free_at_start - weights
    blocks = max(0, int(kv_bytes // block_bytes))
    if blocks < min_blocks:
        raise ValueError(
            f"--mem-fraction-static {fraction} of {_gib(free_at_start)} GiB free, less "
            f"{_gib(weights)} GiB of weights, leaves {_gib(max(0.0, kv_bytes))} GiB for the "
            f"KV cache: {blocks} blocks, and one sequence needs {min_blocks} "
            f"({block_bytes} bytes each); raise --mem-fraction-static"
        )
    return blocks


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f}"
