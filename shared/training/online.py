"""Learning a drafter from the traffic a pool serves: the learner's training side.

An example is a finished request as its drafter saw it: the prompt, the target's
output, and the target features that travelled to the drafter for each position (none
for STANDALONE, a small LM that reads tokens alone), so the learner runs no target pass
(which would cost as much as a second prefill of all traffic). The label after each
position is the token the target chose there. A hash of the prompt puts a fixed share of
prompts in the held-out set for good, so a restarted learner, and a benchmark choosing
prompts to test on, agree on which never train. The buffers keep the newest examples;
their tokens are saved as they change, and a restarted learner restores them with one
target pass for their features.

`OnlineTrainer` keeps the buffers and trains one batch at a time, so the learner can look
up between steps. What differs per algorithm family is behind `load` and `save` (a
version's checkpoint, in the layout the pool's drafters load), `loss` (the offline
trainer's: `unrolled_loss`, `block_loss`, `distill_loss`) and `target_features` (what
examples carry); `online_trainer` picks the family. A candidate is judged by held-out
acceptance (greedy chains of up to `ttt_steps` drafts walked along each example as serving
walks it, `Acceptance`), against the version the pool drafts with; a draft's scores are
kept per example (`heldout_scores`), so the pool's version, judged again each round, walks
only the examples that arrived since.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import json
import random
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.loader import load_model, save_model
from specmesh.shared.speculative.dflash import (
    DFlashDraft,
    load_dflash,
    read_dflash_spec,
    save_dflash,
)
from specmesh.shared.speculative.eagle import (
    EagleHead,
    load_head,
    read_head_spec,
    save_head,
    save_mtp,
)
from specmesh.shared.speculative.standalone import load_token_map
from specmesh.shared.training.data import Sample
from specmesh.shared.training.dflash_trainer import block_loss
from specmesh.shared.training.eagle_trainer import (
    Acceptance,
    Batch,
    Roots,
    StepResult,
    collate,
    unrolled_loss,
)
from specmesh.shared.training.features import TargetView, extract
from specmesh.shared.training.student_trainer import distill_loss
from torch import nn


def is_heldout(prompt_ids: Sequence[int], share: float) -> bool:
    """Whether a prompt is in the held-out `share` of all prompts (a hash of its ids)."""
    digest = hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < share * 2**64


@dataclass
class OnlineOptions:
    ttt_steps: int = 4  # drafts per chain (the pool's): EAGLE unrolls them, held-out counts them
    lr: float = 2e-4
    warmup_steps: int = 20  # then the learning rate stays at `lr`
    batch_tokens: int = 2048
    root_fraction: float = 0.1  # fewer roots, cheaper steps: more steps learn more per second
    buffer_size: int = 1024  # training examples kept, newest
    heldout_size: int = 64  # held-out examples kept, newest
    heldout_share: float = 0.1
    max_len: int = 1024  # tokens of an example kept (its newest)
    seed: int = 0


@dataclass
class Example:
    sample: Sample
    view: TargetView
    serial: int  # unique within its trainer: the key of its held-out scores


def pooled(scores: Mapping[int, Acceptance]) -> float:
    """The acceptance length of held-out examples scored apart (`heldout_scores`)."""
    tallies = scores.values()
    return Acceptance(sum(a.tokens for a in tallies), sum(a.steps for a in tallies)).length


class OnlineTrainer(abc.ABC):
    """A draft model trained on served examples. `add` may be called from any thread; the
    rest from the learner's training thread."""

    # The target features examples carry, as the pool's drafters read them
    # (`Drafter.target_features`); none: examples are tokens alone.
    target_features: tuple[tuple[int, ...], bool] = ((), False)

    def __init__(self, target: LlamaForCausalLM, options: OnlineOptions, path: Path) -> None:
        """`target`: its embeddings (and LM head) serve the draft; `path`: the checkpoint
        training starts from."""
        self.target, self.options = target, options
        self.device = target.embed_tokens.weight.device
        self.train_set: deque[Example] = deque(maxlen=options.buffer_size)
        self.heldout: deque[Example] = deque(maxlen=options.heldout_size)
        self.new_examples = 0  # added to the training set since the last `take_new`
        self.steps = 0
        self._lock = threading.Lock()
        self._serials = itertools.count()
        self._random = random.Random(options.seed)
        self._generator = torch.Generator().manual_seed(options.seed)
        self.reset(self.load(path))

    @abc.abstractmethod
    def load(self, path: Path) -> nn.Module:
        """The version checkpoint at `path`, float32 on the target's device, in eval mode."""

    @abc.abstractmethod
    def save(self, draft: nn.Module, path: Path) -> None:
        """`draft` as a checkpoint in the layout the pool's drafters load."""

    @abc.abstractmethod
    def loss(self, draft: nn.Module, batch: Batch, roots: Roots) -> StepResult:
        """The offline trainer's loss of `draft` over `batch`; with `Roots()`, every valid
        entry's greedy chain (`StepResult.per_entry` gives them as `Acceptance` reads them)."""

    def reset(self, draft: nn.Module) -> None:
        """Train `draft` (float32, on the target's device) from now on, with a new optimizer."""
        self.draft = draft.float().to(self.device).train()
        self.draft.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(
            self.draft.parameters(), lr=self.options.lr, betas=(0.9, 0.95), weight_decay=0.0
        )

    def add(
        self, token_ids: list[int], prompt_len: int, features: torch.Tensor | None, position: int
    ) -> bool:
        """Keep a served request as an example (its newest `max_len` tokens); True if it
        went to the held-out set. `features` [F, D]: the target's features of positions
        `position`.. (each pairs with the token after it); None where examples carry none."""
        if features is None:  # every position, with zero-width rows
            features, position = torch.zeros(len(token_ids) - 1, 0, dtype=torch.float16), 0
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
            argmax=emitted(ids),
        )
        example = Example(Sample(ids, [(start, len(ids))]), view, next(self._serials))
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

    def restore_examples(self, path: Path) -> int:
        """Put back the examples `save_examples` wrote, older than any added since, each
        with its `target_features` from a target pass; returns how many."""
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if not records:
            return 0
        samples = [Sample(r["ids"], [(r["start"], len(r["ids"]))]) for r in records]
        restored: dict[bool, list[Example]] = {False: [], True: []}
        for record, sample, view in zip(records, samples, self._views(samples), strict=True):
            restored[record["heldout"]].append(Example(sample, view, next(self._serials)))
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

    def _views(self, samples: list[Sample]) -> list[TargetView]:
        """Each sample as `add` keeps it: the features its drafter was sent (zero-width
        where examples carry none), labelled with the tokens the target emitted."""
        layers, normed = self.target_features
        if layers:
            views = extract(
                self.target, samples, layers, normed, store_dtype=torch.float16, progress=False
            )
            features = [v.features for v in views]
        else:
            features = [torch.zeros(len(s.ids), 0, dtype=torch.float16) for s in samples]
        return [TargetView(f, None, emitted(s.ids)) for f, s in zip(features, samples, strict=True)]

    def take_new(self) -> int:
        """How many training examples arrived since the last call (`new_examples`)."""
        with self._lock:
            new, self.new_examples = self.new_examples, 0
        return new

    def _batch(self, examples: list[Example]) -> Batch:
        samples, views = [e.sample for e in examples], [e.view for e in examples]
        return collate(samples, views, list(range(len(samples))), self.device)

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
        result = self.loss(self.draft, self._batch(self._pick()), roots)
        self.optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.draft.parameters(), 0.5)
        self.optimizer.step()
        self.steps += 1
        return result.loss.item()

    def heldout_examples(self) -> list[Example]:
        """The held-out examples now kept (a snapshot: drafts judged against each other
        walk the same ones)."""
        with self._lock:
            return list(self.heldout)

    @torch.no_grad()
    def heldout_scores(
        self,
        draft: nn.Module,
        examples: list[Example],
        known: Mapping[int, Acceptance] | None = None,
    ) -> dict[int, Acceptance]:
        """Each of `examples` walked with greedy chains of up to `ttt_steps` drafts of
        `draft`, by serial; those in `known` (this draft's earlier scores) are not walked
        again."""
        known = known or {}
        scores = {e.serial: known[e.serial] for e in examples if e.serial in known}
        new = [e for e in examples if e.serial not in scores]
        training = draft.training
        draft.eval()
        for start in range(0, len(new), 8):
            batch = new[start : start + 8]
            correct, valid = self.loss(draft, self._batch(batch), Roots()).per_entry()
            correct = correct[:, : self.options.ttt_steps].unflatten(0, (len(batch), -1))
            valid = valid.view(len(batch), -1)
            for i, example in enumerate(batch):
                scores[example.serial] = Acceptance()
                scores[example.serial].add(correct[i], valid[i], 1)
        draft.train(training)
        return scores

    def heldout_acceptance(self, draft: nn.Module) -> float:
        """Acceptance length of `draft` on the held-out examples (1.0: none held out yet)."""
        return pooled(self.heldout_scores(draft, self.heldout_examples()))


