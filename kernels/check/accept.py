"""Tree acceptance (`kernels.triton.accept`) against `shared.speculative.accept`.

A batch holds branching trees, a chain and a lone root. Greedy: the target's choices follow
a child at most nodes, so paths run deep and skip nodes. Sampling: the target's
distributions lean to the children's tokens; each tree has its own seed and position, and
the kernel gets the Exp(1) noise `draw` uses there (`position_generator`), so the kernel
must pick exactly the tokens and path `accept_sampling` does.
"""

from __future__ import annotations

import math

import torch
from specmesh.kernels.check.result import Result
from specmesh.kernels.check.trees import choices, random_tree
from specmesh.kernels.triton import accept
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.sampling.sampler import position_generator
from specmesh.shared.speculative.accept import accept_greedy, accept_sampling

Paths = list[tuple[list[int], list[int]]]  # per tree: (accepted nodes, emitted tokens)


def check(device: str, small: bool) -> list[Result]:
    gen = torch.Generator().manual_seed(7)
    vocab = 50 if small else 32000
    trees = make_trees(small, vocab, gen)
    targets = [choices(tree, vocab, gen, follow=0.8) for tree in trees]
    greedy = [accept_greedy(tree, target) for tree, target in zip(trees, targets, strict=True)]
    probs = [_leaning_probs(tree, vocab, gen).to(device) for tree in trees]
    seeds = [(_seed(gen), _seed(gen) % 1000) for _ in trees]  # (seed, position) per tree
    sampled = [
        accept_sampling(tree, p, seed, position)
        for tree, p, (seed, position) in zip(trees, probs, seeds, strict=True)
    ]
    return [
        _result("accept greedy", trees, vocab, greedy, greedy_kernel(trees, targets, device)),
        _result("accept sampling", trees, vocab, sampled, sampling_kernel(trees, probs, seeds)),
    ]


def make_trees(small: bool, vocab: int, gen: torch.Generator) -> list[DraftTree]:
    sizes = [7, 6, 5, 4, 1] if small else torch.randint(1, 17, (61,), generator=gen).tolist()
    trees = [random_tree(n, vocab, gen) for n in sizes]
    return trees + [DraftTree.chain(1, [2, 3])]


def greedy_kernel(trees: list[DraftTree], targets: list[list[int]], device: str) -> Paths:
    return _paths(greedy_on_device(trees, targets, device))


def greedy_on_device(
    trees: list[DraftTree], targets: list[list[int]], device: torch.device | str
) -> accept.Accepted:
    """The greedy kernel's output, left on the device."""
    tokens, parents = _padded(trees, device)
    return accept.accept_greedy(tokens, parents, accept.pad_rows(targets, device))


def sampling_kernel(
    trees: list[DraftTree], probs: list[torch.Tensor], seeds: list[tuple[int, int]]
) -> Paths:
    device = probs[0].device
    tokens, parents = _padded(trees, device)
    padded = torch.zeros(len(trees), tokens.shape[1], probs[0].shape[1], device=device)
    for i, p in enumerate(probs):
        padded[i, : len(p)] = p
    depths = max(max(tree.depths()) for tree in trees) + 1
    noise = torch.stack([_noise(seed, position, depths, padded) for seed, position in seeds])
    return _paths(accept.accept_sampling(tokens, parents, padded, noise))


def _noise(seed: int, position: int, depths: int, probs: torch.Tensor) -> torch.Tensor:
    """[depths, V]: the Exp(1) noise `draw` fills for the token at position + depth."""
    rows = torch.empty(depths, probs.shape[2], device=probs.device)
    for depth in range(depths):
        rows[depth].exponential_(generator=position_generator(seed, position + depth, rows.device))
    return rows


def _leaning_probs(tree: DraftTree, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[N, V] fp32 distributions with a child's token often the likeliest (a lone child's
    logit stands log V + 2 above the noise: probability about 0.9)."""
    logits = torch.randn(len(tree), vocab, generator=gen)
    for node, parent in enumerate(tree.parents):
        if parent >= 0:
            logits[parent, tree.tokens[node]] += math.log(vocab) + 2
    return logits.softmax(dim=-1)


def _padded(trees: list[DraftTree], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    tokens = accept.pad_rows([t.tokens for t in trees], device)
    return tokens, accept.pad_rows([t.parents for t in trees], device)


def _paths(out: accept.Accepted) -> Paths:
    lengths = out.length.tolist()
    return [
        (path[:n], emitted[:n])
        for path, emitted, n in zip(out.path.tolist(), out.emitted.tolist(), lengths, strict=True)
    ]


def _result(name: str, trees: list[DraftTree], vocab: int, ref: Paths, out: Paths) -> Result:
    drafts = sum(len(t) - 1 for t in trees)
    accepted = sum(len(path) - 1 for path, _ in ref)
    shape = f"{len(trees)} trees, {drafts} drafts ({accepted} accepted), V={vocab}"
    return Result.exact(name, shape, out == ref)


def _seed(gen: torch.Generator) -> int:
    return int(torch.randint(2**31, (), generator=gen))
