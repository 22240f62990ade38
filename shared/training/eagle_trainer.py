"""Training an EAGLE / EAGLE-3 head on the target's own view of the data.

Training-time test (EAGLE-3): each batch is unrolled over `ttt_steps` draft steps. Entry i
pairs token i+1 with the feature of position i; at step k it reads token i+1+k and the
head's own output of step k-1 (step 0: the target's feature), and learns the target's
distribution for the token after position i+1+k. Its query attends to step 0's entries
0..i (the context, built from real target features) and to entry i of steps 1..k (the
draft chain above it), exactly what it sees when drafting a chain at serving time. Only a
random `root_fraction` of the entries are unrolled as roots (the context still comes from
all of them): on a CPU, training is bound by compute, not by data.

Loss (SpecForge's): per step, soft cross-entropy against the target's distribution over
the draft vocabulary, on positions whose target choice is in that vocabulary, weighted
0.8^k. Without the target's final states (examples a drafter served: it sees the
features, not the output layer) the label is the target's chosen token, whose expected
cross-entropy is the same. Held-out acceptance: tokens per verification of greedy
chain drafting (the correct leading steps plus the bonus token), walked along each sample as
serving walks it (`Acceptance`).

On-policy stage (`--on-policy-epochs`, after the main one): training where the head's own
drafts are rejected. Per batch, a probe without gradients unrolls every entry as a root:
`correct` [B*M, K] (K = `ttt_steps`) gives each entry's greedy chain length
c = sum_k prod_{j<=k} correct[:, j], in 0..K. The step's roots are then drawn, without
replacement, with chance proportional to w = K + 1 - c [B, M] (a chain that breaks at
once is K + 1 times as likely to be trained as one right all the way), as the r largest
u^(1/w) for u ~ U(0, 1) (Efraimidis-Spirakis; w = 1 everywhere is the main stage's
uniform choice). And step k's cross-entropy at a root is multiplied by
reached[k] = prod_{j<k} correct[j] of the same pass: serving drafts step k only where
steps 0..k-1 were accepted, so the loss counts what verification sees. The mean stays
over all the step's learned roots, so a step few chains reach weighs little.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.rope import apply_rope
from specmesh.shared.speculative.eagle import EagleHead
from specmesh.shared.training.data import Sample
from specmesh.shared.training.features import TargetView

STEP_DECAY = 0.8


@dataclass
class Batch:
    """Padded samples; M = longest length - 1 entries each."""

    ids: torch.Tensor  # [B, M + 1]
    features: torch.Tensor  # [B, M + 1, F]
    final: torch.Tensor | None  # [B, M + 1, H]; None: labels are the target's choices
    argmax: torch.Tensor  # [B, M + 1]
    learned: torch.Tensor  # [B, M + 1] bool: token p+1 is learned from position p


def learned_positions(sample: Sample) -> torch.Tensor:
    """[N] bool: position p learns the token after it (p + 1 in one of the spans)."""
    mask = torch.zeros(len(sample.ids), dtype=torch.bool)
    for start, end in sample.spans:
        mask[max(start - 1, 0) : max(end - 1, 0)] = True
    return mask


def make_batches(
    samples: list[Sample], indices: list[int], tokens: int, seed: int
) -> list[list[int]]:
    """`indices` of `samples` grouped by length (little padding), about `tokens` tokens
    each, in a seeded random order."""
    order = sorted(indices, key=lambda i: len(samples[i].ids))
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * len(samples[i].ids) > tokens:
            batches.append(current)
            current = []
        current.append(i)
    batches += [current] if current else []
    random.Random(seed).shuffle(batches)
    return batches


def collate(
    samples: list[Sample],
    views: Sequence[TargetView],
    idx: list[int],
    device: torch.device,
) -> Batch:
    """Samples `idx` padded into a batch; `views` may build each view only when asked."""
    chosen = [views[i] for i in idx]
    finals = [v.final for v in chosen]

    def pad(items: list[torch.Tensor]) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(items, batch_first=True).to(device)

    return Batch(
        ids=pad([torch.tensor(samples[i].ids) for i in idx]),
        features=pad([v.features for v in chosen]).float(),
        final=None if any(f is None for f in finals) else pad(finals).float(),
        argmax=pad([v.argmax for v in chosen]),
        learned=pad([learned_positions(samples[i]) for i in idx]),
    )


class UnrolledAttention:
    """The head's attention in the training-time-test layout (see the module doc), for `r`
    drafting roots per sample: step 0's keys and values exist for every entry (the
    context); queries, and the keys of later steps, only for the roots."""

    def __init__(self, head: EagleHead, context: torch.Tensor, roots: torch.Tensor) -> None:
        """context: [B*M, in] step 0's attention input at every entry; roots: [B, r]."""
        self.head, a = head, head.self_attn
        (self.b, self.r), self.m = roots.shape, len(context) // roots.shape[0]
        k, v = a.unrotated_keys_values(context)  # only roots query
        positions = torch.arange(self.m, device=roots.device).repeat(self.b)
        k = self._rope(k, a.num_kv_heads, positions)
        # [B, KVH, 1, M, D]: broadcast over each KV group's query heads
        self.keys = k.view(self.b, self.m, a.num_kv_heads, -1).transpose(1, 2)[:, :, None]
        self.values = v.reshape(self.b, self.m, a.num_kv_heads, -1).transpose(1, 2)[:, :, None]
        self.positions = roots.reshape(-1)
        # [B, 1, 1, r, M]: root i sees context entries 0..i
        seen = torch.arange(self.m, device=roots.device) <= roots[..., None]
        self.context_mask = seen[:, None, None]
        self.chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step >= 1: K, V

    def _rope(self, x: torch.Tensor, heads: int, positions: torch.Tensor) -> torch.Tensor:
        h = self.head
        return apply_rope(
            x.reshape(len(x), heads, -1), h.rope_cos[positions], h.rope_sin[positions]
        )

    def step(self, k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The attention of draft step k over the roots' rows [B*r, in] (root i at i + k)."""
        return lambda x: self._attend(x, k)

    def _attend(self, x: torch.Tensor, k: int) -> torch.Tensor:
        a, b, r = self.head.self_attn, self.b, self.r
        group = a.num_heads // a.num_kv_heads
        q, key, value = a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q = self._rope(q, a.num_heads, self.positions + k)
        q = q.view(b, r, a.num_kv_heads, group, -1).permute(0, 2, 3, 1, 4)  # [B,KVH,G,r,D]
        scale = a.head_dim**-0.5
        scores = (q @ self.keys.transpose(-1, -2)) * scale  # [B,KVH,G,r,M]
        scores = scores.masked_fill(~self.context_mask, float("-inf"))
        if k > 0:  # the draft chain above each root: its own entry at steps 1..k
            key = self._rope(key, a.num_kv_heads, self.positions + k)
            shape = (b, r, a.num_kv_heads, 1, 1, -1)  # [B,r,KVH,1,1,D] -> [B,KVH,1,r,1,D]
            self.chain.append(
                tuple(t.reshape(shape).permute(0, 2, 3, 1, 4, 5) for t in (key, value))
            )
            chain_k = torch.cat([c[0] for c in self.chain], dim=-2)  # [B,KVH,1,r,k,D]
            chain_v = torch.cat([c[1] for c in self.chain], dim=-2)
            chain = (q[..., None, :] * chain_k).sum(-1) * scale  # [B,KVH,G,r,k]
            scores = torch.cat([scores, chain], dim=-1)
        p = scores.softmax(-1)
        out = p[..., : self.m] @ self.values
        if k > 0:
            out = out + (p[..., self.m :, None] * chain_v).sum(-2)
        return a.o_proj(out.permute(0, 3, 1, 2, 4).reshape(b * r, a.q_size))


@dataclass
class StepResult:
    loss: torch.Tensor
    correct: torch.Tensor  # [B*r, steps] bool: step k's greedy draft is the target's choice
    valid: torch.Tensor  # [B*r] the root's first label is learned
    roots: torch.Tensor  # [B, r] the entries unrolled, ascending
    entries: int  # M, each sample's entries

    def per_entry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct [B*M, steps], valid [B*M]) at every entry, as `Acceptance` reads them;
        an entry not unrolled is neither."""
        b = self.roots.shape[0]
        offsets = torch.arange(b, device=self.roots.device)[:, None] * self.entries
        index = (self.roots + offsets).flatten()
        correct = self.correct.new_zeros(b * self.entries, self.correct.shape[1])
        valid = self.valid.new_zeros(b * self.entries)
        correct[index], valid[index] = self.correct, self.valid
        return correct, valid


@dataclass
class Roots:
    """Which entries a loss unrolls as drafting roots (DFLASH: block anchors): a random
    `fraction` of each sample's valid entries (every valid one when 1: serving never
    drafts from a prompt's entries, so judging skips them). On-policy (see the
    module doc): `preference` [B, M] weighs each entry's chance, and a draft step counts
    only where the head's own chain reached it."""

    fraction: float = 1.0
    generator: torch.Generator | None = None
    preference: torch.Tensor | None = None

    @property
    def on_policy(self) -> bool:
        return self.preference is not None

    def pick(self, valid: torch.Tensor) -> torch.Tensor:
        """[B, r] ascending roots per sample among its valid entries [B, M]: r = ceil(fraction
        * M), at fraction 1 the most valid entries a sample has. Samples short of valid
        entries get invalid ones, which the loss ignores."""
        b, m = valid.shape
        if self.fraction >= 1:
            r = max(1, int(valid.sum(dim=1).max()))
        else:
            r = max(1, math.ceil(self.fraction * m))
        if r >= m:
            return torch.arange(m, device=valid.device).expand(b, m)
        noise = torch.rand(b, m, generator=self.generator, device=valid.device)
        if self.preference is not None:
            noise = noise ** (1 / self.preference)
        return (noise + valid.float()).topk(r, dim=1).indices.sort(dim=1).values


