"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences go first, oldest first; a prompt longer than the step's
token budget is prefilled in chunks over several steps. When the KV cache
runs out, the newest running sequence is preempted and later recomputed.

With lanes (overlapped speculation) each call schedules one lane's sequences:
a sequence keeps the lane it was given, and preemption stays within the lane,
so a batch scheduled for one lane is untouched while the other lane runs.
"""

from __future__ import annotations

from collections import deque

from shared.core.sequence import Sequence, SequenceStatus
from shared.kvcache.block_manager import BlockManager


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
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
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        running = [s for s in self.running if lane is None or s.lane == lane]
        for seq in running:
            if budget == 0:
                break
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
                num = min(seq.num_uncomputed, budget)
                batch.append((seq, num))
                budget -= num
        waiting = [s for s in self.waiting if lane is None or s.lane == lane]
        for seq in waiting:
            if preempted or not budget or len(self.running) >= self.max_num_seqs:
                break
            # Keep a block of headroom per running sequence so admission does not
            # immediately force a preemption on the next decode step.
            if not self.block_manager.can_allocate(seq, reserve=len(self.running)):
                break
            self.waiting.remove(seq)
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num = min(seq.num_uncomputed, budget)
            batch.append((seq, num))
            budget -= num
        return batch
