"""NGRAM drafting: no draft model, a trie of the n-grams seen so far.

Each request has a trie over its prompt and output; a bounded trie shared by
all requests remembers n-grams of finished ones. To draft, the longest suffix
of the context found in a trie selects a node, and its continuations are
expanded into a tree: level by level with a breadth that narrows with depth
(BFS; most recent continuations first), or best-first by the product of
continuation frequencies (PROB).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from specmesh.shared.core.tree import DraftTree
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest, LocalDrafter


@dataclass
class _Node:
    children: dict[int, _Node] = field(default_factory=dict)
    count: int = 0  # times this n-gram was seen
    last_seen: int = 0  # insertion clock when last seen (recency for BFS)


class NgramTrie:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()
        self.clock = itertools.count(1)
        self.num_nodes = 0

    def add(self, tokens: list[int], new: int) -> None:
        """Record the n-grams ending at the last `new` positions of `tokens`."""
        for end in range(len(tokens) - new + 1, len(tokens) + 1):
            start = max(0, end - self.max_depth)
            for s in range(start, end):
                node = self.root
                for token in tokens[s:end]:
                    child = node.children.get(token)
                    if child is None:
                        child = node.children[token] = _Node()
                        self.num_nodes += 1
                    node = child
                node.count += 1
                node.last_seen = next(self.clock)

    def match(self, context: list[int], max_length: int) -> _Node | None:
        """The node of the longest suffix of `context`, at most `max_length` tokens,
        that has continuations. (A suffix of L tokens leaves max_depth - L to draft.)"""
        for length in range(min(max_length, self.max_depth - 1, len(context)), 0, -1):
            node: _Node | None = self.root
            for token in context[-length:]:
                node = node.children.get(token) if node else None
            if node is not None and node.children:
                return node
        return None


class NgramDrafter(LocalDrafter):
    target_features: tuple[tuple[int, ...], bool] = ((), False)

    def __init__(self, cfg: SpeculativeConfig) -> None:
        self.cfg = cfg
        self.depth = cfg.speculative_ngram_max_trie_depth
        self.shared = NgramTrie(self.depth)
        self.requests: dict[str, tuple[NgramTrie, list[int]]] = {}

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        trie = NgramTrie(self.depth)
        tokens = list(prompt_ids)
        trie.add(tokens, len(tokens))
        self.requests[request_id] = (trie, tokens)

    def close(self, request_id: str) -> None:
        """Forget the request, keeping its n-grams in the shared trie."""
        _, tokens = self.requests.pop(request_id)
        if self.shared.num_nodes > self.cfg.speculative_ngram_capacity:
            self.shared = NgramTrie(self.depth)
        self.shared.add(tokens, len(tokens))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._propose(r) for r in requests]

    def _propose(self, request: DraftRequest) -> DraftTree:
        trie, tokens = self.requests[request.request_id]
        tokens.extend(request.new_tokens)
        trie.add(tokens, len(request.new_tokens))
        # Match short enough that the continuation can fill the budget as a chain.
        longest = max(1, self.depth - request.max_drafts)
        node = trie.match(tokens, longest) or self.shared.match(tokens, longest)
        tree = DraftTree([tokens[-1]], [-1])
        if node is not None and request.max_drafts > 0:
            if self.cfg.speculative_ngram_match_type == "PROB":
                self._expand_prob(node, tree, request.max_drafts)
            else:
                self._expand_bfs(node, tree, request.max_drafts)
        return tree

    def _expand_bfs(self, start: _Node, tree: DraftTree, budget: int) -> None:
        widest = self.cfg.speculative_ngram_max_bfs_breadth
        narrowest = self.cfg.speculative_ngram_min_bfs_breadth
        level = [(start, 0)]  # (trie node, tree index)
        for depth in range(self.depth):
            # Breadth narrows linearly from the widest to the narrowest over the depth.
            breadth = round(widest - (widest - narrowest) * depth / max(self.depth - 1, 1))
            next_level = []
            for node, index in level:
                ranked = sorted(node.children.items(), key=lambda kv: -kv[1].last_seen)
                for token, child in ranked[: max(breadth, 1)]:
                    if len(tree) > budget:
                        return
                    tree.tokens.append(token)
                    tree.parents.append(index)
                    next_level.append((child, len(tree) - 1))
            if not next_level:
                return
            level = next_level

    def _expand_prob(self, start: _Node, tree: DraftTree, budget: int) -> None:
        # Best-first by path probability; a step's probability is its share of the counts.
        order = itertools.count()  # tie-breaker so the heap never compares nodes
        heap: list[tuple[float, int, int, _Node, int]] = []

        def push_children(node: _Node, index: int, path_p: float) -> None:
            total = sum(c.count for c in node.children.values())
            for token, child in node.children.items():
                p = path_p * child.count / total
                heapq.heappush(heap, (-p, next(order), token, child, index))

        push_children(start, 0, 1.0)
        while heap and len(tree) <= budget:
            neg_p, _, token, node, parent = heapq.heappop(heap)
            tree.tokens.append(token)
            tree.parents.append(parent)
            push_children(node, len(tree) - 1, -neg_p)
