"""The decode service: admitted requests arrive prefilled, tokens leave per step.

A decode worker loads a request's prompt K/V from the transport (blocks its own
prefix cache holds are skipped), emits the first token prefill sampled, then
decodes it with continuous batching. A request admitted without prefill's reply (the
gateway saw this worker's prefix cache hold most of it) is computed here. What the
prefix cache gains and loses goes out as numbered CacheEvents for KV-aware routing.
With speculation, drafts come from the request's drafter instance; with `--overlap`
the worker keeps two micro-batches in flight so one is drafted while the other is
verified.
Each step's tokens go to the request's detokenizer.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
from collections.abc import AsyncGenerator
from pathlib import Path

from opentelemetry import context as otel_context
from specmesh.services.decode.config import DecodeConfig
from specmesh.services.decode.drafter_client import DrafterClient
from specmesh.shared.bus import Outbox
from specmesh.shared.config import model_name_of
from specmesh.shared.core.sequence import RemotePrefix
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.engine.async_engine import AsyncEngine
from specmesh.shared.engine.engine import EngineConfig, FirstToken, LLMEngine, TokenOutput
from specmesh.shared.kvcache.events import CacheEventLog
from specmesh.shared.kvcache.exchange import KVExchange, kv_description, model_fingerprint
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.multimodal.wire import images_from_wire
from specmesh.shared.protocol import (
    ABORT,
    CACHE_EVENTS,
    Abort,
    AdmitRequest,
    Admitted,
    CacheEvents,
    CacheSnapshot,
    CacheSnapshotRequest,
    Heartbeat,
    PrefillReply,
    RemoteError,
    TokenBatch,
    TokenBatches,
    cache_snapshot_subject,
    decode_subject,
    gateway_subject,
)
from specmesh.shared.service import EngineService, ServiceConfig
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.factory import drafter_target_features
from specmesh.shared.telemetry import (
    ACTIVE_REQUESTS,
    DRAFT_WAIT_SECONDS,
    SPEC_ACCEPT_LENGTH,
    SPEC_ACCEPTANCE_LENGTH,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_VERIFY_STEPS,
    VERIFY_SECONDS,
)
from specmesh.shared.transport import TransportConfig

log = logging.getLogger(__name__)

CACHE_EVENTS_INTERVAL_S = 0.05  # a finished turn's blocks reach routers before its next turn


class DecodeService(EngineService):
    kind = "decode"
    holds_requests = True

    def __init__(
        self,
        cfg: ServiceConfig,
        ecfg: EngineConfig,
        spec: SpeculativeConfig,
        tcfg: TransportConfig,
        dcfg: DecodeConfig,
    ) -> None:
        super().__init__(cfg)
        ecfg = dataclasses.replace(ecfg, model=str(resolve_model(ecfg.model)))
        self.spec = spec.resolved(ecfg.model) if spec.enabled else None
        self.transport = tcfg.open(cfg.nats_url)
        self.streams: dict[str, asyncio.Task[None]] = {}
        self.gateway_subject_of: dict[str, str] = {}  # request id -> where its text goes
        self.outbox: Outbox  # once the bus is connected
        self.client: DrafterClient | None = None
        if self.spec is not None:
            mcfg = ModelConfig.from_file(Path(ecfg.model) / "config.json")
            self.client = DrafterClient(
                drafter_target_features(self.spec, ecfg.model), mcfg.vocab_size, dcfg.draft_timeout
            )
        self.engine = LLMEngine(ecfg, self.spec, self.client, dcfg.overlap)
        self.engine.step_listeners.append(VERIFY_SECONDS.observe)
        fingerprint = model_fingerprint(self.engine.model, self.engine.kv_cache)
        self.engine.kv_exchange = KVExchange(
            self.engine.kv_cache, self.transport, fingerprint, tcfg.kv_ttl, self.kind
        )
        self.cache_events = self.engine.block_manager.events = CacheEventLog()
        self.driver = AsyncEngine(self.engine, own_thread=False)
        self.engine.start_grammar_compiler()
        self.stream_interval = dcfg.stream_interval
        self.model_name = model_name_of(ecfg.model)
        self.kv_description = kv_description(
            self.model_name, self.engine.model, self.engine.kv_cache
        )
        self.refused_fingerprints: set[str] = set()  # each logged once, not per request
        self._draft_wait_reported = 0.0
        self._spec_reported = SpecStats()  # the engine's totals at the last heartbeat

    async def start(self) -> None:
        if self.client is not None:
            self.client.connect(self.bus, asyncio.get_running_loop())
        self.outbox = Outbox(self.bus, lambda batches: TokenBatches(batches=batches))
        await self.bus.serve(decode_subject(self.instance_id), self.admit)
        await self.bus.serve(ABORT, self.abort)
        await self.bus.serve(cache_snapshot_subject(self.instance_id), self.cache_snapshot)
        await self.serve_flush()
        self._publishing = asyncio.create_task(self._publish_cache_events())

    async def drain(self) -> None:
        while self.streams:
            await asyncio.wait(list(self.streams.values()))

    async def stop(self) -> None:
        self._publishing.cancel()
        for task in list(self.streams.values()):
            task.cancel()
        self.transport.close()

    async def _publish_cache_events(self) -> None:
        while True:
            await asyncio.sleep(CACHE_EVENTS_INTERVAL_S)
            changes = self.cache_events.take()
            if changes is None:
                continue
            events = CacheEvents(
                instance_id=self.instance_id,
                incarnation=self.incarnation,
                seq=changes.seq,
                block_size=self.engine.block_manager.block_size,
                stored=changes.stored,
                removed=changes.removed,
            )
            try:
                await self.bus.publish(CACHE_EVENTS, events)
            except Exception as exc:  # lost: routers see the gap and ask for a snapshot
                log.warning("cannot publish cache events: %s", exc)

    async def cache_snapshot(self, _: CacheSnapshotRequest) -> CacheSnapshot:
        blocks = self.engine.block_manager
        next_seq, hashes = await self.driver.call(
            lambda: self.cache_events.snapshot(blocks.hash_to_block.keys)
        )
        return CacheSnapshot(
            incarnation=self.incarnation,
            next_seq=next_seq,
            block_size=blocks.block_size,
            hashes=hashes,
        )

    def heartbeat(self) -> Heartbeat:
        engine = self.engine
        blocks = engine.block_manager
        self.report_engine()
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))
        waited = engine.stats.draft_wait_seconds
        DRAFT_WAIT_SECONDS.inc(waited - self._draft_wait_reported)
        self._draft_wait_reported = waited
        if engine.speculator is not None:  # tokens per verify step since the last heartbeat
            totals = engine.speculator.stats
            since = totals.since(self._spec_reported)
            if since.steps:
                SPEC_ACCEPT_LENGTH.labels(self.model_name).set(since.acceptance_length)
            self._spec_reported = copy.copy(totals)
        return Heartbeat(
            kind=self.kind,
            instance_id=self.instance_id,
            metrics_url=self.metrics_url,
            active_requests=len(self.streams),
            waiting_requests=len(engine.scheduler.waiting),
            kv_blocks_free=blocks.num_free,
            kv_blocks_total=len(blocks.blocks),
            algorithm=self.spec.speculative_algorithm if self.spec else None,
            max_model_len=engine.max_model_len,
        )

    async def admit(self, req: AdmitRequest) -> Admitted:
        self.aborted.check(req.request_id)
        if req.request_id in self.streams:
            raise ValueError(f"request {req.request_id} is already decoding here")
        await asyncio.to_thread(self.engine.check_request, req.prompt_ids, req.params)
        pre = req.prefill
        remote, first = None, None  # no prefill reply: the engine computes the prompt
        if pre is not None:
            self._check_kv_format(pre)
            remote = RemotePrefix(pre.kv_keys, len(req.prompt_ids), pre.kv_source)
            first = FirstToken(pre.first_token, pre.logprob, pre.top_logprobs)
        ctx = otel_context.get_current()
        if self.client is not None:
            self.client.assign(req.request_id, req.drafter_id, ctx)
        stream = self.driver.generate(
            req.request_id,
            req.prompt_ids,
            req.params,
            remote,
            first,
            images_from_wire(req.images),
        )
        task = asyncio.create_task(self._forward(req, stream))
        self.streams[req.request_id] = task
        self.gateway_subject_of[req.request_id] = req.output_subject
        task.add_done_callback(lambda _: self._ended(req.request_id))
        return Admitted(decode_id=self.instance_id)

    def _check_kv_format(self, pre: PrefillReply) -> None:
        """Refuse K/V made for another model, dtype, KV dtype or block size: its keys would miss
        every block, and the prompt be recomputed here in silence (prefill's work lost)."""
        fingerprint = self.engine.kv_exchange.fingerprint
        if pre.kv_fingerprint == fingerprint:
            return
        message = (
            f"prefill's K/V is for {pre.kv_description} [{pre.kv_fingerprint}], this decode "
            f"worker's for {self.kv_description} [{fingerprint}]: run prefill and decode "
            "with the same model, --dtype, --kv-cache-dtype and --block-size"
        )
        if pre.kv_fingerprint not in self.refused_fingerprints:
            self.refused_fingerprints.add(pre.kv_fingerprint)
            log.error("refusing requests prefilled elsewhere: %s", message)
        raise RemoteError(message, 500)

    def _ended(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        self.gateway_subject_of.pop(request_id, None)

    async def gateway_gone(self, gateway_id: str) -> None:
        subject = gateway_subject(gateway_id)
        for request_id, its_subject in list(self.gateway_subject_of.items()):
            if its_subject == subject:
                self.streams[request_id].cancel()

    async def abort(self, msg: Abort) -> None:
        self.aborted.add(msg.request_id)
        task = self.streams.get(msg.request_id)
        if task is not None:
            task.cancel()  # leaving the stream aborts the request in the engine

    async def _forward(
        self, req: AdmitRequest, stream: AsyncGenerator[list[TokenOutput], None]
    ) -> None:
        """The request's tokens to its detokenizer, with the other requests' of each step,
        once `stream_interval` of them have gathered (or the request ended)."""
        pre = req.prefill
        cached = None if pre is None else len(req.prompt_ids) - pre.num_computed_tokens
        want_logprobs = req.params.logprobs is not None
        gathered: list[TokenOutput] = []
        try:
            async for outputs in stream:
                if cached is None:  # computed here: its first output says what was reused
                    cached = outputs[0].num_reused_tokens
                gathered += outputs
                if len(gathered) < self.stream_interval and outputs[-1].finish_reason is None:
                    continue
                batch = _batch(req, gathered, cached, want_logprobs)
                gathered = []
                self.outbox.put(req.detok_subject, batch)
                if batch.spec is not None:
                    self._count_speculation(batch.spec)
        except asyncio.CancelledError:
            await stream.aclose()
        except Exception as exc:  # the engine failed this request: say so downstream
            failed = TokenBatch(
                request_id=req.request_id,
                output_subject=req.output_subject,
                token_ids=[],
                finish_reason="error",
                error=str(exc),
                attempt=req.attempt,
            )
            self.outbox.put(req.detok_subject, failed)

    def _count_speculation(self, spec: SpecStats) -> None:
        algorithm = self.spec.speculative_algorithm if self.spec else "none"
        SPEC_VERIFY_STEPS.labels(algorithm).inc(spec.steps)
        SPEC_DRAFT_TOKENS.labels(algorithm).inc(spec.draft_tokens)
        SPEC_ACCEPTED_TOKENS.labels(algorithm).inc(spec.accepted_tokens)
        if spec.steps:
            SPEC_ACCEPTANCE_LENGTH.labels(algorithm).observe(spec.acceptance_length)


def _batch(
    req: AdmitRequest, outputs: list[TokenOutput], cached: int, want_logprobs: bool
) -> TokenBatch:
    last = outputs[-1]
    return TokenBatch(
        request_id=req.request_id,
        output_subject=req.output_subject,
        token_ids=[o.token_id for o in outputs],
        logprobs=[o.logprob or 0.0 for o in outputs] if want_logprobs else None,
        top_logprobs=[o.top_logprobs or [] for o in outputs] if want_logprobs else None,
        finish_reason=last.finish_reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_cached_tokens=cached,
        spec=last.spec,
        attempt=req.attempt,
    )
