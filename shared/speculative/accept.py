"""Which path of a verified draft tree to accept.

Both rules walk down from the root, at each node trying its children in order.
Drafts are deterministic given the context (longest match, greedy or top-k),
so the draft distribution at a node is a point mass on each proposed child.
With point-mass drafts, multi-draft speculative sampling (SpecInfer / EAGLE)
reduces to: accept child x with probability p(x); on rejection remove x from
p and renormalise; when every child is rejected, draw from what remains.
The emitted tokens are then distributed exactly as the target's own samples.

Sampling implements this as a coupling: at each node draw the target's own sample,
accept the child proposing it, and emit the sample itself when none does. That
accepts x1 with probability p(x1), x2 with p(x2) / (1 - p(x1)), ..., as above. The
token at sequence index i is drawn with `position_generator(seed, i)`, as in plain
decoding, so a seeded request emits exactly what it would without speculation,
whatever was drafted (NGRAM drafts depend on other requests, so a draft-dependent
number of draws from one stream would make seeded output unrepeatable).
"""

from __future__ import annotations

import torch
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.sampling.sampler import draw, position_generator


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
    seed: int | None,
    position: int,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
) -> tuple[list[int], list[int]]:
    """`probs[i]` is the target's sampling distribution after node i (`to_probs`);
    `position` is the sequence index of the tokens the root's children propose, so the
    token after a node at depth d is at position + d; `seed` keys the draws there.

    Thresholds below 1 trade exactness for acceptance, as in SGLang: a draft the sample
    missed is still accepted when its share of the mass left after the children before
    it reaches `threshold_single`, otherwise with probability min(1, share / threshold_acc)."""
    lossy = threshold_single < 1 or threshold_acc < 1
    children = _children(tree)
    path, node = [0], 0
    while True:
        # The token after `node` is at position + its depth, len(path) - 1.
        gen = position_generator(seed, position + len(path) - 1, probs.device)
        sample = int(draw(probs[node : node + 1], [gen])[0])
        kids = children.get(node, [])
        match = [c for c in kids if tree.tokens[c] == sample]
        if not match and lossy:
            # Drawn after the sample, so the sample stays the one plain decoding draws.
            u = torch.rand((), generator=gen, device=probs.device).item()
            p = probs[node].clone()
            for child in kids:
                token = tree.tokens[child]
                share = (p[token] / p.sum()).item()
                if share >= threshold_single or (threshold_acc < 1 and u < share / threshold_acc):
                    match = [child]
                    break
                p[token] = 0.0  # the next share is of the mass the rejected drafts leave
        if not match:
            return path, [tree.tokens[i] for i in path[1:]] + [sample]
        node = match[0]
        path.append(node)
