"""Random draft trees and target choices for the checks (seeded: every run checks the same)."""

from __future__ import annotations

import torch
from specmesh.shared.core.tree import DraftTree


def random_tree(num_nodes: int, vocab: int, gen: torch.Generator) -> DraftTree:
    """Node i's parent is one of the three nodes before it: deep trees with branches."""
    parents = [-1] + [_randint(max(0, i - 3), i, gen) for i in range(1, num_nodes)]
    return DraftTree(torch.randint(vocab, (num_nodes,), generator=gen).tolist(), parents)


def choices(tree: DraftTree, vocab: int, gen: torch.Generator, follow: float) -> list[int]:
    """A target's choice after each node: with probability `follow` a child's token (the
    last child's, so accepted paths skip nodes and their K/V moves), else any token."""
    last_child = {parent: i for i, parent in enumerate(tree.parents) if parent >= 0}
    out = []
    for node in range(len(tree)):
        if node in last_child and torch.rand((), generator=gen) < follow:
            out.append(tree.tokens[last_child[node]])
        else:
            out.append(_randint(0, vocab, gen))
    return out


def _randint(low: int, high: int, gen: torch.Generator) -> int:
    return int(torch.randint(low, high, (), generator=gen))
