"""The post-accept KV move (`kernels.triton.kv_move`) against `KVCache.copy_tokens`.

Greedy paths accepted on the device (the `accept_greedy` kernel) go straight to
`commit_paths`; the reference accepts on the host and moves with `KVCache.copy_tokens`, as
`Speculator.verify` does. Roots sit at ragged positions inside blocks, and the paths skip
nodes, so tokens move.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from specmesh.kernels.check.accept import greedy_on_device
from specmesh.kernels.check.caches import block_tables, dtype_name, make_cache
from specmesh.kernels.check.result import Result
from specmesh.kernels.check.trees import choices, random_tree
from specmesh.kernels.triton.accept import pad_rows
from specmesh.kernels.triton.kv_move import commit_paths
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.speculative.accept import accept_greedy


@dataclass
class Case:
    cache: KVCache  # verified trees' K/V at start + node index
    reference: KVCache  # the same after `Speculator.verify`'s moves
    trees: list[DraftTree]
    targets: list[list[int]]  # the target's greedy choice after each node
    starts: list[int]  # each root's position
    tables: list[list[int]]
    moved: int  # tokens the reference moved


def check(device: str, dtype: torch.dtype, small: bool) -> Result:
    case = make_case(device, dtype, small)
    commit_on_device(case, case.starts)
    shape = f"{len(case.trees)} paths ({case.moved} tokens moved), {_shape(case.cache)}"
    same = torch.equal(case.cache.storage, case.reference.storage)
    return Result.exact("kv move (commit paths)", shape, same)


def make_case(device: str, dtype: torch.dtype, small: bool) -> Case:
    gen = torch.Generator().manual_seed(5)
    cache, reference = (make_cache(device, dtype, small, gen) for _ in range(2))
    reference.storage.copy_(cache.storage)
    sizes = [7, 5, 6] if small else torch.randint(2, 17, (32,), generator=gen).tolist()
    trees = [random_tree(n, 64, gen) for n in sizes]
    targets = [choices(tree, 64, gen, follow=0.9) for tree in trees]
    starts = torch.randint(40, (len(trees),), generator=gen).tolist()
    tables = block_tables([s + len(t) for s, t in zip(starts, trees, strict=True)], cache, gen)
    moved = sum(
        commit_on_host(reference, tree, target, start, table)
        for tree, target, start, table in zip(trees, targets, starts, tables, strict=True)
    )
    return Case(cache, reference, trees, targets, starts, tables, moved)


def commit_on_device(case: Case, starts: list[int]) -> None:
    """Accept greedily on the device and move from there (`starts` may differ from the
    case's, to see the check fail)."""
    device = case.cache.storage.device
    accepted = greedy_on_device(case.trees, case.targets, device)
    commit_paths(
        case.cache.storage,
        pad_rows(case.tables, device),
        torch.tensor(starts, device=device),
        accepted.path,
        accepted.length,
        case.cache.block_size,
    )


def commit_on_host(
    cache: KVCache, tree: DraftTree, target: list[int], start: int, table: list[int]
) -> int:
    """`Speculator.verify`'s move of an accepted path; returns how many tokens moved."""
    path, _ = accept_greedy(tree, target)
    moved = [(start + node, start + i) for i, node in enumerate(path) if node != i]
    if moved:
        src, dst = zip(*moved, strict=True)
        cache.copy_tokens(table, list(src), list(dst))
    return len(moved)


def _shape(cache: KVCache) -> str:
    return f"{tuple(cache.storage.shape)} {dtype_name(cache.storage.dtype)}"
