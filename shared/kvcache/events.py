"""What a prefix cache gained and lost, for routers that place requests by cache overlap.

The block manager records a block hash as stored when it becomes reusable and as removed
when no block holds it any more, so the hashes recorded so far always equal the cache's
keys. A service takes the records in numbered batches, each hash in a batch once, as what
became of it last (stored or removed), so a batch's order does not matter. A router that
misses a batch (a gap in the numbers) asks for a snapshot: the keys as of now and the
number of the next batch. That batch may repeat what the snapshot holds, which is
harmless: applying a batch sets each of its hashes to its final state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass
class CacheChanges:
    seq: int  # batches are numbered from 0, one per `take`
    stored: list[int]
    removed: list[int]


class CacheEventLog:
    """Recorded on the engine thread, taken on the service's io thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = 0
        self._held: dict[int, bool] = {}  # hash -> held after its last change this batch

    def store(self, block_hash: int) -> None:
        with self._lock:
            self._held[block_hash] = True

    def remove(self, block_hash: int) -> None:
        with self._lock:
            self._held[block_hash] = False

    def take(self) -> CacheChanges | None:
        """The changes since the last take, as the next batch (None: there were none)."""
        with self._lock:
            if not self._held:
                return None
            held, self._held = self._held, {}
            changes = CacheChanges(self._seq, [], [])
            self._seq += 1
        for block_hash, kept in held.items():
            (changes.stored if kept else changes.removed).append(block_hash)
        return changes

    def snapshot(self, keys: Callable[[], Iterable[int]]) -> tuple[int, list[int]]:
        """(the next batch's number, `keys()`): call on the engine thread, where the
        cache's keys do not change meanwhile."""
        with self._lock:
            return self._seq, list(keys())
