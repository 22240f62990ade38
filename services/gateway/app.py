"""The gateway's FastAPI app: the OpenAI API over the services (see cluster.py).

Here: the middleware (API key, body limit), OpenAI error JSON for every error (see
errors.py), and the small routes (probes, metrics, version, models, server and model info). The
generation routes live beside their request logic, in chat.py and completions.py; what
they share (starting a request, collected and SSE responses) in respond.py. A request
becomes one sequence per choice and prompt; a client that goes away, streaming or not,
aborts its sequences in every service.
"""

from __future__ import annotations

import hmac
import importlib.metadata
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from specmesh.services.gateway.access import AccessLog
from specmesh.services.gateway.chat import chat_routes
from specmesh.services.gateway.cluster import Cluster
from specmesh.services.gateway.completions import completion_routes
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.errors import APIError, error_response
from specmesh.services.gateway.native import native_routes
from specmesh.services.gateway.responses import response_routes
from specmesh.shared.config import DEFAULT_MODEL_NAME, default_model_dir
from specmesh.shared.parsers.reasoning import make_reasoning_parser
from specmesh.shared.parsers.tools import make_tool_parser, tool_parser_for_template
from specmesh.shared.tokenizer import read_chat_template
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Probes and scrapers reach these without the API key; nothing else.
OPEN_PATHS = frozenset({"/live", "/health", "/metrics"})


def _package_version() -> str:
    """The installed distribution's version; "unknown" where the source tree runs without
    being installed (PYTHONPATH, as scripts/gpu-check runs it)."""
    try:
        return importlib.metadata.version("specmesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


VERSION = _package_version()


class Guard:
    """ASGI middleware: the API key on every route but OPEN_PATHS, and the body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                response = error_response(401, "invalid or missing API key (Authorization: Bearer)")
                return await response(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            status = 413 if length.isdigit() else 400
            message = f"request body over {self.max_body} bytes" if status == 413 else "bad length"
            return await error_response(status, message)(scope, receive, send)
        if length is None:  # chunked: read it here, where going over can still answer 413
            body = await self._read_body(receive)
            if body is None:
                message = f"request body over {self.max_body} bytes"
                return await error_response(413, message)(scope, receive, send)
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes max_body."""
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that gives `body` once, then waits on the client as before."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _template_tool_parser(model: str | None) -> str:
    """Without --tool-call-parser: the format the model's chat template writes."""
    model_dir = Path(model) if model else default_model_dir()
    name, named = tool_parser_for_template(read_chat_template(model_dir))
    how = "as its chat template writes them" if named else "its chat template names no format"
    log.info("tool calls in the %s format (%s; --tool-call-parser chooses)", name, how)
    return name


def build_app(cluster: Cluster, cfg: GatewayConfig) -> FastAPI:
    model_name = cfg.model_name
    tool_parser = make_tool_parser(cfg.tool_call_parser or _template_tool_parser(cfg.model))
    reasoning = make_reasoning_parser(cfg.reasoning_parser) if cfg.reasoning_parser else None
    app = FastAPI(title="specmesh", summary="OpenAI-compatible API with speculative decoding")
    app.add_middleware(Guard, api_key=cfg.api_key, max_body=cfg.max_request_bytes)
    app.add_middleware(AccessLog, untraced=OPEN_PATHS)  # outermost: logs Guard's refusals
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/live")
    async def live() -> dict[str, str]:
        """Liveness: 200 while this process serves HTTP, workers or not (restarting the gateway
        would not bring them back; /health is readiness)."""
        return {"status": "ok"}

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ready when a decode worker is alive (503 otherwise, so orchestrators wait)."""
        workers = len(cluster.live("decode"))
        body = {"status": "ok" if workers else "no decode workers", "decode_workers": workers}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """The package version, in vLLM's shape (SGLang puts it in /get_server_info)."""
        return {"version": VERSION}

    @app.get("/get_server_info")
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

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        """SGLang's model info endpoint."""
        path = cfg.model or DEFAULT_MODEL_NAME
        return {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "max_model_len": cluster.max_model_len(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} not found", "model")
        return model_card()

    app.include_router(chat_routes(cluster, model_name, tool_parser, reasoning))
    app.include_router(completion_routes(cluster, model_name))
    app.include_router(native_routes(cluster, model_name))
    app.include_router(response_routes(cluster, model_name, tool_parser, reasoning))
    return app
