"""What each decode worker's prefix cache holds, as the gateway knows it from the
workers' CacheEvents (shared/kvcache/events.py): per worker, the set of block hashes.

Batches are applied in their numbered order. A worker first heard of, restarted (a new
incarnation) or whose batch numbers skip one is asked for a snapshot, and batches
numbered below the snapshot's next one are ignored. A worker the gateway drops is
forgotten.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

from specmesh.shared.bus import Bus, BusError
from specmesh.shared.kvcache.block_manager import prefix_hashes
from specmesh.shared.protocol import (
    CACHE_EVENTS,
    CacheEvents,
    CacheSnapshot,
    CacheSnapshotRequest,
    RemoteError,
    cache_snapshot_subject,
)

log = logging.getLogger(__name__)

SNAPSHOT_TIMEOUT_S = 2.0


@dataclass
class WorkerCache:
    incarnation: str
    block_size: int
    next_seq: int
    hashes: set[int] = field(default_factory=set)


class CacheIndex:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.workers: dict[str, WorkerCache] = {}

    async def start(self) -> None:
        await self.bus.serve(CACHE_EVENTS, self.on_events)

    def forget(self, instance_id: str) -> None:
        self.workers.pop(instance_id, None)

    async def on_events(self, msg: CacheEvents) -> None:
        known = self.workers.get(msg.instance_id)
        if known is None or known.incarnation != msg.incarnation or msg.seq > known.next_seq:
            known = await self._snapshot(msg.instance_id)
            if known is None or known.incarnation != msg.incarnation:
                return
        if msg.seq < known.next_seq:
            return  # the snapshot holds it already
        known.hashes.update(msg.stored)
        known.hashes.difference_update(msg.removed)
        known.next_seq = msg.seq + 1

    async def _snapshot(self, instance_id: str) -> WorkerCache | None:
        subject = cache_snapshot_subject(instance_id)
        try:
            got = await self.bus.request(
                subject, CacheSnapshotRequest(), CacheSnapshot, SNAPSHOT_TIMEOUT_S
            )
        except (BusError, RemoteError) as exc:  # gone, busy, too large: its next batch asks again
            log.warning("no prefix-cache snapshot from %s: %s", instance_id, exc)
            self.forget(instance_id)
            return None
        cache = WorkerCache(got.incarnation, got.block_size, got.next_seq, set(got.hashes))
        self.workers[instance_id] = cache
        return cache

    def cached_tokens(self, prompt_ids: list[int]) -> dict[str, int]:
        """Per worker, the prompt tokens its prefix cache holds: leading whole blocks,
        never the last token (whose logits are computed)."""
        chains: dict[int, list[int]] = {}  # block size -> the prompt's block hashes
        cached = {}
        for instance_id, cache in self.workers.items():
            bs = cache.block_size
            if bs not in chains:
                chains[bs] = prefix_hashes(prompt_ids[: (len(prompt_ids) - 1) // bs * bs], bs)
            held = itertools.takewhile(cache.hashes.__contains__, chains[bs])
            cached[instance_id] = sum(1 for _ in held) * bs
        return cached
