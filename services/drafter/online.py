"""A drafter's part in online learning: it drafts with the version (an EAGLE head, a
DFLASH block draft or a STANDALONE LM) the learner announces, counts live acceptance per
version, and hands each finished request over as a training example.

Live acceptance: a request's tree with drafts, made with version v, is verified before
its next draft step, whose new tokens are what that verification emitted (accepted
drafts + the bonus token); that count goes to v's tally.

Examples carry the target features the drafter was sent (float16), the newest rows
within EXAMPLE_FEATURE_BYTES so that one fits a NATS message whatever the model; a
drafter that reads none (STANDALONE) sends tokens alone.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from specmesh.shared.protocol import (
    DraftItem,
    HeadRefused,
    HeadVersion,
    ServedExample,
    VersionAcceptance,
)
from specmesh.shared.speculative.drafter import SwappableDrafter
from specmesh.shared.speculative.head_blob import write_head
from specmesh.shared.telemetry import HEAD_REFUSALS, HEAD_SWAPS, ONLINE_HEAD_VERSION
from specmesh.shared.transport.base import KVTransport

log = logging.getLogger(__name__)

EXAMPLE_FEATURE_BYTES = 4 << 20


@dataclass
class Served:
    """What a drafter keeps of a request it serves, learning online."""

    tokens: list[int]  # its prompt, then the tokens verification emitted
    prompt_len: int
    features: list[np.ndarray] = field(default_factory=list)  # rows received, float16
    feature_position: int = 0  # the position of the first row
    drafted_with: int | None = None  # the head version of its last tree with drafts


class OnlineDrafting:
    def __init__(
        self, drafter: SwappableDrafter, algorithm: str, transport: KVTransport, instance_id: str
    ) -> None:
        self.drafter, self.algorithm = drafter, algorithm
        self.transport, self.instance_id = transport, instance_id
        self.version = 0  # the pool starts from the configured head
        self.refused: set[str] = set()  # sha256 of versions this drafter cannot take
        self.served: dict[str, Served] = {}
        self.tally: dict[int, list[int]] = {}  # version -> [verification steps, tokens]

    def opened(self, request_id: str, prompt_ids: list[int]) -> None:
        self.served[request_id] = Served(list(prompt_ids), len(prompt_ids))

    def stepped(self, item: DraftItem, rows: np.ndarray | None) -> None:
        """A draft step's news of a request: the tokens verification emitted since its
        last step, and `rows`, the target features of the positions since."""
        served = self.served[item.request_id]
        served.tokens += item.new_tokens
        if rows is not None:
            if not served.features:
                served.feature_position = item.feature_position
            served.features.append(rows.astype(np.float16))
        if served.drafted_with is not None:
            tally = self.tally.setdefault(served.drafted_with, [0, 0])
            tally[0] += 1
            tally[1] += len(item.new_tokens)
            served.drafted_with = None

    def drafted(self, request_id: str, version: int, tree_size: int) -> None:
        if tree_size > 1:  # a tree of the root alone verifies nothing
            self.served[request_id].drafted_with = version

    def closed(self, request_id: str) -> ServedExample | None:
        """The request as a training example, with the tallies counted since the last."""
        served = self.served.pop(request_id, None)
        if served is None or len(served.tokens) == served.prompt_len:
            return None  # nothing served here (an unknown request, or no step)
        if self.drafter.target_features[0] and not served.features:
            return None  # the drafter reads features, and none came for this request
        rows, position = newest_rows(served)
        acceptance = [
            VersionAcceptance(version=v, steps=steps, tokens=emitted)
            for v, (steps, emitted) in self.tally.items()
        ]
        self.tally.clear()
        return ServedExample(
            token_ids=served.tokens,
            prompt_len=served.prompt_len,
            features=rows.tobytes(),
            feature_position=position,
            feature_dim=rows.shape[1],
            acceptance=acceptance,
        )

    async def follow(
        self,
        head: HeadVersion,
        on_draft_thread: Callable[..., Awaitable[None]],
        refuse: Callable[[HeadRefused], Awaitable[None]],
    ) -> None:
        """Take an announced version: fetched, checked, loaded beside the current head,
        then swapped in on the drafting thread between two steps."""
        if (
            head.algorithm != self.algorithm
            or head.version == self.version
            or head.sha256 in self.refused
        ):
            return
        try:
            reader = self.transport.source(head.source)
            [blob] = await asyncio.to_thread(reader.get_many, [head.key])
        except Exception as exc:  # the store is unreachable: the next announcement retries
            log.warning("cannot fetch head version %d: %s", head.version, exc)
            return
        if blob is None:  # the store lost it; the learner stores it again before announcing
            log.warning("head version %d is not in the KV store yet", head.version)
            return
        try:
            new = await asyncio.to_thread(self._prepared, head, blob)
        except Exception as exc:
            self.refused.add(head.sha256)
            HEAD_REFUSALS.inc()
            log.error(
                "refusing head version %d: %s; drafting on with version %d",
                head.version,
                exc,
                self.version,
            )
            reason = str(exc)[:500]
            await refuse(
                HeadRefused(instance_id=self.instance_id, version=head.version, reason=reason)
            )
            return
        await on_draft_thread(self._use, new, head.version)
        log.info("drafting with head version %d", head.version)

    def _prepared(self, head: HeadVersion, blob: bytes) -> Any:
        with tempfile.TemporaryDirectory(prefix="specmesh-head-") as tmp:
            write_head(blob, head.sha256, head.config, Path(tmp))
            return self.drafter.prepared(Path(tmp))

    def _use(self, prepared: Any, version: int) -> None:
        self.drafter.use(prepared)
        self.version = version
        HEAD_SWAPS.inc()
        ONLINE_HEAD_VERSION.labels("drafter").set(version)


def newest_rows(served: Served) -> tuple[np.ndarray, int]:
    """The features to send of a request, [rows, dim] (dim 0: none came), and the position
    of the first: the newest within EXAMPLE_FEATURE_BYTES."""
    if not served.features:
        return np.zeros((0, 0), np.float16), 0
    rows = np.concatenate(served.features)
    keep = max(1, EXAMPLE_FEATURE_BYTES // rows[0].nbytes)
    return rows[-keep:], served.feature_position + max(0, len(rows) - keep)
