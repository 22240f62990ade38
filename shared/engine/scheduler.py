"""Continuous batching: which sequences run this step, and how many tokens each.

Decoding sequences go first, a token each; the rest of the step's token budget
goes to prompts, which are prefilled in chunks over several steps. `fcfs` gives it
to the oldest prompt first (a long prompt holds back every prompt behind it until
it is done); `lpm` (SGLang's longest prefix match) is fcfs with waiting prompts
taken in order of their cached prefix, longest first; `fair` shares it evenly
among the prompts in progress, what a short one does not need going to the
others, so a short prompt's first token does not wait for a long one; and a step
that finishes a prompt gives the unfinished ones no more work than the finished
ones take, so that step stays short. When the KV cache runs out, the newest running
sequence is preempted and later recomputed.

The budget counts work, not only tokens: a chunk of n prompt tokens after c computed
ones costs n (1 + c / A) budget tokens, its matmuls plus its attention over the c cached
tokens, where A (`attention_tokens`) is how many tokens of context cost one token's
matmuls. Late chunks of a long prompt are smaller, so no step, and no other request's
token behind it, waits for one long chunk attending over thousands of tokens. Decode
rows count one token each.

With lanes (overlapped speculation) each call schedules one lane's sequences:
a sequence keeps the lane it was given, and preemption stays within the lane,
so a batch scheduled for one lane is untouched while the other lane runs.
"""

from __future__ import annotations

from collections import deque

from specmesh.shared.core.sequence import Sequence, SequenceStatus
from specmesh.shared.kvcache.block_manager import BlockManager

SCHEDULE_POLICIES = ("fair", "fcfs", "lpm")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str,
        attention_tokens: int,
    ) -> None:
        """`attention_tokens`: A above (`ModelConfig.attention_tokens`)."""
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        self.policy = policy
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.attention_tokens = attention_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self, lane: int | None = None) -> list[tuple[Sequence, int]]:
        """The sequences to run next (of `lane` only, if given) and how many tokens each."""
        running, preempted = self._keep_running(lane)
        decoding = [s for s in running if s.num_uncomputed == 1][: self.max_num_batched_tokens]
        prompts = [s for s in running if s.num_uncomputed > 1]
        budget = self.max_num_batched_tokens - len(decoding)
        if not preempted:
            prompts += self._admit(lane, budget, prompts)
        shares = self._shares(prompts, budget)
        batch = [(s, 1) for s in decoding]
        return batch + [(s, n) for s, n in zip(prompts, shares, strict=True) if n]

    def _keep_running(self, lane: int | None) -> tuple[list[Sequence], bool]:
        """The running sequences (of `lane`) with room for their next tokens, oldest first,
        preempting the newest where the cache is full; and whether any was preempted."""
        kept, preempted = [], False
        for seq in [s for s in self.running if lane is None or s.lane == lane]:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.block_manager.can_grow(seq, 0):
                victim = next(s for s in reversed(self.running) if lane is None or s.lane == lane)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.ensure_capacity(seq)
                kept.append(seq)
        return kept, preempted

    def _admit(self, lane: int | None, budget: int, prompts: list[Sequence]) -> list[Sequence]:
        """Waiting sequences (of `lane`) that start now, in the policy's order, while every
        prompt of the step would still get a token of the budget."""
        waiting = [s for s in self.waiting if lane is None or s.lane == lane]
        if self.policy == "lpm":
            waiting.sort(key=lambda s: -self.block_manager.num_cached_blocks(s))
        admitted: list[Sequence] = []
        for seq in waiting:
            step = [*prompts, *admitted, seq]
            if len(self.running) >= self.max_num_seqs or not all(self._shares(step, budget)):
                break
            # Keep a block of headroom per running sequence so admission does not
            # immediately force a preemption on the next decode step.
            if not self.block_manager.can_allocate(seq, reserve=len(self.running)):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _shares(self, prompts: list[Sequence], budget: float) -> list[int]:
        """Tokens for each prompt: the budget's work in order (fcfs, lpm), or evenly, the
        prompts that need less than an even share leaving the rest to the others, and
        those left unfinished sharing no more than the finished ones take (fair); a
        token at least, so that every prompt of the step moves."""
        fair = self.policy == "fair"
        cached = [s.num_computed_tokens for s in prompts]
        costs = [self._cost(s.num_uncomputed, c) for s, c in zip(prompts, cached, strict=True)]
        shares = [0] * len(prompts)
        order = sorted(range(len(prompts)), key=costs.__getitem__) if fair else range(len(prompts))
        finished = 0.0  # work of the prompts this step finishes (fair; the cheapest come first)
        for k, i in enumerate(order):
            even = budget / (len(prompts) - k)
            if fair and finished and costs[i] > even:  # no prompt from here on finishes
                budget = min(budget, finished)
                even = budget / (len(prompts) - k)
            work = min(costs[i], even if fair else budget)
            if work <= 0:
                break
            tokens = self._tokens_within(work, cached[i])
            shares[i] = max(1, min(prompts[i].num_uncomputed, tokens))
            spent = self._cost(shares[i], cached[i])
            budget -= spent
            if shares[i] == prompts[i].num_uncomputed:
                finished += spent
        return shares

    def _cost(self, tokens: int, cached: int) -> float:
        """Budget tokens that prefilling `tokens` after `cached` computed ones costs."""
        return tokens * (1 + cached / self.attention_tokens)

    def _tokens_within(self, work: float, cached: int) -> int:
        """The most tokens whose cost after `cached` computed ones stays within `work` (to
        a millionth of a token, so that rounding never takes a whole token away)."""
        return int(work / (1 + cached / self.attention_tokens) + 1e-6)
