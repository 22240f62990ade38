"""Speculative decoding inside the engine: draft before a step, verify after it.

For each decoding sequence the drafter proposes a tree rooted at the sequence's
last token; the model runner forwards root and drafts in the same batch as
everything else, with an ancestor mask; here the accepted path is chosen, its
K/V moved to the cache positions the path now occupies, and the rest left to
be overwritten. Sequences whose sampling needs per-token history (penalties)
or logprobs decode without drafts.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from specmesh.shared.core.sequence import Sequence, SequenceStatus
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.kvcache.block_manager import BlockManager
from specmesh.shared.kvcache.kv_cache import KVCache, TreeStates
from specmesh.shared.runner.logits import processed_logits, shapes_logits
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.sampling.sampler import greedy, has_penalties, to_probs
from specmesh.shared.speculative.accept import accept_greedy, accept_sampling
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import Drafter, DraftRequest

log = logging.getLogger(__name__)


@dataclass
class StepCosts:
    """What speculation costs, to choose draft budgets by: `verify[k]` seconds of a forward
    that verifies k drafts of one sequence (k = 0: a plain decode step), measured when the
    engine starts; `draft` seconds of drafting per draft token, measured as drafts arrive."""

    verify: list[float]
    draft: float = 0.0


def best_budget(alpha: float, costs: StepCosts, most: int) -> int:
    """The draft budget b <= most that maximises expected tokens per second when a draft
    is accepted with probability `alpha` once its parent was: (1 + alpha + ... + alpha^b)
    tokens for verify[b] + b * draft seconds."""
    best, best_rate, tokens = 1, 0.0, 1.0
    for b in range(1, min(most, len(costs.verify) - 1) + 1):
        tokens += alpha**b
        rate = tokens / (costs.verify[b] + b * costs.draft)
        if rate > best_rate:
            best, best_rate = b, rate
    return best


@dataclass
class PendingDrafts:
    """Drafts requested for `seqs`, in order; they arrive in `trees`."""

    seqs: list[Sequence]
    trees: Future[list[DraftTree]] | None


@dataclass
class _RequestState:
    num_synced: int  # tokens the drafter has seen
    budget: int  # draft nodes allowed next step
    stats: SpecStats
    # Recent drafts accepted and chains cut short (decaying counts): their ratio estimates
    # the chance that a draft is accepted once its parent was.
    hits: float = 1.0
    misses: float = 1.0
    # EAGLE only: target features of computed positions not yet sent to the drafter,
    # starting at position `features_start`; `features_end` is the next position due.
    features: list[torch.Tensor] = field(default_factory=list)
    features_start: int = 0
    features_end: int = 0


def speculable(params: SamplingParams) -> bool:
    return params.logprobs is None and not has_penalties(params)


class Speculator:
    def __init__(
        self,
        cfg: SpeculativeConfig,
        drafter: Drafter,
        kv_cache: KVCache,
        block_manager: BlockManager,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.cfg = cfg
        self.drafter = drafter
        self.kv_cache = kv_cache
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids  # held back from verification before min_tokens
        self.max_drafts = cfg.speculative_num_draft_tokens - 1
        self.requests: dict[str, _RequestState] = {}
        self.stats = SpecStats()
        self.costs: StepCosts | None = None  # set by the engine when budgets adapt
        self._submitted_at = 0.0

    def open(self, seq: Sequence) -> None:
        if speculable(seq.params):
            self.drafter.open(seq.request_id, seq.token_ids)
            self.requests[seq.request_id] = _RequestState(len(seq), self.max_drafts, SpecStats())

    def close(self, seq: Sequence) -> SpecStats | None:
        state = self.requests.pop(seq.request_id, None)
        if state is None:
            return None
        self.drafter.close(seq.request_id)
        return state.stats

    def submit(self, batch: list[tuple[Sequence, int]]) -> PendingDrafts:
        """Ask the drafter for trees for the sequences of `batch` that decode next."""
        seqs, requests = [], []
        for seq, _ in batch:
            state = self.requests.get(seq.request_id)
            if state is None or seq.num_uncomputed != 1:
                continue
            # Drafts past max_tokens would be thrown away: the bonus token is free.
            left = seq.params.max_tokens - (len(seq) - seq.num_prompt_tokens) - 1
            budget = min(state.budget, left)
            if not self.block_manager.can_grow(seq, budget):
                budget = 0
            features = torch.cat(state.features) if state.features else None
            state.features.clear()
            new = seq.token_ids[state.num_synced :]
            requests.append(
                DraftRequest(seq.request_id, new, budget, features, state.features_start)
            )
            state.features_start = state.features_end
            state.num_synced = len(seq)
            seqs.append(seq)
        self._submitted_at = time.perf_counter()
        return PendingDrafts(seqs, self.drafter.submit(requests) if requests else None)

    def collect(self, pending: PendingDrafts) -> dict[Sequence, DraftTree]:
        """The submitted trees, for sequences still running with room for them. If the
        drafter failed, its sequences go on without speculation (output is unchanged)."""
        if pending.trees is None:
            return {}
        try:
            proposed = pending.trees.result()
        except Exception as exc:
            log.warning("drafting failed (%s); %d requests go on without", exc, len(pending.seqs))
            for seq in pending.seqs:
                self.close(seq)
            return {}
        if self.costs is not None and proposed:
            drafted = max(len(t) - 1 for t in proposed)
            if drafted:
                per_token = (time.perf_counter() - self._submitted_at) / drafted
                self.costs.draft = 0.8 * self.costs.draft + 0.2 * per_token
        trees = {}
        for seq, tree in zip(pending.seqs, proposed, strict=True):
            if seq.status is not SequenceStatus.RUNNING or seq.request_id not in self.requests:
                continue
            if len(tree) > 1 and self.block_manager.can_grow(seq, len(tree) - 1):
                self.block_manager.ensure_capacity(seq, len(tree) - 1)
                trees[seq] = tree
        return trees

    def add_features(self, seq: Sequence, features: torch.Tensor, start: int) -> None:
        """Target features of positions start.. that `seq` computed this step, for its drafter.
        Positions served from the prefix cache have none: the drafter starts after them.
        Positions recomputed after a preemption were sent already and are dropped."""
        state = self.requests.get(seq.request_id)
        if state is None:
            return
        end = start + len(features)
        if state.features_end == 0 and start > 0:
            state.features_start = start
        else:
            features = features[max(0, state.features_end - start) :]
        state.features.append(features)
        state.features_end = max(state.features_end, end)

    def verify(
        self,
        seq: Sequence,
        tree: DraftTree,
        logits: torch.Tensor,
        features: torch.Tensor | None = None,
        node_states: TreeStates | None = None,
    ) -> list[int]:
        """Accept a path of `tree` given the target's logits (and features, and a hybrid
        model's linear-attention states) at its nodes; commit the path's K/V and states.
        Returns the tokens to emit (accepted drafts, then bonus)."""
        params = seq.params
        if shapes_logits(seq):  # e.g. drafts its grammar forbids are never accepted
            paths = [tree.path_tokens(node)[1:] for node in range(len(tree))]  # root: emitted
            logits = processed_logits(logits, seq, paths, self.eos_token_ids)
        if params.greedy:
            path, emitted = accept_greedy(tree, greedy(logits).tolist())
        else:
            path, emitted = accept_sampling(
                tree,
                to_probs(logits, [params] * len(tree)),
                params.seed,
                len(seq),  # the root's children propose the token at index len(seq)
                self.cfg.speculative_accept_threshold_single,
                self.cfg.speculative_accept_threshold_acc,
            )
        start = seq.num_computed_tokens
        moved = [(start + node, start + i) for i, node in enumerate(path) if node != i]
        if moved:
            src, dst = zip(*moved, strict=True)
            self.kv_cache.copy_tokens(seq.block_table, list(src), list(dst))
        if node_states is not None:
            node_states.commit(self.kv_cache, seq.block_table, start, path)
        seq.num_computed_tokens = start + len(path)
        self.block_manager.seal(seq, start)
        if features is not None:
            self.add_features(seq, features[path], start)
        state = self.requests[seq.request_id]
        accepted = len(path) - 1
        state.stats.add(len(tree) - 1, accepted)
        self.stats.add(len(tree) - 1, accepted)
        if self.costs is not None:
            state.hits = 0.8 * state.hits + accepted
            state.misses = 0.8 * state.misses + (accepted < max(tree.depths()))
            alpha = state.hits / (state.hits + state.misses)
            state.budget = best_budget(alpha, self.costs, self.max_drafts)
        return emitted
