"""Continuous batching: which sequences run this step, and how many tokens each.

Decoding sequences go first, a token each; the rest of the step's token budget
goes to prompts, which are prefilled in chunks over several steps. `fcfs` gives it
to the oldest prompt first (a long prompt holds back every prompt behind it until
it is done); `lpm` (SGLang's longest prefix match) is fcfs with waiting prompts
taken in order of their cached prefix, longest first; `fair` shares it evenly
among the prompts in progress, what a short one does not need going to the
others, so a short prompt's first token does not wait for a long one. When the
KV cache runs out, the newest running sequence is preempted and later recomputed.

With lanes (overlapped speculation) each call schedules one lane's sequences:
a sequence keeps the lane it was given, and preemption stays within the lane,
so a batch scheduled for one lane is untouched while the other lane runs.
"""

from __future__ import annotations

from collections import deque

from shared.core.sequence import Sequence, SequenceStatus
from shared.kvcache.block_manager import BlockManager

SCHEDULE_POLICIES = ("fair", "fcfs", "lpm")


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str,
    ) -> None:
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule policy must be one of {', '.join(SCHEDULE_POLICIES)}")
        self.policy = policy
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
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
        shares = self._shares([s.num_uncomputed for s in prompts], budget)
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
            needs = [s.num_uncomputed for s in (*prompts, *admitted, seq)]
            if len(self.running) >= self.max_num_seqs or not all(self._shares(needs, budget)):
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

    def _shares(self, needs: list[int], budget: int) -> list[int]:
        """Tokens for each prompt: in order (fcfs, lpm), or evenly, the prompts that need
        less than an even share leaving the rest to the others (fair)."""
        fair = self.policy == "fair"
        shares = [0] * len(needs)
        order = sorted(range(len(needs)), key=needs.__getitem__) if fair else range(len(needs))
        for k, i in enumerate(order):
            shares[i] = min(needs[i], budget // (len(needs) - k) if fair else budget)
            budget -= shares[i]
        return shares
