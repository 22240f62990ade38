"""The drafter service: per-request draft state, one batched proposal per message.

Decode workers address an instance directly; its messages (open, close, draft
step) are handled one at a time in arrival order, so a request's state always
sees its tokens in order. A draft model runs on the main thread, off the event
loop, so heartbeats go on while it computes; NGRAM's trie lookups take less
time than the hop there and back, so they run on the event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from specmesh.services.drafter.config import DrafterConfig
from specmesh.services.drafter.online import OnlineDrafting
from specmesh.shared.config import resolve_device, resolve_dtype
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.model.loader import load_model
from specmesh.shared.protocol import (
    ABORT,
    HEAD_REFUSED,
    HEAD_VERSION,
    LEARN_EXAMPLES,
    Abort,
    DraftClose,
    DraftItem,
    DraftOpen,
    DraftReply,
    DraftStep,
    DraftTreeMsg,
    HeadRefused,
    HeadVersion,
    Heartbeat,
    drafter_subject,
)
from specmesh.shared.service import Service, ServiceConfig
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest, SwappableDrafter
from specmesh.shared.speculative.factory import make_drafter
from specmesh.shared.telemetry import ACTIVE_REQUESTS, DRAFT_SECONDS
from specmesh.shared.transport import TransportConfig

T = TypeVar("T")
log = logging.getLogger(__name__)


class DrafterService(Service):
    kind = "drafter"
    computes = True

    def __init__(
        self,
        cfg: ServiceConfig,
        dcfg: DrafterConfig,
        spec: SpeculativeConfig,
        tcfg: TransportConfig,
    ) -> None:
        super().__init__(cfg)
        if not spec.enabled:
            raise ValueError("a drafter needs --speculative-algorithm")
        self.spec = spec.resolved(dcfg.model)
        self.device = resolve_device(dcfg.device)
        self.dtype = resolve_dtype(dcfg.dtype, self.device)
        target = None
        if self.spec.speculative_algorithm != "NGRAM":  # model drafters read the target's
            target = load_model(str(resolve_model(dcfg.model)), self.device, self.dtype)
        self.drafter = make_drafter(self.spec, target)
        self.open_requests: set[str] = set()
        self.on_io_thread = target is None
        self.online: OnlineDrafting | None = None
        if self.spec.speculative_online_learning:
            assert isinstance(self.drafter, SwappableDrafter)  # as resolved() allows
            self.online = OnlineDrafting(
                self.drafter,
                self.spec.speculative_algorithm,
                tcfg.open(cfg.nats_url),
                self.instance_id,
            )

    async def start(self) -> None:
        await self.bus.serve(drafter_subject(self.instance_id), self.handle)
        await self.bus.serve(ABORT, self.abort)
        if self.online is not None:
            await self.bus.serve(HEAD_VERSION, self.follow_head)

    async def follow_head(self, msg: HeadVersion) -> None:
        assert self.online is not None
        await self.online.follow(msg, self._on_draft_thread, self._refuse)

    async def _refuse(self, msg: HeadRefused) -> None:
        await self.bus.publish(HEAD_REFUSED, msg)

    async def stop(self) -> None:
        if self.online is not None:
            self.online.transport.close()

    def heartbeat(self) -> Heartbeat:
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.open_requests))
        return Heartbeat(
            kind=self.kind,
            instance_id=self.instance_id,
            metrics_url=self.metrics_url,
            active_requests=len(self.open_requests),
            algorithm=self.spec.speculative_algorithm,
            head_version=self.online.version if self.online is not None else None,
        )

    async def _on_draft_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Draft state changes on one thread only, one call at a time."""
        return fn(*args) if self.on_io_thread else await self.on_main(fn, *args)

    async def handle(self, msg: DraftOpen | DraftClose | DraftStep) -> DraftReply | None:
        if isinstance(msg, DraftOpen):
            if msg.request_id in self.aborted:  # the abort overtook it
                return None
            await self._on_draft_thread(self.drafter.open, msg.request_id, msg.token_ids)
            self.open_requests.add(msg.request_id)
            if self.online is not None:
                self.online.opened(msg.request_id, msg.token_ids)
        elif isinstance(msg, DraftClose):
            await self._finish(msg.request_id)
        elif isinstance(msg, DraftStep):
            return await self._draft(msg)
        else:
            raise ValueError(f"a drafter does not handle {type(msg).__name__}")
        return None

    async def _draft(self, msg: DraftStep) -> DraftReply:
        """A tree per item; an empty one (no drafts) for a request not open here (it was
        aborted, or this drafter restarted since it was opened)."""
        start = time.perf_counter()
        known = [i for i, item in enumerate(msg.items) if item.request_id in self.open_requests]
        replies = [DraftTreeMsg(tokens=[], parents=[]) for _ in msg.items]
        if known:
            rows = [feature_rows(msg.items[i]) for i in known]
            requests = [self._request(msg.items[i], r) for i, r in zip(known, rows, strict=True)]
            version, trees = await self._on_draft_thread(self._propose, requests)
            for i, tree in zip(known, trees, strict=True):
                replies[i] = DraftTreeMsg(tokens=tree.tokens, parents=tree.parents)
            if self.online is not None:
                for i, r, tree in zip(known, rows, trees, strict=True):
                    self.online.stepped(msg.items[i], r)
                    self.online.drafted(msg.items[i].request_id, version, len(tree))
        DRAFT_SECONDS.observe(time.perf_counter() - start)
        return DraftReply(trees=replies)

    def _propose(self, requests: list[DraftRequest]) -> tuple[int, list[DraftTree]]:
        """Trees, and the head version that drafted them (read where heads are swapped)."""
        version = self.online.version if self.online is not None else 0
        return version, self.drafter.propose(requests)

    async def abort(self, msg: Abort) -> None:
        """A request ended without its decode worker closing it (the worker died)."""
        self.aborted.add(msg.request_id)
        await self._finish(msg.request_id)

    async def _finish(self, request_id: str) -> None:
        """Forget the request; learning online, it goes to the learner."""
        await self._on_draft_thread(self._close, request_id)
        if self.online is not None and (example := self.online.closed(request_id)):
            try:
                await self.bus.publish(LEARN_EXAMPLES, example)
            except Exception as exc:  # an example lost costs the learner one example
                log.warning("request %s did not reach the learner: %s", request_id, exc)

    def _close(self, request_id: str) -> None:
        if request_id in self.open_requests:
            self.open_requests.discard(request_id)
            self.drafter.close(request_id)

    def _request(self, item: DraftItem, rows: np.ndarray | None) -> DraftRequest:
        features = None
        if rows is not None:
            features = torch.from_numpy(rows.copy()).to(self.device, self.dtype)
        return DraftRequest(
            item.request_id, item.new_tokens, item.max_drafts, features, item.feature_position
        )


def feature_rows(item: DraftItem) -> np.ndarray | None:
    """The target features an item carries, [positions, feature dim] (a view of its bytes)."""
    if item.features is None:
        return None
    return np.frombuffer(item.features, dtype=np.float32).reshape(item.feature_shape)
