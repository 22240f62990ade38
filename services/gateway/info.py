"""The gateway's small routes: probes, metrics, version, models, server and model info."""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from specmesh.services.gateway.cluster import Cluster
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.errors import APIError
from specmesh.shared.config import DEFAULT_MODEL_NAME


def _package_version() -> str:
    """The installed distribution's version; "unknown" where the source tree runs without
    being installed (PYTHONPATH, as scripts/gpu-check runs it)."""
    try:
        return importlib.metadata.version("specmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _package_version()


def info_routes(cluster: Cluster, cfg: GatewayConfig) -> APIRouter:
    router = APIRouter()
    model_name = cfg.model_name
    created = int(time.time())

    @router.get("/live")
    async def live() -> dict[str, str]:
        """Liveness: 200 while this process serves HTTP, workers or not (restarting the gateway
        would not bring them back; /health is readiness)."""
        return {"status": "ok"}

    @router.get("/health")
    async def health() -> JSONResponse:
        """Ready when a decode worker is alive (503 otherwise, so orchestrators wait)."""
        workers = len(cluster.live("decode"))
        body = {"status": "ok" if workers else "no decode workers", "decode_workers": workers}
        return JSONResponse(body, status_code=200 if workers else 503)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict[str, str]:
        """The package version, in vLLM's shape (SGLang puts it in /get_server_info)."""
        return {"version": VERSION}

    @router.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """State in SGLang's shape (bench_serving reads avg_spec_accept_length)."""
        decoders = [i.heartbeat for i in cluster.live("decode")]
        stats = cluster.stats
        state: dict[str, Any] = {
            "finished_requests": stats.requests,
            "generated_tokens": stats.generated_tokens,
            "kv_blocks_free": sum(h.kv_blocks_free for h in decoders),
            "kv_blocks_total": sum(h.kv_blocks_total for h in decoders),
            "instances": {kind: len(cluster.live(kind)) for kind in ("decode", "drafter")},
        }
        algorithms = {h.algorithm for h in decoders if h.algorithm}
        if algorithms:
            state.update(
                speculative_algorithm=",".join(sorted(algorithms)),
                avg_spec_accept_length=stats.spec.acceptance_length,
                spec_verify_steps=stats.spec.steps,
                spec_draft_tokens=stats.spec.draft_tokens,
                spec_accepted_tokens=stats.spec.accepted_tokens,
            )
        path = cfg.model or DEFAULT_MODEL_NAME
        return {"model_path": path, "internal_states": [state], "version": VERSION}

    def model_card() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specmesh"}
        return {**card, "root": model_name, "max_model_len": cluster.max_model_len()}

    @router.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        """SGLang's model info endpoint."""
        path = cfg.model or DEFAULT_MODEL_NAME
        return {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "max_model_len": cluster.max_model_len(),
        }

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} not found", "model")
        return model_card()

    return router
