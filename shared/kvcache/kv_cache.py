"""The paged KV storage: per attention layer, K and V as
`[num_blocks * block_size, kv_heads, head_dim]`; per linear-attention layer of a hybrid model,
one recurrent-state slot per block (`shared/model/gated_deltanet.py` says what a slot holds).

The storage dtype may be narrower than the model's (`--kv-cache-dtype`): attention casts new
K/V into it and reads it back in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.gated_deltanet import LinearStates, snapshot_offsets


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
        attention = cfg.attention_layers
        shape = (len(attention), 2, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.storage = torch.zeros(shape, device=device, dtype=dtype)
        # per model layer: its (K, V), or its state slots (a linear-attention layer)
        self.layers: list[tuple[torch.Tensor, torch.Tensor] | LinearStates] = []
        self.states: list[LinearStates] = []  # the linear-attention layers', in layer order
        kv = iter(self.storage)
        for i in range(cfg.num_layers):
            if i in attention:
                self.layers.append(tuple(next(kv)))
            else:
                self.states.append(_state_slots(cfg, num_blocks, device, dtype))
                self.layers.append(self.states[-1])

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block, all layers' K and V (and state slots)."""
        kv = cfg.kv_elements_per_token * block_size * dtype.itemsize
        lin = cfg.linear
        return kv + (0 if lin is None else len(lin.layers) * lin.state_elements * 4)

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

    def state_tensors(self, block_id: int) -> list[torch.Tensor]:
        """The state slot of one block, every linear-attention layer (none: not hybrid)."""
        return [t[block_id] for states in self.states for t in (states.conv, states.recurrent)]

    def write_states(
        self, kept: dict[int, tuple[torch.Tensor, torch.Tensor]], rows: list[int], blocks: list[int]
    ) -> None:
        """Into the state slots of `blocks`, the states a step kept (LinearMetadata.kept,
        per layer) at indices `rows`."""
        if not rows or not self.states:
            return
        index = torch.tensor(rows, device=self.storage.device)
        slots = torch.tensor(blocks, device=self.storage.device)
        for states, (conv, recurrent) in zip(self.states, kept.values(), strict=True):
            states.conv[slots] = conv[index]
            states.recurrent[slots] = recurrent[index]


@dataclass
class TreeStates:
    """The linear-attention states after every node of one sequence's draft tree, kept
    until verification knows which path to write into the state slots."""

    kept: dict[int, tuple[torch.Tensor, torch.Tensor]]  # LinearMetadata.kept of the step
    first: int  # index of the tree's root among the kept states

    def commit(self, cache: KVCache, block_table: list[int], start: int, path: list[int]) -> None:
        """`path`: the accepted nodes, now at positions start, start+1, ..."""
        bs = cache.block_size
        offsets = snapshot_offsets(start, len(path), bs)
        rows = [self.first + path[i] for i in offsets]
        cache.write_states(self.kept, rows, [block_table[(start + i) // bs] for i in offsets])


def _state_slots(
    cfg: ModelConfig, num_blocks: int, device: torch.device, dtype: torch.dtype
) -> LinearStates:
    lin = cfg.linear
    conv = torch.zeros(num_blocks, lin.conv_dim, lin.conv_kernel - 1, device=device, dtype=dtype)
    shape = (num_blocks, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim)
    return LinearStates(conv, torch.zeros(shape, device=device, dtype=torch.float32))


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
