"""What a request does to the target's logits before a token is sampled or a draft is
verified: its `logit_bias`, `min_tokens` (no EOS or stop token before then) and grammar.

Verification applies the same to every node of a draft tree, each at its own place in the
output, so speculation accepts exactly what sampling would draw."""

from __future__ import annotations

import torch
from specmesh.shared.core.sequence import Sequence


def shapes_logits(seq: Sequence) -> bool:
    p = seq.params
    return bool(p.logit_bias) or p.min_tokens > len(seq.output_ids) or seq.grammar is not None


def processed_logits(
    logits: torch.Tensor, seq: Sequence, drafted: list[list[int]], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """[rows, vocab] logits of `seq`, row i for the token after `drafted[i]` (tokens past its
    output so far: [] for a sampled row, a tree node's path for verification)."""
    p = seq.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=logits.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits = logits.index_add(1, ids, bias.expand(len(logits), -1))
    done = len(seq.output_ids)
    early = [i for i, path in enumerate(drafted) if done + len(path) < p.min_tokens]
    ender_ids = sorted(eos_token_ids | set(p.stop_token_ids))  # none: a model without EOS
    if early and ender_ids:  # too soon to end: neither EOS nor a stop token
        enders = torch.tensor(ender_ids, dtype=torch.long, device=logits.device)
        rows = torch.tensor(early, device=logits.device)
        never = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        logits = logits.index_put((rows[:, None], enders[None, :]), never)
    if seq.grammar is not None:
        allowed = seq.grammar.masks_after(drafted).to(logits.device)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def sampled_logits(
    logits: torch.Tensor, sampled: list[Sequence], eos_token_ids: frozenset[int]
) -> torch.Tensor:
    """[n, vocab] logits of the sequences about to sample, each row as its request shapes it."""
    shaped = [shapes_logits(seq) for seq in sampled]
    if not any(shaped):
        return logits
    rows = [
        processed_logits(logits[i : i + 1], seq, [[]], eos_token_ids)
        if shape
        else logits[i : i + 1]
        for i, (seq, shape) in enumerate(zip(sampled, shaped, strict=True))
    ]
    return torch.cat(rows)
