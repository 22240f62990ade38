"""The gateway's view of the services: who is alive, where a request goes, its output.

Every service heartbeats; an instance silent for `instance_timeout` seconds (or
saying goodbye) is dropped. Requests it was decoding move to another decode
worker, which prefills their prompt and the tokens they have so far and decodes
on (greedy output is unchanged); with no worker coming up they fail with an
error instead of hanging. A request goes to the decode worker the router picks
(router.py: by load, or by load and prefix-cache overlap) and the least loaded
drafter running that worker's algorithm, and stays with them. Its text comes back
on this gateway's subject.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any

from specmesh.services.gateway.cache_index import CacheIndex
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.router import DEFAULT_BLOCK_SIZE, Candidate, best, computes_locally
from specmesh.shared.bus import Bus, BusError, NoResponders
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.protocol import (
    ABORT,
    HEARTBEAT,
    PREFILL,
    TOKENIZE,
    Abort,
    AdmitRequest,
    Admitted,
    Heartbeat,
    ImageData,
    PrefillReply,
    PrefillRequest,
    ResumeReply,
    ResumeRequest,
    TextDelta,
    TextDeltas,
    TokenizeReply,
    TokenizeRequest,
    decode_subject,
    detok_subject,
    gateway_subject,
    resume_subject,
)
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.telemetry import (
    E2E,
    GENERATION_TOKENS,
    INSTANCES,
    ITL,
    MIGRATED,
    PROMPT_TOKENS,
    REQUESTS,
    ROUTED,
    TTFT,
)

log = logging.getLogger(__name__)


class Unavailable(RuntimeError):
    """No instance can take the request (HTTP 503)."""


class Overloaded(RuntimeError):
    """Too much in flight at this gateway (HTTP 429)."""


@dataclass
class Instance:
    heartbeat: Heartbeat
    last_seen: float
    routed: int = 0  # requests this gateway sent it since its last heartbeat
    blocks_routed: int = 0  # their prompts' KV blocks
    blocks_released: int = 0  # KV blocks of this gateway's requests that ended there since

    def blocks_used(self) -> int:
        """KV blocks its requests hold, estimated from its heartbeat and what happened since."""
        hb = self.heartbeat
        used = hb.kv_blocks_total - hb.kv_blocks_free + self.blocks_routed - self.blocks_released
        return max(0, used)

    @property
    def load(self) -> tuple[int, int]:
        hb = self.heartbeat
        return hb.active_requests + hb.waiting_requests + self.routed, -hb.kv_blocks_free


@dataclass
class Resumable:
    """What a request needs to move to another decode worker."""

    prompt_ids: list[int]
    params: SamplingParams  # max_tokens resolved
    tokenizer_id: str
    attempt: int = 0  # times it moved
    images: list[ImageData] | None = None  # the prompt's


@dataclass
class Placement:
    request_id: str
    prompt_ids: list[int]
    prompt_text: str
    decode_id: str
    drafter_id: str | None
    num_computed_tokens: int  # prompt tokens computed (the rest were cached); decode's word


class ServerStats:
    """Totals over finished sequences, for /get_server_info."""

    def __init__(self) -> None:
        self.requests = self.generated_tokens = 0
        self.spec = SpecStats()

    def add(self, tokens: int, spec: SpecStats | None) -> None:
        self.requests += 1
        self.generated_tokens += tokens
        if spec is not None:
            self.spec += spec


class Generation:
    """The sequences of one API request (n choices of each prompt), their output in
    one queue. Records latency metrics; `close` aborts whatever has not finished."""

    def __init__(self, cluster: Cluster, request_ids: list[str]) -> None:
        self.cluster = cluster
        self.request_ids = request_ids
        self.placements: dict[str, Placement] = {}
        self.queue: asyncio.Queue[TextDelta] = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.arrival = time.perf_counter()
        self.last_token_at: dict[str, float] = {}
        self.tokens = dict.fromkeys(request_ids, 0)

    async def deltas(self) -> AsyncIterator[TextDelta]:
        """Every sequence's output, interleaved, until all have finished."""
        while self.unfinished:
            try:
                delta = await asyncio.wait_for(self.queue.get(), self.cluster.idle_timeout)
            except TimeoutError:  # a lost message or service: fail rather than hang
                error = f"no output for {self.cluster.idle_timeout:g} s; the request was dropped"
                first = min(self.unfinished)
                delta = TextDelta(
                    request_id=first, text="", num_tokens=0, finish_reason="error", error=error
                )
            if delta.request_id not in self.unfinished:
                continue  # e.g. a worker's failure after the sequence finished
            self._record(delta)
            if delta.finish_reason is not None:
                self.unfinished.discard(delta.request_id)
            if delta.finish_reason == "error":  # whatever failed, the others let it go too
                self.cluster.abort(delta.request_id)
            yield delta

    def close(self) -> None:
        for request_id in self.request_ids:
            self.cluster.forget(request_id)
        for request_id in self.unfinished:  # the client left, or a sibling failed
            self.cluster.abort(request_id)
        self.unfinished.clear()

    def _computed(self, delta: TextDelta) -> None:
        """What the decode worker says was computed of the prompt (it knows when it
        computed the prompt itself)."""
        placement = self.placements.get(delta.request_id)
        if placement is not None and delta.num_prompt_tokens == len(placement.prompt_ids):
            placement.num_computed_tokens = delta.num_prompt_tokens - delta.num_cached_tokens

    def _record(self, delta: TextDelta) -> None:
        now, rid, model = time.perf_counter(), delta.request_id, self.cluster.model_name
        if delta.num_tokens:
            last = self.last_token_at.get(rid)
            if last is None:
                TTFT.labels(model).observe(now - self.arrival)
                self._computed(delta)
            else:
                for _ in range(delta.num_tokens):  # the tokens of one step arrive together
                    ITL.labels(model).observe((now - last) / delta.num_tokens)
            self.last_token_at[rid] = now
            self.tokens[rid] += delta.num_tokens
        if delta.finish_reason is not None:
            REQUESTS.labels("error" if delta.finish_reason == "error" else "ok").inc()
            E2E.labels(model).observe(now - self.arrival)
            placement = self.placements.get(rid)  # a moved request's prompt grew
            prompt = len(placement.prompt_ids) if placement else delta.num_prompt_tokens
            self.cluster.ended(rid, delta.num_prompt_tokens + self.tokens[rid])
            PROMPT_TOKENS.labels(model).inc(prompt)
            GENERATION_TOKENS.labels(model).inc(self.tokens[rid])
            self.cluster.stats.add(self.tokens[rid], delta.spec)


