"""Request ids seen lately, forgotten after a while."""

from __future__ import annotations

import time


class RecentIds:
    """Request ids seen in the last `seconds`: news of a request that may still be
    overtaken by, or overtake, other news of it (NATS keeps order per subject, not
    across them)."""

    def __init__(self, seconds: float = 300.0) -> None:
        self.seconds = seconds
        self._ids: dict[str, float] = {}  # insertion order is time order

    def add(self, request_id: str) -> None:
        now = time.monotonic()
        self._ids.pop(request_id, None)
        self._ids[request_id] = now
        while self._ids[oldest := next(iter(self._ids))] < now - self.seconds:
            del self._ids[oldest]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids
