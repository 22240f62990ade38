"""Learning a drafter head from the traffic a pool serves: the learner's training side.

An example is a finished request as its drafter saw it: the prompt, the target's
output, and the target features that travelled to the drafter for each position, so the
learner runs no target pass (which would cost as much as a second prefill of all
traffic). The label after each position is the token the target chose there. A hash of
the prompt puts a fixed share of prompts in the held-out set for good, so a restarted
learner, and a benchmark choosing prompts to test on, agree on which never train. The
buffers keep the newest examples; their tokens are saved as they change, and a restarted
learner restores them with one target pass for their features.

Training is the offline trainer's (`eagle_trainer.unrolled_loss`) one batch at a time,
so the learner can look up between steps; a candidate is judged by held-out acceptance
(greedy chains of `ttt_steps`), against the version the pool drafts with.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.speculative.eagle import EagleHead
from specmesh.shared.training.data import Sample
from specmesh.shared.training.eagle_trainer import (
    Acceptance,
    Roots,
    StepResult,
    collate,
    unrolled_loss,
)
from specmesh.shared.training.features import TargetView, extract


def is_heldout(prompt_ids: Sequence[int], share: float) -> bool:
    """Whether a prompt is in the held-out `share` of all prompts (a hash of its ids)."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < share * 2**64


@dataclass
class OnlineOptions:
    ttt_steps: int = 4  # draft steps unrolled per root (the pool's chain length)
    lr: float = 2e-4
    warmup_steps: int = 20  # then the learning rate stays at `lr`
    batch_tokens: int = 2048
    root_fraction: float = 0.25
    buffer_size: int = 1024  # training examples kept, newest
    heldout_size: int = 64  # held-out examples kept, newest
    heldout_share: float = 0.1
    max_len: int = 1024  # tokens of an example kept (its newest)
    seed: int = 0


@dataclass
class Example:
    sample: Sample
    view: TargetView


