"""Which path of a verified draft tree to accept.

Both rules walk down from the root, at each node trying its children in order.
Drafts are deterministic given the context (longest match, greedy or top-k),
so the draft distribution at a node is a point mass on each proposed child.
With point-mass drafts, multi-draft speculative sampling (SpecInfer / EAGLE)
reduces to: accept child x with probability p(x); on rejection remove x from
p and renormalise; when every child is rejected, draw from what remains.
The emitted tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch

from shared.speculative.tree import DraftTree


def _children(tree: DraftTree) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for i in range(1, len(tree)):
        children.setdefault(tree.parents[i], []).append(i)
    return children


def accept_greedy(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], list[int]]:
    """`target_tokens[i]` is the target's greedy choice after node i.

    Returns (accepted node indices, root first; emitted tokens: the accepted drafts
    and then the target's bonus token). Every emitted token is the target's own
    greedy choice, so the output equals plain greedy decoding."""
    children = _children(tree)
    path, node = [0], 0
    while True:
        match = [c for c in children.get(node, []) if tree.tokens[c] == target_tokens[node]]
        if not match:
            return path, [tree.tokens[i] for i in path[1:]] + [target_tokens[node]]
        node = match[0]
        path.append(node)


def accept_sampling(
    tree: DraftTree,
    probs: torch.Tensor,
    generator: torch.Generator | None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[list[int], list[int]]:
    """`probs[i]` is the target's sampling distribution after node i (`to_probs`).

    Thresholds below 1 trade exactness for acceptance, as in SGLang: a draft is
    accepted outright when its probability reaches `threshold_single`, otherwise
    with probability min(1, p / threshold_acc)."""
    children = _children(tree)
    path, node = [0], 0
    while True:
        p = probs[node].clone()
        for child in children.get(node, []):
            token = tree.tokens[child]
            share = (p[token] / p.sum()).item()
            u = torch.rand((), generator=generator, device=p.device).item()
            if share >= threshold_single or u < min(1.0, share / threshold_acc):
                node = child
                path.append(node)
                break
            p[token] = 0.0  # the residual max(p - q, 0) for a point-mass draft q
        else:
            if p.sum() <= 0:  # rounding left no residual mass: fall back to the target itself
                p = probs[node]
            bonus = int(torch.multinomial(p, 1, generator=generator).item())
            return path, [tree.tokens[i] for i in path[1:]] + [bonus]
