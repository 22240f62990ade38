"""The gateway process: the OpenAI HTTP API (uvicorn) beside its NATS client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import h11
import uvicorn
from specmesh.services.gateway.app import build_app
from specmesh.services.gateway.cluster import Cluster
from specmesh.services.gateway.config import GatewayConfig
from specmesh.shared.protocol import Heartbeat
from specmesh.shared.service import Service, ServiceConfig
from specmesh.shared.telemetry import ACTIVE_REQUESTS
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service handles SIGTERM/SIGINT and stops the server itself


class _HeaderDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers are not
    complete `header_timeout` seconds after it opened or after its last response (uvicorn
    waits forever for them, so slow clients could hold every connection)."""

    header_timeout: float  # set per server (--header-timeout), in a subclass
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.header_timeout, self._expire)

    def _expire(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no request begun in time


class GatewayService(Service):
    kind = "gateway"

    def __init__(self, cfg: ServiceConfig, gcfg: GatewayConfig) -> None:
        super().__init__(cfg)
        self.gcfg = gcfg

    async def start(self) -> None:
        g = self.gcfg
        self.cluster = Cluster(
            self.bus,
            self.instance_id,
            g.instance_timeout,
            g.request_timeout,
            g.max_pending_requests,
            g.request_idle_timeout,
            g.model_name,
            g,
        )
        await self.cluster.start()
        app = build_app(self.cluster, g)
        # uvicorn's records go through our logging (log_config=None: no handlers of its own),
        # its start-up lines stay below warning (ours say the same), and the access log is
        # the app's (services/gateway/access.py), with request and trace ids.
        protocol = type("HTTP", (_HeaderDeadline,), {"header_timeout": g.header_timeout})
        config = uvicorn.Config(
            app,
            host=g.host,
            port=g.port,
            http=protocol,
            log_level="warning",
            log_config=None,
            access_log=False,
        )
        self.server = _Server(config)
        self.http = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.http.done():  # e.g. the port is taken
                raise ConnectionError(f"cannot serve HTTP on {g.host}:{g.port}")
            await asyncio.sleep(0.05)
        log.info("serving %s at http://%s:%d/v1", g.model_name, g.host, g.port)

    def heartbeat(self) -> Heartbeat:
        beat = super().heartbeat()
        beat.active_requests = len(self.cluster.outputs)  # sequences in flight here
        ACTIVE_REQUESTS.labels(self.kind).set(beat.active_requests)
        return beat

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.http
        await self.cluster.stop()
