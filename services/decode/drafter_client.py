"""The decode worker's side of the drafter service: the Drafter interface over NATS.

Each request is pinned to the drafter instance the gateway chose. Opening and
closing are messages on that instance's subject, which it handles in order
with the draft steps; one DraftStep per instance per step carries all of that
instance's requests. If an instance fails, its requests go on without drafts.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

import numpy as np
from opentelemetry.context import Context
from specmesh.shared.bus import Bus
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.protocol import (
    DraftClose,
    DraftItem,
    DraftOpen,
    DraftReply,
    DraftStep,
    DraftTreeMsg,
    drafter_subject,
)
from specmesh.shared.speculative.drafter import DraftRequest

log = logging.getLogger(__name__)


class DrafterClient:
    def __init__(
        self, target_features: tuple[tuple[int, ...], bool], vocab_size: int, timeout_s: float
    ) -> None:
        """`target_features`: the target layers the drafters' heads read (Drafter's)."""
        self.bus: Bus
        self.loop: asyncio.AbstractEventLoop
        self.target_features = target_features
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.drafter_of: dict[str, str] = {}  # request id -> drafter instance
        self.context_of: dict[str, Context] = {}  # request id -> its trace context
        self.last_token: dict[str, int] = {}  # the root of the request's next tree

    def connect(self, bus: Bus, loop: asyncio.AbstractEventLoop) -> None:
        """The bus to reach drafters through, and the event loop it runs on."""
        self.bus, self.loop = bus, loop

    def assign(self, request_id: str, drafter_id: str | None, ctx: Context) -> None:
        """Called before the request reaches the engine; None: no drafts for it."""
        if drafter_id is not None:
            self.drafter_of[request_id] = drafter_id
            self.context_of[request_id] = ctx

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.last_token[request_id] = prompt_ids[-1]
        self._send(request_id, DraftOpen(request_id=request_id, token_ids=list(prompt_ids)))

    def close(self, request_id: str) -> None:
        self._stop_drafting(request_id)
        self.last_token.pop(request_id, None)

    def _stop_drafting(self, request_id: str) -> None:
        """Tell the request's drafter it is done with, and ask it for no more drafts."""
        self._send(request_id, DraftClose(request_id=request_id))
        self.drafter_of.pop(request_id, None)
        self.context_of.pop(request_id, None)

    def _send(self, request_id: str, msg: DraftOpen | DraftClose) -> None:
        drafter = self.drafter_of.get(request_id)
        if drafter is not None:
            publish = self.bus.publish(drafter_subject(drafter), msg, self.context_of[request_id])
            asyncio.run_coroutine_threadsafe(publish, self.loop)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return self.submit(requests).result()

    def submit(self, requests: list[DraftRequest]) -> Future[list[DraftTree]]:
        for r in requests:
            if r.new_tokens:
                self.last_token[r.request_id] = r.new_tokens[-1]
        return asyncio.run_coroutine_threadsafe(self._propose(requests), self.loop)

    async def _propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        trees = [DraftTree([self.last_token[r.request_id]], [-1]) for r in requests]
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            drafter = self.drafter_of.get(r.request_id)
            if drafter is not None and r.max_drafts > 0:
                groups.setdefault(drafter, []).append(i)

        async def ask(drafter: str, indexes: list[int]) -> None:
            step = DraftStep(items=[_item(requests[i]) for i in indexes])
            try:
                reply = await self.bus.request(
                    drafter_subject(drafter), step, DraftReply, self.timeout_s
                )
            except Exception as exc:
                log.warning("drafter %s failed (%s); its requests go on without", drafter, exc)
                for i in indexes:  # it may only have been slow: it should forget them too
                    self._stop_drafting(requests[i].request_id)
                return
            for i, tree in zip(indexes, reply.trees, strict=True):
                trees[i] = self._checked(requests[i], tree, trees[i])

        await asyncio.gather(*(ask(d, idx) for d, idx in groups.items()))
        return trees

    def _checked(self, request: DraftRequest, msg: DraftTreeMsg, fallback: DraftTree) -> DraftTree:
        """A drafter's tree, if it is one the target may verify; else no drafts."""
        if not msg.tokens:  # the drafter does not know the request (any more)
            return fallback
        try:
            tree = DraftTree(msg.tokens, msg.parents)
        except ValueError as exc:
            log.warning("request %s: malformed draft tree: %s", request.request_id, exc)
            return fallback
        if (
            len(tree) > request.max_drafts + 1
            or tree.tokens[0] != fallback.tokens[0]
            or not all(0 <= t < self.vocab_size for t in tree.tokens)
        ):
            log.warning("request %s: draft tree out of bounds", request.request_id)
            return fallback
        return tree


def _item(r: DraftRequest) -> DraftItem:
    if r.features is None:
        return DraftItem(request_id=r.request_id, new_tokens=r.new_tokens, max_drafts=r.max_drafts)
    features = r.features.float().cpu().numpy().astype(np.float32)
    return DraftItem(
        request_id=r.request_id,
        new_tokens=r.new_tokens,
        max_drafts=r.max_drafts,
        features=features.tobytes(),
        feature_shape=list(features.shape),
        feature_position=r.feature_position,
    )