def emitted(ids: list[int]) -> torch.Tensor:
    """The labels of a served sample: after each position, the token the target emitted
    (the last position has none: never learned)."""
    return torch.tensor([*ids[1:], 0])


class EagleTrainer(OnlineTrainer):
    """EAGLE and EAGLE-3 heads, and NEXTN's MTP layer: `unrolled_loss` over `ttt_steps`."""

    def __init__(
        self,
        target: LlamaForCausalLM,
        options: OnlineOptions,
        path: Path,
        algorithm: str,
        target_config: dict,
    ) -> None:
        """`target_config`: the target's config.json (NEXTN's checkpoints repeat it)."""
        self.algorithm, self.target_config = algorithm, target_config
        self.spec = read_head_spec(path, algorithm, target.config)
        self.target_features = self.spec.target_features
        super().__init__(target, options, path)

    def load(self, path: Path) -> EagleHead:
        head, _, _ = load_head(path, self.algorithm, self.target)
        return head.float().to(self.device).eval()

    def save(self, draft: EagleHead, path: Path) -> None:
        if draft.mtp:
            save_mtp(draft, path, self.target_config)
        else:
            save_head(draft, path, self.target.config, self.spec)

    def loss(self, draft: EagleHead, batch: Batch, roots: Roots) -> StepResult:
        draft_ids = draft.draft_ids if draft.eagle3 else None  # None: the target's vocabulary
        return unrolled_loss(draft, self.target, batch, self.options.ttt_steps, draft_ids, roots)


