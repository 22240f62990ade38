"""A draft tree and the greedy rule that accepts a path of it.

Node 0 is the root: the last accepted token, whose K/V is not cached yet. Every
other node is a drafted token with a parent earlier in the list, so a tree can
be verified in one forward pass of all its nodes with an ancestor mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: list[int]  # tokens[0] is the root
    parents: list[int]  # parents[0] == -1; parents[i] < i

    def __post_init__(self) -> None:
        if not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree starts with its root (parent -1)")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], 1)):
            raise ValueError("every draft node's parent must come before it")

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> DraftTree:
        return cls([root, *drafts], list(range(-1, len(drafts))))

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depth = [0] * len(self)
        for i in range(1, len(self)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool: node i attends to node j iff j is i or one of its ancestors."""
        mask = torch.eye(len(self), dtype=torch.bool)
        for i in range(1, len(self)):
            mask[i] |= mask[self.parents[i]]
        return mask


def accept_greedy(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], list[int]]:
    """`target_tokens[i]` is the target's greedy choice after node i.

    Follows, from the root, the child whose token equals the target's choice.
    Returns (accepted node indices including the root, emitted tokens: the accepted
    drafts followed by the target's bonus token). Lossless by construction: every
    emitted token is the target's own greedy choice."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], {}).setdefault(tree.tokens[i], i)
    path, node = [0], 0
    while (child := children.get(node, {}).get(target_tokens[node])) is not None:
        path.append(child)
        node = child
    return path, [tree.tokens[i] for i in path[1:]] + [target_tokens[node]]
