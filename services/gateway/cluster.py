"""The gateway's view of the services: who is alive, where a request goes, its output.

Decode workers and drafters heartbeat; an instance silent for
`instance_timeout` seconds (or saying goodbye) is dropped, and requests it was
decoding fail with an error instead of hanging. A request goes to the least
loaded decode worker and the least loaded drafter running that worker's
algorithm, and stays with them. Its text comes back on this gateway's subject.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shared.bus import Bus
from shared.protocol import (
    ABORT,
    HEARTBEAT,
    PREFILL,
    TOKENIZE,
    Abort,
    AdmitRequest,
    Admitted,
    Heartbeat,
    PrefillReply,
    PrefillRequest,
    TextDelta,
    TokenizeReply,
    TokenizeRequest,
    decode_subject,
    detok_subject,
    gateway_subject,
)
from shared.sampling.params import SamplingParams
from shared.telemetry import INSTANCES, ROUTED

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """No instance can take the request (HTTP 503)."""


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float
    routed: int = 0  # requests this gateway sent it since its last heartbeat

    @property
    def load(self) -> tuple[int, int]:
        hb = self.heartbeat
        return hb.active_requests + hb.waiting_requests + self.routed, -hb.kv_blocks_free


@dataclass
class Placement:
    request_id: str
    prompt_ids: list[int]
    decode_id: str
    drafter_id: str | None
    num_computed_tokens: int  # prompt tokens prefill computed (the rest were cached)


class Cluster:
    def __init__(
        self, bus: Bus, gateway_id: str, instance_timeout: float, request_timeout: float
    ) -> None:
        self.bus = bus
        self.gateway_id = gateway_id
        self.instance_timeout = instance_timeout
        self.request_timeout = request_timeout
        self.instances: dict[str, dict[str, Instance]] = {}
        self.outputs: dict[str, asyncio.Queue[TextDelta]] = {}
        self.decode_of: dict[str, str] = {}
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.bus.serve(gateway_subject(self.gateway_id), self._on_delta)
        await self.bus.serve(HEARTBEAT.format(kind="*"), self._on_heartbeat)
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def live(self, kind: str) -> list[Instance]:
        return list(self.instances.get(kind, {}).values())

    async def _on_heartbeat(self, hb: Heartbeat) -> None:
        instances = self.instances.setdefault(hb.kind, {})
        if hb.leaving:
            self._drop(hb.kind, hb.instance_id)
        else:
            instances[hb.instance_id] = Instance(hb, time.monotonic())
        INSTANCES.labels(hb.kind).set(len(instances))

    async def _on_delta(self, delta: TextDelta) -> None:
        queue = self.outputs.get(delta.request_id)
        if queue is not None:
            queue.put_nowait(delta)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.instance_timeout / 4)
            cutoff = time.monotonic() - self.instance_timeout
            for kind, instances in self.instances.items():
                for instance_id, instance in list(instances.items()):
                    if instance.last_seen < cutoff:
                        log.warning("%s %s stopped heartbeating; dropping it", kind, instance_id)
                        self._drop(kind, instance_id)
                INSTANCES.labels(kind).set(len(instances))

    def _drop(self, kind: str, instance_id: str) -> None:
        self.instances.get(kind, {}).pop(instance_id, None)
        if kind != "decode":
            return  # a lost drafter only costs its requests their drafts
        for request_id, decode_id in list(self.decode_of.items()):
            if decode_id == instance_id:
                error = f"decode worker {instance_id} went away"
                failed = TextDelta(request_id, "", 0, finish_reason="error", error=error)
                self.outputs[request_id].put_nowait(failed)

    def _choose(self, kind: str, algorithm: str | None = None) -> Instance | None:
        candidates = [
            i for i in self.live(kind) if algorithm is None or i.heartbeat.algorithm == algorithm
        ]
        chosen = min(candidates, key=lambda i: i.load, default=None)
        if chosen is not None:
            chosen.routed += 1
            ROUTED.labels(kind, chosen.heartbeat.instance_id).inc()
        return chosen

    async def submit(
        self, tokenize: TokenizeRequest, params: SamplingParams
    ) -> tuple[Placement, AsyncIterator[TextDelta]]:
        """Tokenize, prefill and admit a request; then its output streams. Raises
        RemoteError (with the status the service chose), Unavailable or BusError."""
        request_id = tokenize.request_id
        queue: asyncio.Queue[TextDelta] = asyncio.Queue()
        self.outputs[request_id] = queue
        try:
            tokens = await self.bus.request(TOKENIZE, tokenize, TokenizeReply, 10)
            decode = self._choose("decode")
            if decode is None:
                raise Unavailable("no decode worker is available")
            algorithm = decode.heartbeat.algorithm
            drafter = self._choose("drafter", algorithm) if algorithm else None
            prefill = await self.bus.request(
                PREFILL,
                PrefillRequest(request_id, tokens.prompt_ids, params),
                PrefillReply,
                self.request_timeout,
            )
            decode_id = decode.heartbeat.instance_id
            drafter_id = drafter.heartbeat.instance_id if drafter else None
            self.decode_of[request_id] = decode_id
            admit = AdmitRequest(
                request_id,
                tokens.prompt_ids,
                params,
                prefill,
                drafter_id,
                detok_subject(tokens.tokenizer_id),
                gateway_subject(self.gateway_id),
            )
            await self.bus.request(decode_subject(decode_id), admit, Admitted, 10)
        except BaseException:
            self._forget(request_id)
            await self.bus.publish(ABORT, Abort(request_id))
            raise
        placement = Placement(
            request_id, tokens.prompt_ids, decode_id, drafter_id, prefill.num_computed_tokens
        )
        return placement, self._stream(request_id, queue)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[TextDelta]
    ) -> AsyncIterator[TextDelta]:
        """The request's text; leaving early (client gone) aborts it everywhere."""
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._forget(request_id)
            if not finished or delta.finish_reason == "error":  # clean up everywhere
                await self.bus.publish(ABORT, Abort(request_id))

    def _forget(self, request_id: str) -> None:
        self.outputs.pop(request_id, None)
        self.decode_of.pop(request_id, None)
