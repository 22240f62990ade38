"""STANDALONE drafting: a smaller LM with the target's tokenizer and its own paged KV.

Per request the draft keeps K/V for every accepted token. A proposal first
catches up on the newly accepted tokens, then runs `num_steps` expansion steps
(EAGLE-2 style): each step scores the top-k continuations of every frontier
node by cumulative log-probability and keeps the `topk` best as the next
frontier. Finally the best `max_drafts` nodes of all those scored form the
tree (scores fall along every path, so the choice keeps each node's parent).
With topk = 1 this is plain chain drafting. All requests share each forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.core.tree import DraftTree, ancestor_mask
from specmesh.shared.kvcache.block_manager import BlockManager
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.quantize import DRAFT_OPTION, served_quantization
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest, LocalDrafter
from torch import nn

DRAFT_PARAMS = SamplingParams(temperature=0.0)


@dataclass
class TreeSearch:
    """One request's draft tree while it grows (EAGLE-2 style). Node 0 is the root."""

    seq: Sequence
    budget: int
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [0.0])
    depths: list[int] = field(default_factory=lambda: [0])
    expanded: list[int] = field(default_factory=list)  # non-root nodes fed to the model
    frontier: list[int] = field(default_factory=lambda: [0])
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # EAGLE: output per node

    def grow(self, top_logprobs: torch.Tensor, top_ids: torch.Tensor) -> None:
        """Score the top-k continuations of each frontier node (one row each, in frontier
        order) by cumulative log-probability; the best `topk` become the next frontier."""
        candidates = []
        for f, lps, ids in zip(self.frontier, top_logprobs.tolist(), top_ids.tolist(), strict=True):
            for lp, token in zip(lps, ids, strict=True):
                self.tokens.append(token)
                self.parents.append(f)
                self.scores.append(self.scores[f] + lp)
                self.depths.append(self.depths[f] + 1)
                candidates.append(len(self.tokens) - 1)
        candidates.sort(key=lambda i: -self.scores[i])
        self.frontier = candidates[: len(top_ids[0])]
        self.expanded += self.frontier

    def expanded_mask(self) -> torch.Tensor:
        """Ancestor mask among the expanded nodes (the root is cached, so outside)."""
        local = {0: -1, **{node: j for j, node in enumerate(self.expanded)}}
        return ancestor_mask([local[self.parents[i]] for i in self.expanded])

    def tree(self) -> DraftTree:
        best = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], i))
        keep = sorted(best[: self.budget])
        index = {0: 0, **{node: i + 1 for i, node in enumerate(keep)}}
        return DraftTree(
            [self.tokens[0]] + [self.tokens[i] for i in keep],
            [-1] + [index[self.parents[i]] for i in keep],
        )


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """Token ids from a .pt tensor (SGLang's format) or a .json list."""
    if path.endswith(".json"):
        ids = torch.tensor(json.loads(Path(path).read_text()), dtype=torch.long)
    else:
        ids = torch.load(path, map_location="cpu", weights_only=True).long().flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"--speculative-token-map {path}: ids must be in [0, {vocab_size})")
    return torch.unique(ids)


def packed_lm_head(rows: torch.Tensor) -> Linear:
    """An LM head over `rows` [n, hidden], packed where the platform allows (a token map's
    rows scored by a plain matmul cost ~4x more per draft step on CPU)."""
    head = Linear(rows.shape[1], rows.shape[0], bias=False, device=rows.device, dtype=rows.dtype)
    head.weight = nn.Parameter(rows.detach().clone(), requires_grad=False)
    head.pack(keep_weight=False)
    return head


