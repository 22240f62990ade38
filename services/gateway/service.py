"""The gateway process: the OpenAI HTTP API (uvicorn) beside its NATS client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from services.gateway.app import build_app
from services.gateway.cluster import Cluster
from shared.config import DEFAULT_MODEL_NAME, model_option, option
from shared.service import Service, ServiceConfig

log = logging.getLogger(__name__)


@dataclass
class GatewayConfig:
    host: str = option("127.0.0.1", "HTTP address to listen on")
    port: int = option(8000, "HTTP port")
    model: str | None = model_option()  # the gateway only needs its name
    served_model_name: str | None = option(None, "model id in the API (default: from --model)")
    instance_timeout: float = option(3.0, "seconds without a heartbeat before an instance is gone")
    request_timeout: float = option(120.0, "seconds a prefill may take, queueing included")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the service handles SIGTERM/SIGINT and stops the server itself


class GatewayService(Service):
    kind = "gateway"

    def __init__(self, cfg: ServiceConfig, gcfg: GatewayConfig) -> None:
        super().__init__(cfg)
        self.gcfg = gcfg
        model = gcfg.model or DEFAULT_MODEL_NAME
        self.model_name = gcfg.served_model_name or Path(model.removesuffix(".gguf")).name

    async def start(self) -> None:
        g = self.gcfg
        self.cluster = Cluster(self.bus, self.instance_id, g.instance_timeout, g.request_timeout)
        await self.cluster.start()
        app = build_app(self.cluster, self.model_name, g.model or DEFAULT_MODEL_NAME)
        self.server = _Server(uvicorn.Config(app, host=g.host, port=g.port, log_level="warning"))
        self.serving = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self.serving.done():  # e.g. the port is taken
                raise ConnectionError(f"cannot serve HTTP on {g.host}:{g.port}")
            await asyncio.sleep(0.05)
        log.info("serving %s at http://%s:%d/v1", self.model_name, g.host, g.port)

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.serving
        await self.cluster.stop()
