"""DFLASH training (SpecForge's recipe): blocks drafted from random anchors, all in one pass.

For an anchor position a of a sample, the block is [token a, MASK x (B-1)] at positions
a .. a+B-1; it sees the context (the target's features at positions < a) and all of
itself, and its output at block index k >= 1 learns the target's distribution for the
token at position a+k (the target's choice after position a+k-1). Each sample's anchors
share one pass: their queries attend to the sample's context keys before their anchor
and to their own block only. Loss: soft cross-entropy against the target over the draft
vocabulary (the token map drafting scores), on positions whose target choice is in it,
weighted exp(-(k-1)/7) (SpecForge's gamma); without the target's final states (examples
a drafter served) against the token it chose (`target_cross_entropy`). Held-out
acceptance: 1 + the mean number of leading block positions whose greedy draft is the
target's choice. On-policy (see `eagle_trainer.py`): anchors are drawn as the roots are
there, and block index k's loss counts only where the drafts at 1..k-1 of its block were
right (the weights' sum, the denominator, stays that of all learned positions).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.speculative.dflash import DFlashDraft, DFlashSpec, default_target_layers
from specmesh.shared.tokenizer import Tokenizer
from specmesh.shared.training.eagle_trainer import (
    Batch,
    Roots,
    StepResult,
    reached,
    target_cross_entropy,
)

DECAY_GAMMA = 7.0


def mask_token_id(tokenizer: Tokenizer, vocab_size: int) -> int:
    """The block's placeholder: the first embedding row no token uses, else EOS (SpecForge's
    order, for tokenizers without a mask token)."""
    if tokenizer.vocab_size < vocab_size:
        return tokenizer.vocab_size
    if tokenizer.eos_token_id is None:
        raise ValueError("DFLASH needs a mask token: the tokenizer has no free id and no EOS")
    return tokenizer.eos_token_id


def new_dflash(
    target: LlamaForCausalLM, num_layers: int, block_size: int, mask_id: int, seed: int
) -> DFlashDraft:
    """A draft of `num_layers` layers shaped like the target's, reading z-lab's default
    target layers. It starts from the target's last layers (and q/k norms of one), `fc`
    passing the last feature it reads through, and the target's final norm."""
    torch.manual_seed(seed)
    tcfg = target.config
    cfg = dataclasses.replace(tcfg, num_layers=num_layers, architecture="LlamaForCausalLM")
    layers = default_target_layers(tcfg.num_layers, num_layers)
    draft = DFlashDraft(DFlashSpec(cfg, block_size, mask_id, layers))
    hidden, q = tcfg.hidden_size, tcfg.num_heads * tcfg.head_dim
    with torch.no_grad():
        for ours, theirs in zip(draft.layers, target.layers[-num_layers:], strict=True):
            qkv = theirs.self_attn.qkv_proj.weight
            ours.self_attn.q_proj.weight.copy_(qkv[:q])
            ours.self_attn.kv_proj.weight.copy_(qkv[q:])
            ours.self_attn.o_proj.weight.copy_(theirs.self_attn.o_proj.weight)
            ours.mlp.load_state_dict(theirs.mlp.state_dict())
            ours.input_layernorm.load_state_dict(theirs.input_layernorm.state_dict())
            ours.post_attention_layernorm.load_state_dict(
                theirs.post_attention_layernorm.state_dict()
            )
        draft.fc.weight.zero_()
        draft.fc.weight[:, -hidden:] = torch.eye(hidden)
        draft.norm.weight.copy_(target.norm.weight)
    return draft


def _at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[s, index[s, ...]] for x [S, L, ...] and index [S, ...] (past L: zeros)."""
    s, length = x.shape[:2]
    padded = F.pad(x, (0, 0) * (x.dim() - 2) + (0, int(index.max()) + 1 - length))
    flat = index.reshape(s, -1, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
    return padded.gather(1, flat).view(*index.shape, *x.shape[2:])


def block_mask(anchors: torch.Tensor, block: int, length: int) -> torch.Tensor:
    """[S, r*B, L + r*B]: the queries of anchor j see context positions < anchors[:, j] and
    the B tokens of their own block."""
    s, r = anchors.shape
    context = torch.arange(length, device=anchors.device) < anchors[..., None]  # [S, r, L]
    context = context[:, :, None].expand(s, r, block, length).reshape(s, r * block, length)
    own = torch.eye(r, dtype=torch.bool, device=anchors.device)
    own = own[:, None, :, None].expand(r, block, r, block).reshape(r * block, r * block)
    return torch.cat([context, own.expand(s, -1, -1)], dim=-1)


def block_loss(
    draft: DFlashDraft,
    target: LlamaForCausalLM,
    batch: Batch,
    vocab_ids: torch.Tensor,
    anchors: Roots,
) -> StepResult:
    """`vocab_ids`: the target ids the draft scores (ascending). Loss and accuracy over the
    `anchors` picked among each sample's learned positions; on-policy, a block position
    counts only where the drafts before it in its block were all right."""
    s, length = batch.ids.shape
    block, device = draft.spec.block_size, batch.ids.device
    embed = target.embed_tokens.weight
    positions = torch.arange(length, device=device)
    context = [
        (k.view(s, length, *k.shape[1:]), v.view(s, length, *v.shape[1:]))
        for k, v in draft.context(batch.features.flatten(0, 1), positions.repeat(s))
    ]
    picked = anchors.pick(batch.learned)  # [S, r]
    at = picked[..., None] + torch.arange(block, device=device)  # [S, r, B] block positions
    tokens = torch.full_like(at, draft.spec.mask_token_id)
    tokens[..., 0] = batch.ids.gather(1, picked)
    mask = block_mask(picked, block, length)
    hidden = draft(embed[tokens.flatten()], at.flatten(), context, mask)
    hidden = hidden.view(*at.shape, -1)[:, :, 1:]  # drafts of positions a+1 .. a+B-1
    before = at[..., :-1]  # the position each draft's label follows
    choice = _at(batch.argmax, before)
    in_vocab = torch.zeros(embed.shape[0], dtype=torch.bool, device=device)
    in_vocab[vocab_ids] = True
    anchor_ok = batch.learned.gather(1, picked)[..., None]
    learned = _at(batch.learned, before) & in_vocab[choice] & anchor_ok  # [S, r, B-1]
    rows = learned.nonzero(as_tuple=True)
    head = target.lm_head.weight[vocab_ids]
    logits = hidden[rows] @ head.T
    weight = torch.exp(-rows[2].float() / DECAY_GAMMA)  # block index k - 1
    final = None if batch.final is None else _at(batch.final, before)[rows]
    labels = torch.searchsorted(vocab_ids, choice[rows])
    per_row = target_cross_entropy(logits, final, head, labels)
    correct = torch.zeros_like(learned)
    correct[rows] = vocab_ids[logits.argmax(-1)] == choice[rows]
    counted = weight * reached(correct)[rows] if anchors.on_policy else weight
    loss = (per_row * counted).sum() / weight.sum().clamp(min=1e-6)
    valid = anchor_ok.flatten() & learned[..., 0].flatten()
    return StepResult(loss, correct.flatten(0, 1), valid, picked, length)