def _shape(cfg: ModelConfig) -> dict[str, Any]:
    """What a draft LM must share with the one it replaces (its KV cache's layout too)."""
    return {"num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size, **cfg.hf_shape()}


class DraftModelDrafter(LocalDrafter):
    target_features: tuple[tuple[int, ...], bool] = ((), False)

    def __init__(
        self,
        cfg: SpeculativeConfig,
        target: LlamaForCausalLM,
        kv_cache_gb: float = 0.25,
        block_size: int = 16,
    ) -> None:
        weight = target.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.target = target
        self.quantization = cfg.speculative_draft_model_quantization
        model = self._loaded(Path(cfg.speculative_draft_model_path))
        # FR-Spec: score only a frequent subset of the vocabulary in the draft LM head.
        self.token_map: torch.Tensor | None = None
        if cfg.speculative_token_map:
            vocab = model.config.vocab_size
            self.token_map = load_token_map(cfg.speculative_token_map, vocab).to(device)
        self._restrict(model)
        kv_cache = KVCache.for_memory(model.config, kv_cache_gb, block_size, device, dtype)
        self.runner = ModelRunner(model, kv_cache)
        self.blocks = BlockManager(kv_cache.num_blocks, block_size)
        self.num_steps = cfg.speculative_num_steps
        self.topk = cfg.speculative_eagle_topk
        self.seqs: dict[str, Sequence] = {}

    def _loaded(self, path: Path) -> LlamaForCausalLM:
        """The draft LM at `path`, checked against the target's vocabulary."""
        weight = self.target.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        served_quantization(path, self.quantization, device, dtype, DRAFT_OPTION)  # errors name it
        model = load_model(path, device, dtype, quantization=self.quantization)
        vocab = model.config.vocab_size
        if vocab > self.target.config.vocab_size:
            raise ValueError(
                f"the draft model's vocabulary ({vocab}) is larger than the target's "
                f"({self.target.config.vocab_size}); STANDALONE needs the target's tokenizer"
            )
        return model

    def _restrict(self, model: LlamaForCausalLM) -> None:
        """`model`'s LM head cut to the token map's rows (none: left whole)."""
        if self.token_map is not None:
            model.lm_head = packed_lm_head(model.lm_head.weight[self.token_map])

    def prepared(self, path: Path) -> ModelRunner:
        """The draft LM at `path`, loaded and checked to take this one's place (any thread),
        over this drafter's KV cache; ValueError if it does not fit the target or the cache."""
        model = self._loaded(path)
        ours, theirs = (_shape(m.config) for m in (self.runner.model, model))
        if differ := [k for k in ours if theirs[k] != ours[k]]:
            raise ValueError(
                "its shape differs: "
                + ", ".join(f"{k} {theirs[k]} (this drafter's {ours[k]})" for k in differ)
            )
        self._restrict(model)  # the vocabulary is the same: the same token map fits
        return ModelRunner(model, self.runner.kv_cache)

    def use(self, runner: ModelRunner) -> None:
        """Draft with `runner`'s model (from `prepared`) from the next call on, on the thread
        that drafts. No K/V of the old model is read again: open requests give back their
        blocks, to recompute their tokens at their next draft, and the prefix cache forgets
        every block."""
        self.runner = runner
        for seq in self.seqs.values():
            if seq.block_table:
                self.blocks.free(seq)
        self.blocks.flush()

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.seqs[request_id] = Sequence(request_id, list(prompt_ids), DRAFT_PARAMS)

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id)
        if seq.block_table:
            self.blocks.free(seq)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        drafts: list[TreeSearch | None] = []
        for r in requests:
            seq = self.seqs[r.request_id]
            seq.token_ids.extend(r.new_tokens)
            drafts.append(self._prepare(seq, r.max_drafts))
        active = [d for d in drafts if d is not None]
        steps = max((min(self.num_steps, d.budget) for d in active), default=0)
        for step in range(steps):
            self._expand(active, catch_up=step == 0)
        return [
            d.tree() if d is not None else DraftTree([self.seqs[r.request_id].token_ids[-1]], [-1])
            for d, r in zip(drafts, requests, strict=True)
        ]

    def _prepare(self, seq: Sequence, budget: int) -> TreeSearch | None:
        """Make room for the new tokens and the nodes to expand; None: no draft this step."""
        if budget < 1:
            return None
        extra = self.num_steps * self.topk
        if not seq.block_table:
            if not self.blocks.can_allocate(seq, reserve=extra):
                return None
            self.blocks.allocate(seq)
        if not self.blocks.can_grow(seq, extra):
            return None
        self.blocks.ensure_capacity(seq, extra)
        return TreeSearch(seq, budget, [seq.token_ids[-1]])

    def _expand(self, drafts: list[TreeSearch], catch_up: bool) -> None:
        spans, ids, positions, rows = [], [], [], []
        for d in drafts:
            seq = d.seq
            if catch_up:  # the accepted tokens the draft has not seen, ending at the root
                start, new = seq.num_computed_tokens, seq.token_ids[seq.num_computed_tokens :]
                spans.append(SequenceSpan(seq.block_table, start, len(new)))
                positions += range(start, start + len(new))
            else:  # every expanded node, each seeing its ancestors
                new = [d.tokens[i] for i in d.expanded]
                spans.append(SequenceSpan(seq.block_table, len(seq), len(new), d.expanded_mask()))
                positions += [len(seq) - 1 + d.depths[i] for i in d.expanded]
            offset = len(ids)
            ids += new
            rows += (
                [offset + len(new) - 1]
                if catch_up
                else [offset + d.expanded.index(f) for f in d.frontier]
            )
        logits, _ = self.runner.forward(spans, ids, positions, rows)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_ids = logprobs.topk(self.topk, dim=-1)
        if self.token_map is not None:
            top_ids = self.token_map[top_ids]
        row = 0
        for d in drafts:
            if catch_up:
                before = d.seq.num_computed_tokens
                d.seq.num_computed_tokens = len(d.seq)
                self.blocks.seal(d.seq, before)
            n = len(d.frontier)
            d.grow(top_lp[row : row + n], top_ids[row : row + n])
            row += n