def reached(correct: torch.Tensor) -> torch.Tensor:
    """[..., K] bool: whether verification gets to a chain's step k, its steps 0..k-1 all
    correct, from `correct` [..., K]."""
    return F.pad(correct.int(), (1, 0), value=1)[..., :-1].cumprod(-1).bool()


def unrolled_loss(
    head: EagleHead,
    target: LlamaForCausalLM,
    batch: Batch,
    steps: int,
    draft_ids: torch.Tensor | None,
    roots: Roots,
) -> StepResult:
    """`draft_ids`: target id of each draft-vocabulary entry (EAGLE-3), None for EAGLE.
    The loss and accuracy are over the `roots` picked as drafting roots; context keys come
    from every entry."""
    b, m = batch.ids.shape[0], batch.ids.shape[1] - 1
    embed = target.embed_tokens.weight
    label_head = target.lm_head.weight if draft_ids is None else target.lm_head.weight[draft_ids]
    in_vocab = torch.ones(embed.shape[0], dtype=torch.bool, device=embed.device)
    row_of = torch.arange(embed.shape[0], device=embed.device)  # target id -> logits row
    if draft_ids is not None:
        in_vocab.zero_()[draft_ids] = True
        row_of[draft_ids] = torch.arange(len(draft_ids), device=embed.device)
    features = head.project(batch.features[:, :m].reshape(b * m, -1))
    context, _ = head.attention_input(embed[batch.ids[:, 1:].reshape(-1)], features)
    picked = roots.pick(batch.learned[:, 1:])  # [B, r]
    attention = UnrolledAttention(head, context, picked)

    def at(x: torch.Tensor, k: int) -> torch.Tensor:
        """x[b, root + k] for every root, flattened (past the end: padding)."""
        padded = F.pad(x, (0, 0) * (x.dim() - 2) + (0, k + 1))
        index = (picked + k).reshape(b, -1, *([1] * (x.dim() - 2)))
        return padded.gather(1, index.expand(-1, -1, *x.shape[2:])).flatten(0, 1)

    hidden = at(features.view(b, m, -1), 0)
    loss = torch.zeros((), device=embed.device)
    correct = torch.zeros(len(hidden), steps, dtype=torch.bool, device=embed.device)
    for k in range(steps):
        hidden = head.decode(embed[at(batch.ids, 1 + k)], hidden, attention.step(k))
        choice = at(batch.argmax, 1 + k)
        learned = at(batch.learned, 1 + k) & in_vocab[choice]
        if not learned.any():
            continue
        rows = learned.nonzero()[:, 0]
        logits = head.logits(hidden[rows], target).float()
        final = None if batch.final is None else at(batch.final, 1 + k)[rows]
        per_row = target_cross_entropy(logits, final, label_head, row_of[choice[rows]])
        if roots.on_policy:
            per_row = per_row * reached(correct[rows])[:, k]
        loss = loss + STEP_DECAY**k * per_row.mean()
        guess = logits.argmax(-1)
        guess = guess if draft_ids is None else draft_ids[guess]
        correct[rows, k] = guess == choice[rows]
    return StepResult(loss, correct, at(batch.learned, 1), picked, m)