class DFlashTrainer(OnlineTrainer):
    """DFLASH block drafts: `block_loss`, over the ids the pool's drafters score."""

    def __init__(
        self, target: LlamaForCausalLM, options: OnlineOptions, path: Path, token_map: str | None
    ) -> None:
        self.vocab_ids = draft_vocab(token_map, target.config.vocab_size, target)
        self.target_features = (read_dflash_spec(path, target.config).target_layers, False)
        super().__init__(target, options, path)

    def load(self, path: Path) -> DFlashDraft:
        return load_dflash(path, self.target.config).to(self.device).eval()

    def save(self, draft: DFlashDraft, path: Path) -> None:
        save_dflash(draft, path, self.target.config)

    def loss(self, draft: DFlashDraft, batch: Batch, roots: Roots) -> StepResult:
        return block_loss(draft, self.target, batch, self.vocab_ids, roots)


class StandaloneTrainer(OnlineTrainer):
    """STANDALONE draft LMs: `distill_loss` at every position (roots play no part), over
    the ids the pool's drafters score; examples are tokens alone."""

    def __init__(
        self, target: LlamaForCausalLM, options: OnlineOptions, path: Path, token_map: str | None
    ) -> None:
        self.hf_config = json.loads((path / "config.json").read_text())  # versions repeat it
        self.vocab_ids = draft_vocab(token_map, self.hf_config["vocab_size"], target)
        super().__init__(target, options, path)

    def load(self, path: Path) -> LlamaForCausalLM:
        return load_model(path, self.device, torch.float32).eval()

    def save(self, draft: LlamaForCausalLM, path: Path) -> None:
        save_model(draft, path, self.hf_config)

    def loss(self, draft: LlamaForCausalLM, batch: Batch, roots: Roots) -> StepResult:
        return distill_loss(draft, self.target, batch, self.vocab_ids, self.options.ttt_steps)


def draft_vocab(token_map: str | None, vocab_size: int, target: LlamaForCausalLM) -> torch.Tensor:
    """The ids a drafter scores, ascending, on the target's device: its token map's, else
    all `vocab_size`."""
    ids = load_token_map(token_map, vocab_size) if token_map else torch.arange(vocab_size)
    return ids.to(target.embed_tokens.weight.device)


def online_trainer(
    algorithm: str,
    target: LlamaForCausalLM,
    options: OnlineOptions,
    path: Path,
    target_config: dict,
    token_map: str | None,
) -> OnlineTrainer:
    """The trainer of `algorithm`'s drafters (one of `ONLINE_ALGORITHMS`), starting from the
    checkpoint at `path`; `token_map`: the pool's (`--speculative-token-map`)."""
    if algorithm == "DFLASH":
        return DFlashTrainer(target, options, path, token_map)
    if algorithm == "STANDALONE":
        return StandaloneTrainer(target, options, path, token_map)
    return EagleTrainer(target, options, path, algorithm, target_config)
