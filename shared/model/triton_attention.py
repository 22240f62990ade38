"""`--attention-backend triton`: the Triton paged attention (`kernels.triton.attention`) behind
the `AttentionBackend` interface.

One launch a layer covers a step's decode rows, prefill chunks and draft trees (each tree
through its own mask), with GQA; the step's plan is built once by `prepare` and read by every
layer. CUDA only, or on CPU under Triton's interpreter (`TRITON_INTERPRET=1`, tests), which
must be set before this module is imported. Registered by module path in
`shared.model.attention`, so nothing imports Triton unless this backend is chosen.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from specmesh.kernels.triton.attention import AttentionPlan, paged_attention, plan_attention
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig


class TritonAttention:
    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        """`dtype`: any the kernel takes (fp32 exact, bf16/fp16 with fp32 accumulation)."""
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") == "0":
            raise ValueError(
                f"--attention-backend triton needs a CUDA device, not {device} (on CPU it runs "
                "only under Triton's interpreter, TRITON_INTERPRET=1, which tests use)"
            )
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head

    def prepare(
        self, spans: list[SequenceSpan], block_size: int, device: torch.device
    ) -> AttentionPlan:
        return plan_attention(spans, block_size, self.group, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionPlan,
    ) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H*D]."""
        return paged_attention(q, k, v, k_cache, v_cache, meta)

    def static_decode(
        self, batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> StaticTritonDecode:
        return StaticTritonDecode(self.group, batch_size, max_blocks, block_size, device)


class StaticTritonDecode:
    """The plan of a decode step of `batch_size` sequences in tensors that stay put (what a
    CUDA graph reads): every shape is fixed by the batch size and `max_blocks`, the widest block
    table, and `update` rewrites the values in place."""

    def __init__(
        self, group: int, batch_size: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.group, self.max_blocks, self.block_size = group, max_blocks, block_size
        empty = SequenceSpan([0] * max_blocks, 0, 1)
        self.meta = plan_attention([empty] * batch_size, block_size, group, device)

    def update(self, spans: list[SequenceSpan]) -> None:
        """Plan `spans` (batch_size decode rows, each context within max_blocks) on the host
        and copy it into the fixed tensors."""
        wide = [self._widened(span) for span in spans]
        plan = plan_attention(wide, self.block_size, self.group, "cpu")
        for field in dataclasses.fields(plan):
            value = getattr(plan, field.name)
            if isinstance(value, torch.Tensor):
                getattr(self.meta, field.name).copy_(value)

    def _widened(self, span: SequenceSpan) -> SequenceSpan:
        """The span with its block table cut to the blocks it reads and padded to max_blocks."""
        used = span.block_table[: (span.num_cached + span.num_new - 1) // self.block_size + 1]
        return SequenceSpan(used + [0] * (self.max_blocks - len(used)), span.num_cached, 1)
