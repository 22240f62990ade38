"""The prefill service (a queue group): prompt in, first token and stored K/V out.

Prompts are batched by the same engine the decode workers run (chunked
prefill, a local prefix cache). Before computing, prefill looks up how many of
the prompt's leading blocks the transport already holds and loads them instead;
after the first token it stores the blocks the transport lacks. A request's
sequence ends here at its first token; the decode worker takes it from there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import torch
from specmesh.services.prefill.config import PrefillConfig
from specmesh.shared.config import model_name_of
from specmesh.shared.core.sequence import RemotePrefix, Sequence
from specmesh.shared.engine.async_engine import AsyncEngine
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.exchange import (
    KVExchange,
    feature_tag,
    kv_description,
    model_fingerprint,
)
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.multimodal.wire import images_from_wire
from specmesh.shared.protocol import (
    ABORT,
    PREFILL,
    Abort,
    Heartbeat,
    PrefillReply,
    PrefillRequest,
    RemoteError,
)
from specmesh.shared.runner.images import place_images
from specmesh.shared.service import EngineService, ServiceConfig
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.factory import drafter_target_features
from specmesh.shared.telemetry import (
    ACTIVE_REQUESTS,
    CACHE_HIT_RATE,
    PREFILL_TOKENS,
)
from specmesh.shared.transport import KVTransport, TransportConfig

log = logging.getLogger(__name__)


class PrefillEngine(LLMEngine):
    """Stops every request at its first token and hands its prompt's K/V (and, for EAGLE
    drafters, the target features they read) to the transport before the blocks are freed."""

    def __init__(
        self,
        cfg: EngineConfig,
        transport: KVTransport,
        ttl_s: float,
        target_features: tuple[tuple[int, ...], bool] = ((), False),
    ) -> None:
        super().__init__(cfg)
        fingerprint = model_fingerprint(self.model, self.kv_cache)
        self.kv_exchange = KVExchange(self.kv_cache, transport, fingerprint, ttl_s, "prefill")
        self.kv_description = kv_description(model_name_of(cfg.model), self.model, self.kv_cache)
        # request id -> its prompt's block keys, picked up by the service
        self.handoff: dict[str, list[str] | RemoteError] = {}
        self.runner.feature_layers, self.runner.feature_normed = target_features
        self.feature_tag = feature_tag(*target_features)
        # request id -> (first position computed here, feature rows from there)
        self.features: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self.feature_listeners.append(self._keep_features)
        self.finish_listeners.append(self._hand_over)

    def _keep_features(self, seq: Sequence, rows: torch.Tensor, start: int) -> None:
        first, kept = self.features.get(seq.request_id, (start, []))
        if start != first + sum(len(r) for r in kept):  # recomputed after a preemption
            first, kept = start, []
        self.features[seq.request_id] = (first, [*kept, rows])

    def _export(self, seq: Sequence, keys: list[str]) -> None:
        self.kv_exchange.export(seq.block_table, keys)
        start, rows = self.features.pop(seq.request_id, (0, []))
        bs = self.block_manager.block_size
        if rows and start % bs == 0:  # prefix reuse is whole blocks
            self.kv_exchange.export_features(keys, self.feature_tag, torch.cat(rows), start // bs)

    def _hand_over(self, seq: Sequence) -> None:
        """A finishing prompt's K/V (and features) to the transport, its keys to the service.
        With the store unreachable the keys go anyway: decode computes what it cannot load."""
        if seq.num_computed_tokens >= seq.num_prompt_tokens:
            keys = self.kv_exchange.keys(seq.prompt_ids, seq.images)
            try:
                self._export(seq, keys)
                self.handoff[seq.request_id] = keys
            except ConnectionError as exc:
                log.warning(
                    "cannot store %s's K/V (decode will compute it): %s", seq.request_id, exc
                )
                self.handoff[seq.request_id] = keys
            except Exception as exc:  # any other failure fails this request, not the engine
                log.exception("cannot store %s's K/V", seq.request_id)
                self.handoff[seq.request_id] = RemoteError(f"KV transport failed: {exc}", 503)
        self.features.pop(seq.request_id, None)


class PrefillService(EngineService):
    kind = "prefill"

    def __init__(
        self,
        cfg: ServiceConfig,
        ecfg: EngineConfig,
        spec: SpeculativeConfig,
        tcfg: TransportConfig,
        pcfg: PrefillConfig,
    ) -> None:
        """`spec`: the deployment's speculation, whose drafters may read target features."""
        super().__init__(cfg)
        self.max_queued = pcfg.max_queued_requests
        self.running: dict[str, asyncio.Task[PrefillReply]] = {}  # request id -> handler
        ecfg = dataclasses.replace(ecfg, model=str(resolve_model(ecfg.model)))
        features: tuple[tuple[int, ...], bool] = ((), False)
        if spec.enabled:
            features = drafter_target_features(spec.resolved(ecfg.model), ecfg.model)
        self.transport = tcfg.open(cfg.nats_url)
        self.engine = PrefillEngine(ecfg, self.transport, tcfg.kv_ttl, features)
        self.model_name = model_name_of(ecfg.model)
        self._prompt_tokens = (0, 0)  # (computed, cached) all time: the cache hit rate
        self.driver = AsyncEngine(self.engine, own_thread=False)
        self.engine.start_grammar_compiler()

    async def start(self) -> None:
        await self.bus.serve(PREFILL, self.prefill, queue="prefill", concurrent=True)
        await self.bus.serve(ABORT, self.abort)
        await self.serve_flush()

    async def drain(self) -> None:
        await self.bus.stop_serving(PREFILL)  # the queue group's other instances take over
        while self.running:
            await asyncio.wait(list(self.running.values()))

    async def stop(self) -> None:
        self.transport.close()

    async def abort(self, msg: Abort) -> None:
        """The client left or gave up: stop computing its prompt (no reply goes out)."""
        self.aborted.add(msg.request_id)
        task = self.running.get(msg.request_id)
        if task is not None:
            task.cancel()  # leaving the stream aborts the request in the engine

    async def prefill(self, req: PrefillRequest) -> PrefillReply:
        self.aborted.check(req.request_id)
        if (running := self.running.get(req.request_id)) is not None:
            return await asyncio.shield(running)  # a gateway's retry: one computation
        if len(self.running) >= self.max_queued:
            raise RemoteError(
                f"prefill has {len(self.running)} prompts in flight; retry later", 503
            )
        task = asyncio.current_task()
        assert task is not None
        self.running[req.request_id] = task
        try:
            return await self._prefill(req)
        finally:
            self.running.pop(req.request_id, None)

    async def _prefill(self, req: PrefillRequest) -> PrefillReply:
        engine = self.engine
        # With the real max_tokens; off the loop, as a grammar may take a while to compile.
        await asyncio.to_thread(engine.check_request, req.prompt_ids, req.params)
        exchange = engine.kv_exchange
        bs = engine.block_manager.block_size
        images = images_from_wire(req.images)
        # The K/V of blocks from the first image on depends on the images too.
        placed = place_images(engine.model, req.prompt_ids, images) if images else None
        keys = exchange.keys(req.prompt_ids, placed)
        # Full blocks only, and never the last prompt token: its logits are needed.
        reusable = (len(req.prompt_ids) - 1) // bs
        try:
            stored = await asyncio.to_thread(exchange.stored_blocks, keys[:reusable])
        except ConnectionError as exc:  # the store is down: compute the whole prompt
            log.warning("prefix lookup failed for %s: %s", req.request_id, exc)
            stored = 0
        remote = RemotePrefix(keys, stored * bs) if stored else None
        params = dataclasses.replace(req.params, max_tokens=1)
        ACTIVE_REQUESTS.labels(self.kind).inc()
        try:
            async for outputs in self.driver.generate(
                req.request_id, req.prompt_ids, params, remote, images=images
            ):
                first = outputs[0]
        finally:
            ACTIVE_REQUESTS.labels(self.kind).dec()
        keys = engine.handoff.pop(req.request_id)
        if isinstance(keys, RemoteError):
            raise keys
        computed = len(req.prompt_ids) - first.num_reused_tokens
        PREFILL_TOKENS.labels("computed").inc(computed)
        PREFILL_TOKENS.labels("cached").inc(first.num_reused_tokens)
        total_computed, total_cached = self._prompt_tokens
        self._prompt_tokens = (total_computed + computed, total_cached + first.num_reused_tokens)
        return PrefillReply(
            first_token=first.token_id,
            logprob=first.logprob,
            top_logprobs=first.top_logprobs,
            kv_keys=keys,
            num_computed_tokens=computed,
            kv_fingerprint=exchange.fingerprint,
            kv_description=engine.kv_description,
            kv_source=exchange.transport.address,
        )

    def heartbeat(self) -> Heartbeat:
        blocks = self.engine.block_manager
        self.report_engine()
        computed, cached = self._prompt_tokens
        if computed + cached:
            CACHE_HIT_RATE.labels(self.model_name).set(cached / (computed + cached))
        return Heartbeat(
            kind=self.kind,
            instance_id=self.instance_id,
            metrics_url=self.metrics_url,
            active_requests=len(self.engine.sequences),
            waiting_requests=len(self.engine.scheduler.waiting),
            kv_blocks_free=blocks.num_free,
            kv_blocks_total=len(blocks.blocks),
        )
