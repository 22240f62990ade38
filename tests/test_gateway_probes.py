"""The gateway's small routes on its real app, with no worker up (no NATS): liveness stays
200 where readiness is 503, and the version is served where vLLM and SGLang serve it."""

from __future__ import annotations

import asyncio
import importlib.metadata

import httpx
import pytest
from specmesh.services.gateway.app import build_app
from specmesh.services.gateway.cluster import Cluster
from specmesh.services.gateway.config import GatewayConfig

pytestmark = pytest.mark.unit

API_KEY = "sk-probe"


def _get(*paths: str, key: str | None = None) -> list[httpx.Response]:
    """GET each path from a gateway whose cluster never started: no instance is known."""
    cfg = GatewayConfig(model="m", tool_call_parser="hermes", api_key=API_KEY)
    cluster = Cluster(None, "gw", 3.0, 10.0, 8, 60.0, cfg.model_name, cfg)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=build_app(cluster, cfg))
    headers = {"authorization": f"Bearer {key}"} if key else {}

    async def get() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return [await client.get(path, headers=headers) for path in paths]

    return asyncio.run(get())


def test_liveness_stays_200_while_readiness_waits_for_workers() -> None:
    live, health = _get("/live", "/health")  # probes need no API key
    assert (live.status_code, live.json()) == (200, {"status": "ok"})
    assert health.status_code == 503 and health.json()["decode_workers"] == 0


def test_the_version_is_the_package_version() -> None:
    version = importlib.metadata.version("specmesh")
    refused, served, info = _get("/version"), *_get("/version", "/get_server_info", key=API_KEY)
    assert refused[0].status_code == 401
    assert served.json() == {"version": version}  # vLLM's shape
    assert info.json()["version"] == version  # SGLang's place for it
