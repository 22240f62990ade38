"""Acceptance of a batch of draft trees on the device, one program per tree.

Trees are padded to `[B, N]`: `tokens[b, i]` is node i's token (node 0 the root),
`parents[b, i]` its parent (-1 for the root and for padding, which no walk reaches). Both
rules walk down from the root; at a node they take its first child (lowest index, as
`shared.speculative.accept` tries children in order) whose token is the target's choice
after the node, and stop where none is. Every step is on the device: the tree's nodes are
one vector, a step is one compare and one min over it.

- greedy: the choice after node i is `target[b, i]`, the target's argmax there
  (`accept_greedy`).
- sampling: the choice after a node at depth d is the target's sample there, drawn as
  `draw` draws it, by the exponential race argmax_v p[v] / max(E[v], tiny) with
  `probs[b, node]` and the noise row `noise[b, d]` (Exp(1), from the position's generator:
  `accept_sampling` with thresholds 1; the lossy thresholds stay on the host).

The path is the accepted nodes, root first; `emitted[k]` is the choice after `path[k]`:
the accepted drafts, then the bonus token, so the step emits `emitted[:length]`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # vocabulary entries per step of the sampling race
# torch.finfo(torch.float32).tiny, where `draw` clamps noise (a constexpr: kernels read it)
TINY = tl.constexpr(1.1754943508222875e-38)


class Accepted(NamedTuple):
    path: torch.Tensor  # [B, N] int32: accepted nodes, root first; -1 past `length`
    length: torch.Tensor  # [B] int32: nodes on the path (accepted drafts + 1)
    emitted: torch.Tensor  # [B, N] int32: tokens to emit; -1 past `length`


def pad_rows(rows: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """Per-tree lists (`DraftTree.tokens`, `.parents`, target choices) -> [B, N] int32,
    padded with -1."""
    width = max(map(len, rows))
    padded = [row + [-1] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.int32, device=device)


def accept_greedy(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor) -> Accepted:
    """tokens, parents, target: [B, N] (target: the argmax after each node)."""
    out = _outputs(tokens)
    num_trees, num_nodes = tokens.shape
    _greedy_kernel[(num_trees,)](
        *_ints(tokens, parents, target), *out, num_nodes,
        BLOCK=triton.next_power_of_2(num_nodes),
    )  # fmt: skip
    return out


def accept_sampling(
    tokens: torch.Tensor, parents: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor
) -> Accepted:
    """tokens, parents: [B, N]; probs: [B, N, V] fp32, the distribution after each node
    (`to_probs`); noise: [B, depth + 1, V] fp32, Exp(1) noise of each depth's draw."""
    out = _outputs(tokens)
    num_trees, num_nodes, vocab = probs.shape
    if probs.dtype != torch.float32 or noise.dtype != torch.float32:
        raise ValueError("probs and noise must be float32, as `draw` divides them")
    _sampling_kernel[(num_trees,)](
        *_ints(tokens, parents), probs.contiguous(), noise.contiguous(), *out,
        num_nodes, vocab, noise.shape[1],
        BLOCK=triton.next_power_of_2(num_nodes),
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )  # fmt: skip
    return out


def _outputs(tokens: torch.Tensor) -> Accepted:
    path = torch.full_like(tokens, -1, dtype=torch.int32)
    return Accepted(path, path.new_empty(len(tokens)), torch.full_like(path, -1))


def _ints(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(torch.int32).contiguous() for t in tensors]


@triton.jit
def _first_child(tokens, parents, idx, node, choice, BLOCK: tl.constexpr):
    """The lowest-index child of `node` whose token is `choice`; BLOCK where none is."""
    return tl.min(tl.where((parents == node) & (tokens == choice), idx, BLOCK), axis=0)


@triton.jit
def _race(probs_row, noise_row, vocab, BLOCK_V: tl.constexpr):
    """argmax_v p[v] / max(E[v], tiny) over the vocabulary in chunks, the first index on
    ties, as `draw`'s `(probs / noise).argmax()` (division rounded as IEEE does)."""
    best = tl.full([], -1.0, tl.float32)  # scores are >= 0
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        v = start + tl.arange(0, BLOCK_V)
        p = tl.load(probs_row + v, v < vocab, other=0.0)
        e = tl.load(noise_row + v, v < vocab, other=1.0)
        score = tl.where(v < vocab, tl.math.div_rn(p, tl.maximum(e, TINY)), -1.0)
        top, arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        best_idx = tl.where(top > best, start + arg, best_idx)  # strictly: earlier chunk wins
        best = tl.maximum(best, top)
    return best_idx


@triton.jit
def _greedy_kernel(
    tokens_ptr, parents_ptr, target_ptr, path_ptr, length_ptr, emitted_ptr, num_nodes,
    BLOCK: tl.constexpr,
):  # fmt: skip
    base = tl.program_id(0).to(tl.int64) * num_nodes
    idx = tl.arange(0, BLOCK)
    tokens = tl.load(tokens_ptr + base + idx, idx < num_nodes, other=-1)
    parents = tl.load(parents_ptr + base + idx, idx < num_nodes, other=-1)
    node = tl.full([], 0, tl.int32)
    length = tl.full([], 1, tl.int32)
    choice = tl.load(target_ptr + base + node)
    child = _first_child(tokens, parents, idx, node, choice, BLOCK)
    while child < BLOCK:  # children have higher indices: at most N - 1 steps
        tl.store(path_ptr + base + length, child)
        tl.store(emitted_ptr + base + length - 1, choice)
        node = child
        length += 1
        choice = tl.load(target_ptr + base + node)
        child = _first_child(tokens, parents, idx, node, choice, BLOCK)
    tl.store(path_ptr + base, 0)
    tl.store(emitted_ptr + base + length - 1, choice)  # the bonus token
    tl.store(length_ptr + tl.program_id(0), length)


@triton.jit
def _sampling_kernel(
    tokens_ptr, parents_ptr, probs_ptr, noise_ptr, path_ptr, length_ptr, emitted_ptr,
    num_nodes, vocab, depths,
    BLOCK: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    tree = tl.program_id(0).to(tl.int64)
    base = tree * num_nodes
    idx = tl.arange(0, BLOCK)
    tokens = tl.load(tokens_ptr + base + idx, idx < num_nodes, other=-1)
    parents = tl.load(parents_ptr + base + idx, idx < num_nodes, other=-1)
    node = tl.full([], 0, tl.int32)
    length = tl.full([], 1, tl.int32)
    noise_row = noise_ptr + tree * depths * vocab  # depth 0's; depth d is d rows on
    choice = _race(probs_ptr + base * vocab, noise_row, vocab, BLOCK_V)
    child = _first_child(tokens, parents, idx, node, choice, BLOCK)
    while child < BLOCK:
        tl.store(path_ptr + base + length, child)
        tl.store(emitted_ptr + base + length - 1, choice)
        node = child
        length += 1
        row = probs_ptr + (base + node) * vocab
        choice = _race(row, noise_row + (length - 1).to(tl.int64) * vocab, vocab, BLOCK_V)
        child = _first_child(tokens, parents, idx, node, choice, BLOCK)
    tl.store(path_ptr + base, 0)
    tl.store(emitted_ptr + base + length - 1, choice)  # the bonus token: the last sample
    tl.store(length_ptr + tl.program_id(0), length)
