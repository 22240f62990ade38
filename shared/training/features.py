"""The target's view of each training sample: from the layers kept while generating it, or
by teacher forcing.

For every position p of a sample: the features a head reads at p, the target's final
normed hidden state at p (its LM head turns it into the label distribution for the
token after p), and the target's greedy choice for that token. `TargetViews` builds a
self-distilled sample's view only when a batch needs it, reading its captured layers
from disk: 23k answers of EAGLE-3's 4 layers x 576 bf16 per token are ~25 GB.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.training.data import Capture, CaptureReader, Sample, features_path
from tqdm import tqdm

BLOCK = 16
TOKENS_PER_BATCH = 4096  # of a teacher-forced pass


@dataclass
class TargetView:
    features: torch.Tensor  # [N, F] what the head reads (EAGLE-3: three layers side by side)
    final: torch.Tensor | None  # [N, H] final normed hidden state (None: not known)
    argmax: torch.Tensor  # [N] the target's greedy next token


def _batches(samples: list[Sample], tokens: int) -> list[list[int]]:
    """Consecutive sample indices, about `tokens` tokens per batch."""
    batches, current, size = [], [], 0
    for i, s in enumerate(samples):
        if current and size + len(s.ids) > tokens:
            batches.append(current)
            current, size = [], 0
        current.append(i)
        size += len(s.ids)
    return batches + [current] if current else batches


@torch.inference_mode()
def extract(
    target: LlamaForCausalLM,
    samples: list[Sample],
    layers: tuple[int, ...],
    normed: bool,
    tokens_per_batch: int = TOKENS_PER_BATCH,
    store_dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
) -> list[TargetView]:
    """Teacher-forced target pass over every sample. `layers`/`normed` as the drafter's
    `target_features` (EAGLE-3: outputs of three layers; EAGLE: the final normed state).
    `progress`: a progress bar (a service learning online shows none)."""
    views: list[TargetView] = []
    passes = teacher_forced(target, samples, () if normed else layers, tokens_per_batch)
    for lengths, final, aux in tqdm(
        passes, desc="target features", unit="batch", disable=not progress
    ):
        features = final if normed else aux
        argmax = greedy_choices(target, final)
        for f, h, a in zip(*(t.split(lengths) for t in (features, final, argmax)), strict=True):
            views.append(TargetView(f.to(store_dtype).cpu(), h.to(store_dtype).cpu(), a.cpu()))
    return views


@torch.inference_mode()
def teacher_forced(
    target: LlamaForCausalLM, samples: list[Sample], layers: tuple[int, ...], tokens: int
) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per batch of consecutive samples (about `tokens` tokens): their lengths, and at every
    position of each in order the target's final normed hidden state [N, H] and the outputs
    of `layers` side by side [N, len(layers) * H] (empty without layers)."""
    if not samples:
        return
    device = target.embed_tokens.weight.device
    batches = _batches(samples, tokens)
    blocks = max(sum(-(-len(samples[i].ids) // BLOCK) for i in b) for b in batches)
    cache = KVCache(target.config, blocks, BLOCK, device, target.embed_tokens.weight.dtype)
    for batch in batches:
        spans, ids, positions, next_block = [], [], [], 0
        for i in batch:
            n = len(samples[i].ids)
            table = list(range(next_block, next_block + -(-n // BLOCK)))
            next_block += len(table)
            spans.append(SequenceSpan(table, 0, n))
            ids += samples[i].ids
            positions += range(n)
        meta = target.attention_backend.prepare(spans, BLOCK, device)
        final, aux = target(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            cache.layers,
            meta,
            layers,
        )
        features = torch.cat(aux, dim=-1) if aux else final.new_empty(len(final), 0)
        yield [len(samples[i].ids) for i in batch], final, features


def capture_by_teacher_forcing(
    target: LlamaForCausalLM,
    samples: list[Sample],
    captures: list[Capture | None],
    out: Path,
    layers: tuple[int, ...],
    chunk: int = 384,
) -> None:
    """Keep target `layers` (`capture_layers`) for the samples of the answers file `out` that
    have no capture (answered before their layers were kept), computed by teacher forcing,
    in chunk files as `self_distill` keeps them: a stopped pass resumes at its next chunk,
    and training reads them from disk instead of holding every sample's view in memory."""
    missing = [i for i, c in enumerate(captures) if c is None]
    for run in tqdm(consecutive_runs(missing, chunk), desc="target layers", unit="chunk"):
        rows: list[torch.Tensor] = []
        passes = teacher_forced(target, [samples[i] for i in run], layers, TOKENS_PER_BATCH)
        for lengths, _, aux in passes:
            rows += aux.to(torch.bfloat16).split(lengths)
        saved = {"layers": layers, "features": [r.clone() for r in rows]}
        save_whole(saved, features_path(out, run.start))


def consecutive_runs(indices: list[int], longest: int) -> list[range]:
    """Ascending `indices` as ranges of consecutive ones, none longer than `longest`."""
    runs: list[range] = []
    for i in indices:
        if runs and runs[-1].stop == i and len(runs[-1]) < longest:
            runs[-1] = range(runs[-1].start, i + 1)
        else:
            runs.append(range(i, i + 1))
    return runs


def capture_layers(layers: tuple[int, ...], normed: bool, num_layers: int) -> tuple[int, ...]:
    """Target layers to keep while generating answers: the head's, then the last one (its
    normed output gives the labels, and EAGLE's feature)."""
    return (() if normed else layers) + (num_layers - 1,)


def greedy_choices(target: LlamaForCausalLM, final: torch.Tensor) -> torch.Tensor:
    """[N] the target's argmax after each of its final normed hidden states [N, H]."""
    return torch.cat([target.compute_logits(rows).argmax(-1) for rows in final.split(1024)])


@torch.no_grad()
def from_capture(
    target: LlamaForCausalLM, raw: torch.Tensor, normed: bool, argmax: torch.Tensor | None
) -> TargetView:
    """The view of a self-distilled sample from the layers kept while it was generated
    (`raw` [N, layers * H], the last layer's output last). `argmax`: the target's choices
    if known (a greedy answer's tokens are its own), else from the logits."""
    hidden = target.config.hidden_size
    device = target.norm.weight.device
    final = target.norm(raw[:, -hidden:].to(device).float())
    features = final.to(raw.dtype).cpu() if normed else raw[:, :-hidden]
    if argmax is None:
        argmax = greedy_choices(target, final).cpu()
    return TargetView(features, final.to(raw.dtype).cpu(), argmax)


class TargetViews:
    """Every sample's TargetView, by index, built when asked: a self-distilled sample's from
    its capture (read from disk, so memory holds a batch's views, not all), local data's
    computed up front by teacher forcing. The target's choices are kept for every sample
    (8 bytes a token; the draft vocabulary counts them), computed once from the logits for
    answers that were not `greedy` (minutes of a 2-core CPU for 6000 sampled answers) and
    kept in the file `choices`, where given, for the next run on the same samples."""

    def __init__(
        self,
        target: LlamaForCausalLM,
        samples: list[Sample],
        captures: list[Capture | None],
        greedy: list[bool],
        layers: tuple[int, ...],
        normed: bool,
        choices: Path | None = None,
    ) -> None:
        self.target, self.captures, self.normed = target, captures, normed
        self.read = CaptureReader()
        missing = [i for i, c in enumerate(captures) if c is None]
        views = extract(target, [samples[i] for i in missing], layers, normed) if missing else []
        self.computed = dict(zip(missing, views, strict=True))
        self.argmax = self._all_choices(samples, greedy, choices)

    def _all_choices(
        self, samples: list[Sample], greedy: list[bool], kept: Path | None
    ) -> list[torch.Tensor]:
        """Every sample's choices: read from `kept` if it holds these samples', else
        computed (and kept there)."""
        if kept is None:
            return self._computed_choices(samples, greedy)
        digest = samples_digest(samples, greedy)
        choices = read_choices(kept, digest)
        if choices is None:
            choices = self._computed_choices(samples, greedy)
            save_choices(kept, digest, choices)
        return choices

    def _computed_choices(self, samples: list[Sample], greedy: list[bool]) -> list[torch.Tensor]:
        pairs = enumerate(zip(samples, greedy, strict=True))
        return [self._choices(i, sample, g) for i, (sample, g) in pairs]

    def _choices(self, i: int, sample: Sample, greedy: bool) -> torch.Tensor:
        capture = self.captures[i]
        if capture is None:
            return self.computed[i].argmax
        if greedy:  # a greedy answer's tokens are the target's choices
            return torch.tensor([*sample.ids[1:], 0])
        return from_capture(self.target, self.read(capture), self.normed, None).argmax

    def __len__(self) -> int:
        return len(self.captures)

    def __getitem__(self, i: int) -> TargetView:
        capture = self.captures[i]
        if capture is None:
            return self.computed[i]
        return from_capture(self.target, self.read(capture), self.normed, self.argmax[i])


def samples_digest(samples: list[Sample], greedy: list[bool]) -> str:
    """What the target's choices depend on besides the target: every sample's tokens and
    whether it is a greedy answer."""
    digest = hashlib.blake2b(digest_size=16)
    for sample, g in zip(samples, greedy, strict=True):
        digest.update(array("q", [len(sample.ids), g, *sample.ids]).tobytes())
    return digest.hexdigest()


def read_choices(path: Path, digest: str) -> list[torch.Tensor] | None:
    """The per-sample choices that `save_choices` kept at `path` for samples of `digest`;
    None if it kept none for them."""
    if not path.is_file():
        return None
    saved = torch.load(path, weights_only=True)
    if saved["digest"] != digest:
        return None
    return list(saved["choices"].split(saved["lengths"].tolist()))


def save_choices(path: Path, digest: str, choices: list[torch.Tensor]) -> None:
    """Keep per-sample `choices` at `path` for `read_choices` on samples of `digest`."""
    lengths = torch.tensor([len(c) for c in choices])
    save_whole({"digest": digest, "lengths": lengths, "choices": torch.cat(choices)}, path)


def save_whole(saved: dict[str, object], path: Path) -> None:
    """torch.save to `path` through a temporary file: a stopped run leaves no half of one."""
    partial = path.with_suffix(".partial")
    torch.save(saved, partial)
    partial.replace(path)