class Cluster:
    def __init__(
        self,
        bus: Bus,
        gateway_id: str,
        instance_timeout: float,
        request_timeout: float,
        max_pending: int,
        idle_timeout: float,
        model_name: str,
        router: GatewayConfig,
    ) -> None:
        """`router`: the --router-* options."""
        self.bus = bus
        self.gateway_id = gateway_id
        self.model_name = model_name  # the `model_name` label of the request metrics
        self.instance_timeout = instance_timeout
        self.request_timeout = request_timeout
        self.idle_timeout = idle_timeout
        self.max_pending = max_pending
        self.router = router
        self.cache_index = CacheIndex(bus)
        self.instances: dict[str, dict[str, Instance]] = {}
        self.outputs: dict[str, asyncio.Queue[TextDelta]] = {}  # by request id
        # the tokenizer and decode worker each request's output flows through
        self.workers_of: dict[str, tuple[str, str]] = {}
        self.resumable: dict[str, Resumable] = {}
        self.stats = ServerStats()
        self._watchdog: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._prefill_lost = asyncio.Event()  # set, then replaced, when a prefill instance goes

    async def start(self) -> None:
        await self.bus.serve(gateway_subject(self.gateway_id), self._on_deltas)
        await self.bus.serve(HEARTBEAT.format(kind="*"), self._on_heartbeat)
        if self.router.router_policy == "kv-aware":
            await self.cache_index.start()
        self._watchdog = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()

    def live(self, kind: str) -> list[Instance]:
        return list(self.instances.get(kind, {}).values())

    def max_model_len(self) -> int | None:
        """The context limit the live decode workers advertise (None before any is up)."""
        limits = [i.heartbeat.max_model_len for i in self.live("decode")]
        return min((n for n in limits if n), default=None)

    async def _on_heartbeat(self, hb: Heartbeat) -> None:
        instances = self.instances.setdefault(hb.kind, {})
        known = instances.get(hb.instance_id)
        if known is not None and known.heartbeat.incarnation != hb.incarnation:
            log.warning("%s %s restarted", hb.kind, hb.instance_id)
            self._drop(hb.kind, hb.instance_id)  # its requests died with the old process
        if hb.leaving:
            self._drop(hb.kind, hb.instance_id)
        else:
            instances[hb.instance_id] = Instance(hb, time.monotonic())
        INSTANCES.labels(hb.kind).set(len(instances))

    async def _on_deltas(self, msg: TextDeltas) -> None:
        for delta in msg.deltas:
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
        """Forget an instance. The requests a lost decode worker was decoding move to
        another, prefill calls in flight are sent again (`_prefill`), the requests whose
        text a lost tokenizer carried fail; a lost drafter only costs its requests their
        drafts."""
        self.instances.get(kind, {}).pop(instance_id, None)
        if kind == "decode":
            self.cache_index.forget(instance_id)
        if kind == "prefill":
            self._prefill_lost.set()
            self._prefill_lost = asyncio.Event()
        for request_id, workers in list(self.workers_of.items()):
            if instance_id not in workers:
                continue
            if kind == "decode" and request_id in self.resumable:
                self._in_background(self._migrate(request_id, instance_id))
            else:
                self._fail(request_id, f"the {kind} instance {instance_id} went away")

    def _fail(self, request_id: str, error: str) -> None:
        queue = self.outputs.get(request_id)
        if queue is not None:  # not finished and forgotten meanwhile
            failed = TextDelta(
                request_id=request_id, text="", num_tokens=0, finish_reason="error", error=error
            )
            queue.put_nowait(failed)

    async def _migrate(self, request_id: str, lost: str) -> None:
        """Resume `request_id` on another decode worker from the tokens it has so far. Its
        detokenizer says which those are, and from then on ignores the old worker (which
        may only have seemed lost)."""
        request = self.resumable[request_id]
        request.attempt += 1
        try:
            await self._worker_up("decode", self.idle_timeout / 2)  # e.g. the lost one, back
            resume = ResumeRequest(request_id=request_id, attempt=request.attempt)
            subject = resume_subject(request.tokenizer_id)
            resumed = await self.bus.request(subject, resume, ResumeReply, 10)
            if resumed.finished:
                log.info("request %s finished as %s went away", request_id, lost)
                return
            left = request.params.max_tokens - len(resumed.token_ids)
            if left < 1:
                raise Unavailable("its last tokens were lost")
            output = len(resumed.token_ids)  # its grammar, if any, has followed them
            params = dataclasses.replace(request.params, max_tokens=left, grammar_prefix=output)
            prompt_ids = request.prompt_ids + resumed.token_ids
            await self._place(
                request_id, prompt_ids, params, request.tokenizer_id, lost, request.images
            )
        except Exception as exc:
            MIGRATED.labels("failed").inc()
            error = f"the decode instance {lost} went away and the request could not move: "
            self._fail(request_id, error + str(exc))
            return
        MIGRATED.labels("moved").inc()
        log.info("request %s moved from %s at %d tokens", request_id, lost, len(prompt_ids))

    async def _worker_up(self, kind: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not any(not i.heartbeat.draining for i in self.live(kind)):
            if time.monotonic() > deadline:
                raise Unavailable(f"no {kind} instance came up in {seconds:g} s")
            await asyncio.sleep(0.2)

    async def _prefill(self, request: PrefillRequest) -> PrefillReply:
        """Prefill's reply. Prefill is a queue group, so which instance has the call is
        unknown: when one is lost, every call in flight is sent again (a prefill instance
        that has it already answers both from one computation); with none up, the call
        waits for one (a restart) for up to half the idle timeout."""
        deadline = time.monotonic() + self.idle_timeout / 2
        while True:
            call = asyncio.ensure_future(
                self.bus.request(PREFILL, request, PrefillReply, self.request_timeout)
            )
            lost = asyncio.ensure_future(self._prefill_lost.wait())
            try:
                await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                lost.cancel()
            if call.done() and not isinstance(call.exception(), NoResponders):
                return call.result()
            call.cancel()
            if time.monotonic() > deadline:
                raise Unavailable("no prefill instance answered")
            await asyncio.sleep(0.5)
            await self._worker_up("prefill", max(0.0, deadline - time.monotonic()))

    def _choose(self, kind: str, algorithm: str | None = None) -> Instance | None:
        """The least loaded instance that takes new work."""
        candidates = [
            i
            for i in self.live(kind)
            if not i.heartbeat.draining and algorithm in (None, i.heartbeat.algorithm)
        ]
        chosen = min(candidates, key=lambda i: i.load, default=None)
        if chosen is not None:
            chosen.routed += 1
            ROUTED.labels(kind, chosen.heartbeat.instance_id).inc()
        return chosen

    async def generate(
        self, prompts: list[list[tuple[TokenizeRequest, SamplingParams]]]
    ) -> Generation:
        """Start every choice of every prompt (`prompts[i]`: the choices of prompt i; a
        max_tokens of 0 means "to the end of the context"). A prompt's first choice goes
        ahead so the others reuse its K/V. Raises Overloaded, Unavailable, RemoteError
        (with the status the service chose) or BusError."""
        request_ids = [t.request_id for choices in prompts for t, _ in choices]
        if len(self.outputs) + len(request_ids) > self.max_pending:
            raise Overloaded(f"more than {self.max_pending} sequences in flight; retry later")
        generation = Generation(self, request_ids)
        for request_id in request_ids:
            self.outputs[request_id] = generation.queue

        async def start(choices: list[tuple[TokenizeRequest, SamplingParams]]) -> None:
            first, *rest = choices
            generation.placements[first[0].request_id] = await self._start(*first)
            async with asyncio.TaskGroup() as group:  # a failure cancels the siblings
                tasks = [group.create_task(self._start(*choice)) for choice in rest]
            generation.placements.update((t.result().request_id, t.result()) for t in tasks)

        try:
            async with asyncio.TaskGroup() as group:
                for choices in prompts:
                    group.create_task(start(choices))
        except BaseExceptionGroup as failed:
            generation.close()
            raise _first_error(failed) from None
        except BaseException:
            generation.close()
            raise
        return generation

    async def _start(self, tokenize: TokenizeRequest, params: SamplingParams) -> Placement:
        """Tokenize, prefill and admit one sequence; its output then flows to its queue."""
        request_id = tokenize.request_id
        tokenize.output_subject = gateway_subject(self.gateway_id)
        tokenize.max_tokens = self.max_model_len()
        tokens = await self.bus.request(TOKENIZE, tokenize, TokenizeReply, 10)
        prompt_ids = tokens.prompt_ids
        decode, drafter, computed = await self._place(
            request_id, prompt_ids, params, tokens.tokenizer_id, images=tokens.images
        )
        return Placement(request_id, prompt_ids, tokens.prompt_text, decode, drafter, computed)

    async def _place(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        tokenizer_id: str,
        avoid: str | None = None,
        images: list[ImageData] | None = None,
    ) -> tuple[str, str | None, int]:
        """Admit the prompt to the decode worker the router picks, `avoid` only if it is
        the last (and a drafter for it), prefilled unless the worker computes it itself:
        (decode id, drafter id, prompt tokens computed as far as known). A worker that does
        not answer the admission is dropped, and the request moves as its others do."""
        routed = self._choose_decode(prompt_ids, avoid, images)
        if routed is None:
            raise Unavailable("no decode worker is available")
        decode, candidate = routed
        if params.max_tokens == 0:
            room = decode.heartbeat.max_model_len - len(prompt_ids)
            params = dataclasses.replace(params, max_tokens=max(room, 1))
        algorithm = decode.heartbeat.algorithm
        drafter = self._choose("drafter", algorithm) if algorithm else None
        prefill = None
        computed = len(prompt_ids) - candidate.cached_tokens
        if not computes_locally(candidate, len(prompt_ids), self.router):
            prefill = await self._prefill(
                PrefillRequest(
                    request_id=request_id, prompt_ids=prompt_ids, params=params, images=images
                )
            )
            computed = prefill.num_computed_tokens
        decode_id = decode.heartbeat.instance_id
        drafter_id = drafter.heartbeat.instance_id if drafter else None
        self.workers_of[request_id] = (tokenizer_id, decode_id)
        resumable = self.resumable.setdefault(
            request_id, Resumable(prompt_ids, params, tokenizer_id, images=images)
        )
        admit = AdmitRequest(
            request_id=request_id,
            prompt_ids=prompt_ids,
            params=params,
            prefill=prefill,
            drafter_id=drafter_id,
            detok_subject=detok_subject(tokenizer_id),
            output_subject=gateway_subject(self.gateway_id),
            attempt=resumable.attempt,
            images=images,
        )
        try:
            await self.bus.request(decode_subject(decode_id), admit, Admitted, 10)
        except BusError as lost:  # not an answer: chosen, it died before its heartbeats stopped
            log.warning("decode %s did not admit %s (%s); dropping it", decode_id, request_id, lost)
            self._drop("decode", decode_id)  # its requests move, this one with them
        return decode_id, drafter_id, computed

    def _choose_decode(
        self, prompt_ids: list[int], avoid: str | None, images: list[ImageData] | None
    ) -> tuple[Instance, Candidate] | None:
        """The router's pick among the decode workers taking new work (`avoid` only if it
        is the last). The prefix caches are not searched for prompts with images, whose
        blocks' hashes depend on them."""
        live = [i for i in self.live("decode") if not i.heartbeat.draining]
        live = [i for i in live if i.heartbeat.instance_id != avoid] or live
        if not live:
            return None
        cached = {} if images else self.cache_index.cached_tokens(prompt_ids)
        chosen = best([self._candidate(i, cached) for i in live], len(prompt_ids), self.router)
        instance = self.instances["decode"][chosen.instance_id]
        instance.routed += 1
        instance.blocks_routed += -(-len(prompt_ids) // chosen.block_size)
        ROUTED.labels("decode", chosen.instance_id).inc()
        return instance, chosen

    def _candidate(self, instance: Instance, cached: dict[str, int]) -> Candidate:
        hb = instance.heartbeat
        return Candidate(
            instance_id=hb.instance_id,
            requests=instance.load[0],
            blocks_free=hb.kv_blocks_free,
            blocks_used=instance.blocks_used(),
            block_size=self._block_size(hb.instance_id),
            cached_tokens=cached.get(hb.instance_id, 0),
        )

    def _block_size(self, decode_id: str) -> int:
        cache = self.cache_index.workers.get(decode_id)
        return cache.block_size if cache else DEFAULT_BLOCK_SIZE

    def ended(self, request_id: str, tokens: int) -> None:
        """A sequence of `tokens` (prompt and output) ended: its decode worker's blocks
        are free of it."""
        workers = self.workers_of.get(request_id)
        instance = self.instances.get("decode", {}).get(workers[1]) if workers else None
        if instance is not None:
            instance.blocks_released += -(-tokens // self._block_size(workers[1]))

    def abort(self, request_id: str) -> None:
        """Drop the request in every service. Not awaited: it must also work while the
        caller is being cancelled (a client that went away)."""
        self._in_background(self.bus.publish(ABORT, Abort(request_id=request_id)))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self._background.discard)

    def forget(self, request_id: str) -> None:
        self.outputs.pop(request_id, None)
        self.workers_of.pop(request_id, None)
        self.resumable.pop(request_id, None)


def _first_error(group: BaseExceptionGroup) -> BaseException:
    error = group.exceptions[0]
    return _first_error(error) if isinstance(error, BaseExceptionGroup) else error
