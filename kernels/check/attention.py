"""Paged attention (`kernels.triton.attention`) against `TorchAttention`, the torch path.

Cases are steps as the runner forms them: decode rows, a verified draft tree, a prefill
chunk after cached tokens and a fresh prompt in one batch, then a batch of decode rows alone
(the torch path's padded decode branch). Cached lengths differ and end inside a block, block
tables are shuffled, and query heads share KV heads (groups of 2 and 3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from specmesh.kernels.check.caches import dtype_name
from specmesh.kernels.check.result import Result
from specmesh.kernels.check.trees import random_tree
from specmesh.kernels.triton.attention import paged_attention, plan_attention
from specmesh.shared.model.attention import SequenceSpan, TorchAttention

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass
class Case:
    name: str
    spans: list[SequenceSpan]
    block_size: int
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KVH, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_slots, KVH, D]
    v_cache: torch.Tensor

    def shape(self) -> str:
        heads, kv_heads, dim = self.q.shape[1], self.k.shape[1], self.q.shape[2]
        seqs = ", ".join(
            f"{s.num_cached}+{s.num_new}{'' if s.mask is None else ' tree'}" for s in self.spans
        )
        return (
            f"cached+new {seqs}; H={heads} KVH={kv_heads} D={dim} "
            f"page={self.block_size} {dtype_name(self.q.dtype)}"
        )


def check(device: str, small: bool) -> list[Result]:
    dtypes = [torch.float32] if device == "cpu" else [torch.float32, torch.bfloat16]
    results = []
    for dtype in dtypes:
        for case in cases(device, dtype, small):
            out, ref = kernel(case)[0], reference(case)[0]
            results.append(Result.close(case.name, case.shape(), out, ref, TOLERANCE[dtype]))
    return results


def cases(device: str, dtype: torch.dtype, small: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(19)
    if small:  # (cached, new or tree size, tree?) per sequence
        # Past 32 cached positions a row's softmax spans blocks of the loop; past 32 new
        # tokens (group 2) a sequence spans tiles.
        mixed = [(9, 1, False), (70, 7, True), (3, 40, False), (0, 5, False)]
        decode = [(5, 1, False), (77, 1, False), (1, 1, False)]
        heads, page, dim = (4, 2), 4, 16
    else:
        mixed = [(1000, 1, False), (517, 16, True), (64, 200, False), (0, 300, False)]
        mixed += [(90, 8, True)]
        decode = [(n, 1, False) for n in (1, 33, 300, 1025, 2047, 64)]
        heads, page, dim = (32, 8), 16, 128
    return [
        _case("attention (mixed step)", mixed, heads, dim, page, dtype, device, gen),
        _case(
            "attention (decode)", decode, (heads[1] * 3, heads[1]), dim, page, dtype, device, gen
        ),
    ]


def reference(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TorchAttention's output [T, H*D] and the caches it wrote (on copies)."""
    backend = TorchAttention()
    meta = backend.prepare(case.spans, case.block_size, case.q.device)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    return backend.forward(case.q, case.k, case.v, k_cache, v_cache, meta), k_cache, v_cache


def kernel(
    case: Case, spans: list[SequenceSpan] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's output and caches; `spans` replaces the case's (to see a check fail)."""
    group = case.q.shape[1] // case.k.shape[1]
    plan = plan_attention(spans or case.spans, case.block_size, group, case.q.device)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    return paged_attention(case.q, case.k, case.v, k_cache, v_cache, plan), k_cache, v_cache


def causal(case: Case) -> list[SequenceSpan]:
    """The case's spans with every tree mask dropped: what a wrong mask looks like."""
    return [replace(s, mask=None) for s in case.spans]


def _case(
    name: str,
    layout: list[tuple[int, int, bool]],
    heads: tuple[int, int],
    dim: int,
    page: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
) -> Case:
    # One spare block per sequence: tables longer than the context, as the engine's are.
    needed = [(cached + new + page - 1) // page + 1 for cached, new, _ in layout]
    blocks = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    spans = []
    for (cached, new, tree), n in zip(layout, needed, strict=True):
        table, blocks = blocks[:n], blocks[n:]
        mask = random_tree(new, 2, gen).ancestor_mask() if tree else None
        spans.append(SequenceSpan(table, cached, new, mask))
    total, num_slots = sum(s.num_new for s in spans), (sum(needed) + 3) * page

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    num_heads, kv_heads = heads
    return Case(
        name,
        spans,
        page,
        randn(total, num_heads, dim),
        randn(total, kv_heads, dim),
        randn(total, kv_heads, dim),
        randn(num_slots, kv_heads, dim),
        randn(num_slots, kv_heads, dim),
    )