def target_cross_entropy(
    logits: torch.Tensor, final: torch.Tensor | None, head: torch.Tensor, labels: torch.Tensor
) -> torch.Tensor:
    """[N] cross-entropy of a drafter's `logits` [N, V] against the target: its distribution
    (`soft_cross_entropy` of its final states `final`), or without them (None: examples a
    drafter served carry none) the token it chose, at logits row `labels` [N]: an unbiased
    sample of that distribution, of the same expected cross-entropy."""
    if final is None:
        return F.cross_entropy(logits.float(), labels, reduction="none")
    return soft_cross_entropy(logits, final, head)


def soft_cross_entropy(
    logits: torch.Tensor, final: torch.Tensor, head: torch.Tensor
) -> torch.Tensor:
    """[N] cross-entropy of a drafter's `logits` [N, V] against the target's distribution
    softmax(final @ head.T), `final` [N, H] its final normed hidden states and `head`
    [V, H] the rows of its LM head for the same V ids."""
    with torch.no_grad():
        labels = torch.softmax(final.float() @ head.T.float(), dim=-1)
    return -(labels * torch.log_softmax(logits.float(), dim=-1)).sum(-1)


@dataclass
class Acceptance:
    """Greedy chain drafting walked along held-out samples as serving walks them: from the
    entry after an answer's first (whose token the prefill makes), a chain of c correct
    steps yields c + 1 tokens (the bonus one included) in one verification, and the next
    chain starts c + 1 entries on. Its `length`, tokens per verification, is the acceptance
    length serving reports. (The mean over every entry as a root counts a stretch the head
    drafts well once per position, not once per chain, and overstates what serving sees.)"""

    tokens: int = 0
    steps: int = 0

    def add(self, correct: torch.Tensor, valid: torch.Tensor, samples: int) -> None:
        """correct [S*M, K], valid [S*M]: a pass over `samples` samples at every entry
        (`StepResult.per_entry` of a `Roots()` pass), sample-major."""
        chains = correct.int().cumprod(dim=1).sum(dim=1).view(samples, -1).tolist()
        for chain, learned in zip(chains, valid.view(samples, -1).tolist(), strict=True):
            p = 1  # an answer's first token comes from the prefill, not from a draft
            while p < len(chain):
                if learned[p] and learned[p - 1]:
                    self.tokens += chain[p] + 1
                    self.steps += 1
                    p += chain[p]
                p += 1

    @property
    def length(self) -> float:
        return self.tokens / self.steps if self.steps else 1.0


def lr_at(step: int, total: int, peak: float, warmup: float = 0.02) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    warm = max(1, int(total * warmup))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
