"""STANDALONE training: a small LM of the target's family distilled from the target.

The student is a Llama of `num_layers` layers, evenly spaced ones of the target's (the
first and last included), over `width` coordinates of the target's residual stream (those
where the target's embedding has the most energy). It starts as the target restricted to
those layers and coordinates: every matrix reading the residual stream keeps its columns
at the coordinates, every matrix writing it its rows there, and each RMSNorm weight is
scaled by sqrt(H / width), as a norm over `width` coordinates of a vector that lives on
them is that much smaller than over all H. With every layer and the full width it is the
target exactly. The embedding (tied to the LM head) is the target's, at the coordinates.

Loss: at every learned position, soft cross-entropy against the target's distribution
over the draft vocabulary (the token map drafting scores), on positions whose target
choice is in it; without the target's final states (examples a drafter served) against
the token it chose (`target_cross_entropy`). Teacher forcing is drafting here: on the
target's greedy answers the student's draft k steps after position p is its prediction at
p + k, so held-out acceptance is 1 + the mean run of consecutive correct predictions from
each position.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.training.eagle_trainer import Batch, StepResult, target_cross_entropy


def spaced_layers(total: int, keep: int) -> list[int]:
    """`keep` evenly spaced layer indices of `total`, the first and the last included."""
    return torch.linspace(0, total - 1, keep).round().long().unique().tolist()


def residual_coordinates(target: LlamaForCausalLM, width: int) -> torch.Tensor:
    """The `width` residual coordinates where the target's embedding is largest, ascending."""
    energy = target.embed_tokens.weight.detach().float().pow(2).sum(dim=0)
    return energy.topk(width).indices.sort().values


@torch.no_grad()
def new_student(target: LlamaForCausalLM, width: int, num_layers: int) -> LlamaForCausalLM:
    """The target restricted to `num_layers` of its layers and `width` residual coordinates
    (see the module doc); tied embeddings."""
    tcfg = target.config
    if not 0 < width <= tcfg.hidden_size or not 0 < num_layers <= tcfg.num_layers:
        raise ValueError(
            f"a student needs 1..{tcfg.hidden_size} residual coordinates and 1.."
            f"{tcfg.num_layers} layers, got {width} and {num_layers}"
        )
    layers = spaced_layers(tcfg.num_layers, num_layers)
    cfg = dataclasses.replace(
        tcfg, hidden_size=width, num_layers=len(layers), tie_word_embeddings=True
    )
    student = LlamaForCausalLM(cfg, target.attention_backend)
    keep = residual_coordinates(target, width)
    norm_scale = math.sqrt(tcfg.hidden_size / width)

    def restrict(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return tensor[keep] * norm_scale
        if name.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
            return tensor[:, keep]  # reads the residual stream
        if name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")):
            return tensor[keep]  # writes it
        return tensor

    for ours, theirs in zip(student.layers, (target.layers[i] for i in layers), strict=True):
        for name, param in ours.named_parameters():
            param.copy_(restrict(name, theirs.get_parameter(name)))
    student.embed_tokens.weight.copy_(target.embed_tokens.weight[:, keep])
    student.norm.weight.copy_(restrict("norm.weight", target.norm.weight))
    return student


def causal_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Final-normed hidden states [B, L, H] of a causal pass over padded rows `ids` [B, L]
    (padding at the end never reaches a real position), with autograd."""
    b, length = ids.shape
    positions = torch.arange(length, device=ids.device).repeat(b)
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    x = model.embed_tokens(ids).flatten(0, 1)
    for layer in model.layers:
        attn = layer.self_attn
        q, k, v = (  # each [B, heads, L, D]
            t.view(b, length, -1, attn.head_dim).transpose(1, 2)
            for t in attn.rotated_qkv(layer.input_layernorm(x), cos, sin)
        )
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b * length, attn.q_size))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(b, length, -1)


def distill_loss(
    student: LlamaForCausalLM,
    target: LlamaForCausalLM,
    batch: Batch,
    vocab_ids: torch.Tensor,
    steps: int,
) -> StepResult:
    """`vocab_ids`: the target ids the student scores (ascending); held-out acceptance
    counts chains of up to `steps` drafts from every position."""
    hidden = causal_hidden(student, batch.ids)
    in_vocab = torch.zeros(target.config.vocab_size, dtype=torch.bool, device=hidden.device)
    in_vocab[vocab_ids] = True
    learned = batch.learned & in_vocab[batch.argmax]  # [B, L]
    rows = learned.nonzero(as_tuple=True)
    logits = hidden[rows] @ student.lm_head.weight[vocab_ids].T
    final = None if batch.final is None else batch.final[rows]
    labels = torch.searchsorted(vocab_ids, batch.argmax[rows])
    per_row = target_cross_entropy(logits, final, target.lm_head.weight[vocab_ids], labels)
    hit = torch.zeros_like(learned)
    hit[rows] = vocab_ids[logits.argmax(-1)] == batch.argmax[rows]
    correct = F.pad(hit, (0, steps - 1)).unfold(1, steps, 1)  # [B, L, steps]: hit[p + k]
    loss = per_row.sum() / max(1, len(per_row))
    every = torch.arange(learned.shape[1], device=learned.device).expand_as(learned)
    return StepResult(loss, correct.flatten(0, 1), batch.learned.flatten(), every, every.shape[1])
