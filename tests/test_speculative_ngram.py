"""Draft trees, greedy acceptance and the n-gram drafter (pure logic, no model)."""

from __future__ import annotations

import pytest
import torch
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.speculative.accept import accept_greedy
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest
from specmesh.shared.speculative.ngram import NgramDrafter, NgramTrie

pytestmark = pytest.mark.unit


def ngram(depth: int, breadth: int = 8, match: str = "BFS") -> NgramDrafter:
    cfg = SpeculativeConfig(
        "NGRAM",
        speculative_ngram_max_trie_depth=depth,
        speculative_ngram_max_bfs_breadth=breadth,
        speculative_ngram_match_type=match,
    )
    return NgramDrafter(cfg.resolved())


def propose(drafter: NgramDrafter, request_id: str, new: list[int], budget: int) -> DraftTree:
    return drafter.propose([DraftRequest(request_id, new, budget)])[0]


def test_tree_mask_and_depths() -> None:
    #      0
    #    1   2
    #    3
    tree = DraftTree([9, 5, 6, 7], [-1, 0, 0, 1])
    assert tree.depths() == [0, 1, 1, 2]
    expected = torch.tensor(
        [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
    )
    assert torch.equal(tree.ancestor_mask(), expected)
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])


def test_accept_greedy_follows_target_choices() -> None:
    tree = DraftTree([9, 5, 6, 7, 8], [-1, 0, 0, 1, 1])
    # Target after root picks 5 (node 1), after node 1 picks 8 (node 4), after node 4 picks 3.
    target = [5, 8, 0, 0, 3]
    path, emitted = accept_greedy(tree, target)
    assert path == [0, 1, 4]
    assert emitted == [5, 8, 3]
    # Nothing matches: only the bonus token.
    assert accept_greedy(tree, [4, 0, 0, 0, 0]) == ([0], [4])
    assert accept_greedy(DraftTree.chain(1, [2, 3]), [2, 3, 4]) == ([0, 1, 2], [2, 3, 4])


def test_trie_matches_longest_suffix() -> None:
    trie = NgramTrie(max_depth=4)
    tokens = [1, 2, 3, 4, 9, 2, 3, 5]
    trie.add(tokens, len(tokens))
    node = trie.match([7, 2, 3], max_length=3)
    assert node is not None and set(node.children) == {4, 5}
    assert trie.match([8, 8], max_length=3) is None


def test_bfs_drafts_a_repeated_span() -> None:
    drafter = ngram(depth=6, breadth=1)
    text = [10, 11, 12, 13, 14, 15, 16]
    drafter.open("r", text + [99] + text[:2])
    tree = propose(drafter, "r", [], 4)
    assert tree.tokens == [11, 12, 13, 14, 15] and tree.parents == [-1, 0, 1, 2, 3]


def test_bfs_branches_prefer_recent_and_respect_budget() -> None:
    drafter = ngram(depth=3, breadth=2)
    drafter.open("r", [1, 2, 1, 3, 1, 4, 1])
    tree = propose(drafter, "r", [], 6)
    assert len(tree) - 1 <= 6
    first_level = [t for t, p in zip(tree.tokens, tree.parents, strict=True) if p == 0]
    assert first_level == [4, 3]  # most recent continuation of `1` first


def test_prob_prefers_frequent_continuations() -> None:
    drafter = ngram(depth=3, match="PROB")
    drafter.open("r", [5, 7, 5, 7, 5, 7, 5, 8, 5])
    assert propose(drafter, "r", [], 1).tokens == [5, 7]


def test_shared_trie_drafts_for_a_new_request() -> None:
    drafter = ngram(depth=5)
    drafter.open("a", [40, 41, 42, 43, 44])
    drafter.close("a")
    drafter.open("b", [7, 40])
    assert propose(drafter, "b", [41], 3).tokens == [41, 42, 43, 44]
    assert propose(drafter, "b", [42], 0).tokens == [42]  # no budget: the root alone
