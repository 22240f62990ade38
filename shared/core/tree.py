"""A draft tree: what a drafter proposes and the target verifies in one pass.

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

    def path_tokens(self, node: int) -> list[int]:
        """The tokens from the root down to `node`."""
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def ancestor_mask(self) -> torch.Tensor:
        return ancestor_mask(self.parents)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: node i attends to node j iff j is i or one of its ancestors.
    `parents[i]` is -1 for a node whose parent is outside the list (already cached)."""
    mask = torch.eye(len(parents), dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask
