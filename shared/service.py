"""What every service process shares: options, start-up, heartbeats, clean shutdown.

A service connects to NATS, subscribes its handlers, then announces itself
with a heartbeat every `--heartbeat-interval` seconds (carrying its load and
its metrics URL) until SIGTERM/SIGINT, when it says goodbye, drains its
subscriptions and flushes its spans.

Model work runs on the main thread (see shared/engine/async_engine.py for why),
the asyncio side (NATS, HTTP) on an "io" thread. Handlers hand blocking work to
the main thread with `await self.on_main(fn, *args)`.

With `--metrics-port`, a small HTTP server (its own thread) serves `/metrics` and
`/health` for orchestrators: 200 once the service is connected to NATS and serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import queue
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import nats
from prometheus_client.exposition import MetricsHandler
from specmesh.shared.bus import Bus, NatsAuth
from specmesh.shared.config import HelpFormatter, add_dataclass_args, dataclass_from_args, option
from specmesh.shared.core.recent import RecentIds
from specmesh.shared.cores import CoresConfig, place_process
from specmesh.shared.logs import LogConfig, configure_logging
from specmesh.shared.protocol import (
    GATEWAY_HEARTBEAT,
    HEARTBEAT,
    CacheFlushed,
    FlushCache,
    Heartbeat,
    flush_subject,
)
from specmesh.shared.telemetry import (
    GEN_THROUGHPUT,
    KV_BLOCKS_FREE,
    KV_BLOCKS_USED,
    NUM_QUEUE_REQS,
    NUM_RUNNING_REQS,
    NUM_USED_TOKENS,
    QUEUE_LENGTH,
    TOKEN_USAGE,
    setup_tracing,
    shutdown_tracing,
)

if TYPE_CHECKING:  # the gateway and tokenizer never load torch
    from specmesh.shared.engine.async_engine import AsyncEngine
    from specmesh.shared.engine.engine import LLMEngine
    from specmesh.shared.transport import KVTransport

log = logging.getLogger(__name__)

T = TypeVar("T")
SHUTDOWN_TIMEOUT_S = 30.0  # goodbye, handlers finishing, NATS drain
GATEWAY_TIMEOUT_S = 10.0  # a gateway silent this long has lost its clients' requests


_WILDCARDS = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class ServiceConfig(NatsAuth):
    nats_url: str = option(
        "nats://127.0.0.1:4222",
        "NATS server URL (tls://... for TLS), or a cluster's servers comma-separated (the "
        "client fails over between them)",
    )
    instance_id: str | None = option(None, "unique instance name (default: <kind>-<host>-<pid>)")
    metrics_port: int | None = option(
        None, "serve Prometheus /metrics and /health here (0: a free port)"
    )
    metrics_host: str = option("127.0.0.1", "address /metrics binds to (0.0.0.0: all)")
    heartbeat_interval: float = option(1.0, "seconds between heartbeats")
    drain_timeout: float = option(
        20.0,
        "on SIGTERM, seconds to finish the requests in flight (no new ones are routed here) "
        "before stopping; keep it below the orchestrator's grace period",
    )


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str, port: int, service: Service) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.service = service
        super().__init__((host, port), _MetricsHandler)


class _MetricsHandler(MetricsHandler):
    server: _MetricsServer

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/health":
            super().do_GET()
            return
        healthy = self.server.service.healthy()
        body = b"ok\n" if healthy else b"not serving: NATS not connected\n"
        self.send_response(200 if healthy else 503)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class RecentAborts(RecentIds):
    """Request ids aborted lately. An abort can overtake the message that would start
    the request here; a service checks this before it starts anything."""

    def check(self, request_id: str) -> None:
        if request_id in self:
            raise ValueError(f"request {request_id} was aborted")


class Service:
    """Base of the service processes. Subclasses subscribe in `start` and report load."""

    kind = "service"
    holds_requests = False  # then it drops the requests of a gateway that went away
    computes = False  # runs torch and the CPU kernels (their threads follow --threads)

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.instance_id = cfg.instance_id or f"{self.kind}-{socket.gethostname()}-{os.getpid()}"
        self.incarnation = uuid.uuid4().hex[:12]
        self.aborted = RecentAborts()
        self.gateways: dict[str, tuple[str, float]] = {}  # id -> (incarnation, last seen)
        self.metrics_url: str | None = None
        self._serving = False  # subscribed and heartbeating
        self.bus: Bus
        self._main_queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple, Future] | None]
        self._main_queue = queue.SimpleQueue()
        self._io_loop: asyncio.AbstractEventLoop | None = None  # set once it runs

    async def start(self) -> None:
        """Subscribe handlers (self.bus is connected)."""

    async def gateway_gone(self, gateway_id: str) -> None:
        """Drop the requests `gateway_id` started: nobody reads their output any more."""

    async def _on_gateway(self, beat: Heartbeat) -> None:
        known = self.gateways.pop(beat.instance_id, None)
        if beat.leaving or (known is not None and known[0] != beat.incarnation):
            await self.gateway_gone(beat.instance_id)  # stopped, or restarted empty-handed
        if not beat.leaving:
            self.gateways[beat.instance_id] = (beat.incarnation, time.monotonic())

    async def _forget_silent_gateways(self) -> None:
        cutoff = time.monotonic() - GATEWAY_TIMEOUT_S
        for gateway_id, (_, seen) in list(self.gateways.items()):
            if seen < cutoff:
                del self.gateways[gateway_id]
                await self.gateway_gone(gateway_id)

    async def drain(self) -> None:
        """Finish the work in flight (SIGTERM; heartbeats say `draining` meanwhile, so no
        new work comes). Cut short after `drain_timeout`."""

    async def stop(self) -> None:
        """Drop what draining left and close resources before the bus closes."""

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(kind=self.kind, instance_id=self.instance_id, metrics_url=self.metrics_url)

    def _heartbeat(self) -> Heartbeat:
        beat = self.heartbeat()
        beat.incarnation = self.incarnation
        beat.draining = self._stopping.is_set()
        return beat

    async def _publish_heartbeat(self, beat: Heartbeat) -> None:
        """A NATS outage must not stop the service: it reconnects, and beats again then."""
        try:
            await self.bus.publish(HEARTBEAT.format(kind=self.kind), beat)
        except nats.errors.Error as exc:
            log.warning("cannot send a heartbeat: %s", exc)

    def healthy(self) -> bool:
        """What /health reports: serving and connected to NATS (not while reconnecting)."""
        return self._serving and self.bus.nc.is_connected

    async def on_main(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the main thread and wait for it."""
        done: Future[T] = Future()
        self._main_queue.put((fn, args, done))
        return await asyncio.wrap_future(done)

    def main_loop(self) -> None:
        """The main thread's work until the service stops: calls from `on_main`."""
        while self.run_calls(None):
            pass

    def run_calls(self, wait_s: float | None) -> bool:
        """Run the calls `on_main` queued, waiting up to `wait_s` (None: for ever) for the
        first; False once the service stops. For main loops with work of their own."""
        try:
            item = self._main_queue.get(timeout=wait_s)
        except queue.Empty:
            return True
        while item is not None:
            fn, args, done = item
            try:
                done.set_result(fn(*args))
            except Exception as exc:
                done.set_exception(exc)
            try:
                item = self._main_queue.get_nowait()
            except queue.Empty:
                return True
        return False

    def stop_main_loop(self) -> None:
        self._main_queue.put(None)

    def _request_stop(self) -> None:
        """On the main thread (a signal, or its loop ended): stop, waking the io loop."""
        self._stopping.set()
        if self._io_loop is not None:
            with contextlib.suppress(RuntimeError):  # the io loop has already closed
                self._io_loop.call_soon_threadsafe(self._io_stop.set)

    def serve(self) -> None:
        """Run the service: asyncio on an io thread, `main_loop` here, until a signal."""
        failure: list[BaseException] = []

        def io() -> None:
            try:
                asyncio.run(self._io())
            except BaseException as exc:
                failure.append(exc)
            finally:
                self.stop_main_loop()

        self._stopping = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._request_stop())
        # A daemon, so a stuck shutdown cannot keep the process alive past the join.
        thread = threading.Thread(target=io, name="io", daemon=True)
        thread.start()
        try:
            self.main_loop()
        finally:  # a crashed main loop stops the service too, instead of leaving it half-alive
            self._request_stop()
            thread.join(SHUTDOWN_TIMEOUT_S)
        if failure:
            raise failure[0]

    async def _io(self) -> None:
        setup_tracing(self.kind, self.instance_id)
        if self.cfg.metrics_port is not None:
            self._serve_metrics(self.cfg.metrics_host, self.cfg.metrics_port)
        self.bus = await Bus.connect(self.cfg.nats_url, self.instance_id, self.cfg)
        await self.start()
        if self.holds_requests:
            await self.bus.serve(GATEWAY_HEARTBEAT, self._on_gateway)
        self._serving = True
        log.info("%s ready", self.instance_id)
        self._io_stop = asyncio.Event()
        self._io_loop = asyncio.get_running_loop()
        # Asleep between heartbeats: idle wake-ups take the cores from decode's forwards.
        while not self._stopping.is_set():
            await self._publish_heartbeat(self._heartbeat())
            await self._forget_silent_gateways()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._io_stop.wait(), self.cfg.heartbeat_interval)
        draining = asyncio.create_task(self.drain())
        deadline = time.monotonic() + self.cfg.drain_timeout
        while not draining.done() and (left := deadline - time.monotonic()) > 0:
            # Still heartbeating (`draining`): gateways route nothing new here but keep
            # the requests in flight, which finish.
            await self._publish_heartbeat(self._heartbeat())
            await asyncio.wait({draining}, timeout=min(left, self.cfg.heartbeat_interval))
        draining.cancel()
        self._serving = False
        goodbye = self._heartbeat()
        goodbye.leaving = True
        await self._publish_heartbeat(goodbye)
        await self.stop()
        await self.bus.close()
        shutdown_tracing()

    def _serve_metrics(self, host: str, port: int) -> None:
        server = _MetricsServer(host, port, self)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        # Heartbeats carry the URL for others to scrape: a wildcard bind is reached by name.
        advertised = socket.gethostname() if host in _WILDCARDS else host
        if ":" in advertised:
            advertised = f"[{advertised}]"
        self.metrics_url = f"http://{advertised}:{server.server_address[1]}/metrics"


