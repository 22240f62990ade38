"""`--attention-backend flashinfer`: FlashInfer's paged-KV attention (flashinfer-python >= 0.7).

NEVER RUN ON A GPU YET: written against FlashInfer's documented API (the 0.6.18 source's
`BatchDecodeWithPagedKVCacheWrapper` and `BatchPrefillWithPagedKVCacheWrapper`: `plan` once
per step, `run` per layer) on a machine without one; only its CPU-side parts
(`shared.model.page_table`) and its refusal to start without CUDA are tested.

Our cache is FlashInfer's NHD page layout as it stands (`page_table`). A step of decode rows
only runs the decode wrapper; any other step (prefill chunks, draft trees, mixed) runs the
prefill wrapper over all its sequences, causal, or, when any sequence brings a mask (a draft
tree), with a custom mask for every sequence, as FlashInfer's mask applies to the whole batch.
New K/V is written to the cache slots first, as the torch backend does. FlashInfer computes in
float16/bfloat16 only; the KV cache must be in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.page_table import PageTable, custom_mask, page_table

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace, shared by all wrappers


def _flashinfer(device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The flashinfer module, or ValueError where this backend cannot run."""
    if device.type != "cuda":
        raise ValueError(f"--attention-backend flashinfer needs a CUDA device, not {device}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"--attention-backend flashinfer computes in float16 or bfloat16, not {dtype}: "
            "pass --dtype bfloat16"
        )
    try:
        import flashinfer
    except ImportError as exc:
        raise ValueError(
            "--attention-backend flashinfer needs flashinfer-python (pip install "
            f"'specmesh[gpu]'): {exc}"
        ) from exc
    return flashinfer


@dataclass
class FlashInferMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    wrapper: Any  # the step's decode or prefill wrapper, planned for it
    block_size: int


class FlashInferAttention:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.fi = _flashinfer(device, dtype)
        self.heads = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.dtype = dtype
        # zeroed: FlashInfer asks for a zeroed workspace on first use
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor-core decode takes any GQA group size (the CUDA-core kernels only some).
        self.decode = self.fi.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=True
        )
        self.prefill = self.fi.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")

    def prepare(
        self, spans: list[SequenceSpan], block_size: int, device: torch.device
    ) -> FlashInferMetadata:
        table = page_table(spans, block_size)
        if all(s.num_new == 1 and s.mask is None for s in spans):
            self.plan_decode(self.decode, table, block_size)
            return FlashInferMetadata(table.slot_mapping.to(device), self.decode, block_size)
        masked = any(s.mask is not None for s in spans)
        self.prefill.plan(
            table.qo_indptr,
            table.kv_indptr,
            table.kv_indices,
            table.last_page_len,
            *self.heads,
            block_size,
            custom_mask=custom_mask(spans).to(device) if masked else None,
            causal=not masked,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )
        return FlashInferMetadata(table.slot_mapping.to(device), self.prefill, block_size)

    def plan_decode(self, wrapper: Any, table: PageTable, block_size: int) -> None:
        """Plan a decode wrapper for one new token per sequence (host work: never in a graph)."""
        wrapper.plan(
            table.kv_indptr,
            table.kv_indices,
            table.last_page_len,
            *self.heads,
            block_size,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: FlashInferMetadata,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H*D]."""
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        # [num_slots, KVH, D] -> NHD pages [num_blocks, block_size, KVH, D], no copy
        pages = tuple(c.view(-1, meta.block_size, *c.shape[1:]) for c in (k_cache, v_cache))
        # q is a strided view of the fused QKV projection: give the kernel dense rows
        out = meta.wrapper.run(q.contiguous(), pages)  # [T, H, D]
        return out.view(q.shape[0], -1)

    def static_decode(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> StaticFlashInferDecode:
        return StaticFlashInferDecode(self, batch_size, max_blocks, block_size, device)


class StaticFlashInferDecode:
    """A decode wrapper in FlashInfer's CUDA-graph mode for `batch_size` sequences: its page
    lists live in fixed buffers (up to max_blocks pages a sequence), which `update` re-plans."""

    def __init__(
        self,
        backend: FlashInferAttention,
        batch_size: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        def ints(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=device)

        wrapper = backend.fi.BatchDecodeWithPagedKVCacheWrapper(
            backend.workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=True,
            paged_kv_indptr_buffer=ints(batch_size + 1),
            paged_kv_indices_buffer=ints(batch_size * max_blocks),
            paged_kv_last_page_len_buffer=ints(batch_size),
        )
        self.backend = backend
        slots = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.meta = FlashInferMetadata(slots, wrapper, block_size)

    def update(self, spans: list[SequenceSpan]) -> None:
        table = page_table(spans, self.meta.block_size)
        self.meta.slot_mapping.copy_(table.slot_mapping)
        self.backend.plan_decode(self.meta.wrapper, table, self.meta.block_size)
