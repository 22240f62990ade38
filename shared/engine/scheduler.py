"""Continuous batching: which sequences run this step, and how many tokens each.

Running sequences go first, oldest first; a prompt longer than the step's
token budget is prefilled in chunks over several steps. When the KV cache
runs out, the newest running sequence is preempted and later recomputed.
"""

from __future__ import annotations

from collections import deque

from shared.engine.sequence import Sequence, SequenceStatus
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

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_num_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.block_manager.can_grow(seq, 0):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.ensure_capacity(seq)
                num = min(seq.num_uncomputed, budget)
                batch.append((seq, num))
                budget -= num
        while self.waiting and budget and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Keep a block of headroom per running sequence so admission does not
            # immediately force a preemption on the next decode step.
            if not self.block_manager.can_allocate(seq, reserve=len(self.running)):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num = min(seq.num_uncomputed, budget)
            batch.append((seq, num))
            budget -= num
        return batch