class OnlineTrainer:
    """A head trained on served examples. `add` may be called from any thread; the rest
    from the learner's training thread."""

    def __init__(self, target: LlamaForCausalLM, head: EagleHead, options: OnlineOptions) -> None:
        """`target`: its embeddings (and LM head, for EAGLE) serve the head."""
        self.target, self.options = target, options
        self.train_set: deque[Example] = deque(maxlen=options.buffer_size)
        self.heldout: deque[Example] = deque(maxlen=options.heldout_size)
        self.new_examples = 0  # added to the training set since the last `take_new`
        self.steps = 0
        self._lock = threading.Lock()
        self._random = random.Random(options.seed)
        self._generator = torch.Generator().manual_seed(options.seed)
        self.reset(head)

    def reset(self, head: EagleHead) -> None:
        """Train `head` (float32, on the target's device) from now on, with a new optimizer."""
        self.head = head.float().to(self.target.embed_tokens.weight.device).train()
        self.head.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(
            self.head.parameters(), lr=self.options.lr, betas=(0.9, 0.95), weight_decay=0.0
        )

    def add(
        self, token_ids: list[int], prompt_len: int, features: torch.Tensor, position: int
    ) -> bool:
        """Keep a served request as an example (its newest `max_len` tokens); True if it
        went to the held-out set. `features` [F, D]: the target's features of positions
        `position`.. (each pairs with the token after it)."""
        end = min(position + len(features) + 1, len(token_ids))
        first = max(position, end - self.options.max_len)
        ids = token_ids[first:end]
        start = max(prompt_len - first, 1)  # the first position whose next token is learned
        if start >= len(ids):
            return False  # nothing generated (after the features start) to learn from
        rows = features[first - position : first - position + len(ids) - 1]
        view = TargetView(
            features=torch.cat([rows, rows.new_zeros(1, rows.shape[1])]),  # last: never read
            final=None,
            argmax=torch.tensor([*ids[1:], 0]),  # the target's choices: the tokens it emitted
        )
        example = Example(Sample(ids, [(start, len(ids))]), view)
        heldout = is_heldout(token_ids[:prompt_len], self.options.heldout_share)
        with self._lock:
            if heldout:
                self.heldout.append(example)
            else:
                self.train_set.append(example)
                self.new_examples += 1
        return heldout

    def save_examples(self, path: Path) -> None:
        """The buffers' tokens, written whole or not at all (their features are not kept: a
        target pass restores them, `restore_examples`)."""
        with self._lock:
            kept = [(e, False) for e in self.train_set] + [(e, True) for e in self.heldout]
        lines = [
            json.dumps({"ids": e.sample.ids, "start": e.sample.spans[0][0], "heldout": held})
            for e, held in kept
        ]
        partial = path.with_suffix(".partial")
        partial.write_text("".join(f"{line}\n" for line in lines))
        partial.replace(path)

    def restore_examples(self, path: Path, features: tuple[tuple[int, ...], bool]) -> int:
        """Put back the examples `save_examples` wrote, older than any added since, each
        with the target's `features` (the head's `target_features`) from a target pass;
        returns how many."""
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if not records:
            return 0
        samples = [Sample(r["ids"], [(r["start"], len(r["ids"]))]) for r in records]
        views = extract(self.target, samples, *features, store_dtype=torch.float16, progress=False)
        restored: dict[bool, list[Example]] = {False: [], True: []}
        for record, sample, view in zip(records, samples, views, strict=True):
            emitted = torch.tensor([*sample.ids[1:], 0])  # the labels, as `add` takes them
            restored[record["heldout"]].append(
                Example(sample, TargetView(view.features, None, emitted))
            )
        with self._lock:
            for buffer, older in (
                (self.train_set, restored[False]),
                (self.heldout, restored[True]),
            ):
                newer = list(buffer)
                buffer.clear()
                buffer.extend(older + newer)  # the deque keeps the newest
            self.new_examples += len(restored[False])
        return len(records)

    def take_new(self) -> int:
        """How many training examples arrived since the last call (`new_examples`)."""
        with self._lock:
            new, self.new_examples = self.new_examples, 0
        return new

    def _loss(self, head: EagleHead, examples: list[Example], roots: Roots) -> StepResult:
        samples, views = [e.sample for e in examples], [e.view for e in examples]
        device = self.target.lm_head.weight.device
        batch = collate(samples, views, list(range(len(samples))), device)
        draft_ids = head.draft_ids if head.eagle3 else None  # None: the target's vocabulary
        return unrolled_loss(head, self.target, batch, self.options.ttt_steps, draft_ids, roots)

    def _pick(self) -> list[Example]:
        """Random training examples, about `batch_tokens` tokens."""
        with self._lock:
            pool = list(self.train_set)
        self._random.shuffle(pool)
        picked, tokens = [], 0
        for e in pool:
            if picked and tokens + len(e.sample.ids) > self.options.batch_tokens:
                break
            picked.append(e)
            tokens += len(e.sample.ids)
        return picked

    def train_step(self) -> float:
        """One optimizer step on a random batch; returns its loss. Traffic has no last
        step to decay towards: the learning rate warms up, then stays."""
        warm = min(1.0, (self.steps + 1) / self.options.warmup_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = self.options.lr * warm
        roots = Roots(self.options.root_fraction, self._generator)
        result = self._loss(self.head, self._pick(), roots)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        self.steps += 1
        return result.loss.item()

    @torch.no_grad()
    def heldout_acceptance(self, head: EagleHead) -> float:
        """Acceptance length of greedy chains of `ttt_steps` on the held-out examples
        (1.0: none held out yet)."""
        with self._lock:
            examples = list(self.heldout)
        if not examples:
            return 1.0
        training = head.training
        head.eval()
        acceptance = Acceptance()
        for start in range(0, len(examples), 8):
            batch = examples[start : start + 8]
            r = self._loss(head, batch, Roots())
            acceptance.add(r.correct, r.valid, len(batch))
        head.train(training)
        return acceptance.length