def service_main(
    service_cls: type[Service], config_classes: list[type], argv: list[str] | None = None
) -> None:
    """`python -m specmesh.services.<name>`: options from flags and SPECMESH_* variables, then
    run."""
    parser = argparse.ArgumentParser(
        prog=f"python -m specmesh.services.{service_cls.kind}",
        formatter_class=HelpFormatter,
    )
    for cls in [ServiceConfig, LogConfig, CoresConfig, *config_classes]:
        add_dataclass_args(parser, cls)
    args = parser.parse_args(argv)
    try:
        logs = dataclass_from_args(LogConfig, args)
        # Lines name the instance where `specmesh up` names it (decode-0), else the kind.
        configure_logging(args.instance_id or service_cls.kind, logs.log_level, logs.log_format)
        threads = place_process(dataclass_from_args(CoresConfig, args))
        if service_cls.computes:  # before its model loads: every compute thread starts later
            from specmesh.kernels.cpu import set_num_threads

            set_num_threads(threads)
        configs: list[Any] = [dataclass_from_args(cls, args) for cls in config_classes]
        service_cls(dataclass_from_args(ServiceConfig, args), *configs).serve()
    except (ValueError, ConnectionError) as exc:  # bad options, unreachable servers
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


class EngineService(Service):
    """A service whose main thread runs an engine's step loop (prefill, decode)."""

    computes = True

    driver: AsyncEngine
    engine: LLMEngine
    model_name: str  # the `model_name` label of its SGLang-named series
    transport: KVTransport  # where prompts' K/V blocks travel, content-addressed
    _reported: tuple[float, int] = (0.0, 0)  # (time, tokens generated) at the last report

    def report_engine(self) -> None:
        """Set the engine's gauges, ours and SGLang's, as of now (with each heartbeat)."""
        engine, blocks, name = self.engine, self.engine.block_manager, self.model_name
        used, waiting = len(blocks.blocks) - blocks.num_free, len(engine.scheduler.waiting)
        QUEUE_LENGTH.labels(self.kind).set(waiting)
        KV_BLOCKS_FREE.labels(self.kind).set(blocks.num_free)
        KV_BLOCKS_USED.labels(self.kind).set(used)
        NUM_QUEUE_REQS.labels(name).set(waiting)
        NUM_RUNNING_REQS.labels(name).set(len(engine.scheduler.running))
        TOKEN_USAGE.labels(name).set(used / len(blocks.blocks))
        NUM_USED_TOKENS.labels(name).set(used * blocks.block_size)
        now, generated = time.monotonic(), engine.stats.generated_tokens
        then, before = self._reported
        if then:
            GEN_THROUGHPUT.labels(name).set((generated - before) / (now - then))
        self._reported = (now, generated)

    async def serve_flush(self) -> None:
        """Take /flush_cache calls (on this instance's own subject)."""
        await self.bus.serve(flush_subject(self.instance_id), self.flush_cache)

    async def flush_cache(self, _: FlushCache) -> CacheFlushed:
        """Drop the prefix cache, here (between engine steps) and in the KV store; refused
        (400) while requests run, whose K/V may be on its way through the store."""

        def flush() -> int:
            if running := len(self.engine.sequences):
                raise ValueError(f"{self.instance_id} has {running} requests running")
            return self.engine.block_manager.flush()

        blocks = await self.driver.call(flush)
        await asyncio.to_thread(self.transport.clear)
        log.info("prefix cache flushed: %d blocks", blocks)
        return CacheFlushed(blocks=blocks)

    def main_loop(self) -> None:
        self.driver.run()

    def stop_main_loop(self) -> None:
        self.driver.shutdown()
