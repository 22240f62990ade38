"""The gateway's FastAPI app: the OpenAI API over the services (see cluster.py).

Here: the middleware (API key, body limit) and OpenAI error JSON for every error (see
errors.py); the small routes (probes, metrics, version, models, server and model info) are in
info.py. The generation routes live beside their request logic, in chat.py and completions.py; what
they share (starting a request, collected and SSE responses) in respond.py. A request
becomes one sequence per choice and prompt; a client that goes away, streaming or not,
aborts its sequences in every service.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from specmesh.services.gateway.access import AccessLog
from specmesh.services.gateway.chat import chat_routes
from specmesh.services.gateway.cluster import Cluster
from specmesh.services.gateway.completions import completion_routes
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.errors import APIError, error_response
from specmesh.services.gateway.info import info_routes
from specmesh.services.gateway.native import native_routes
from specmesh.services.gateway.responses import response_routes
from specmesh.shared.config import default_model_dir
from specmesh.shared.parsers.reasoning import make_reasoning_parser
from specmesh.shared.parsers.tools import make_tool_parser, tool_parser_for_template
from specmesh.shared.tokenizer import read_chat_template
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

# Probes and scrapers reach these without the API key; nothing else.
OPEN_PATHS = frozenset({"/live", "/health", "/metrics"})


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
    _answer_errors_as_openai(app)
    app.include_router(info_routes(cluster, cfg))
    app.include_router(chat_routes(cluster, model_name, tool_parser, reasoning))
    app.include_router(completion_routes(cluster, model_name))
    app.include_router(native_routes(cluster, model_name))
    app.include_router(response_routes(cluster, model_name, tool_parser, reasoning))
    return app


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error, ours or the framework's, as OpenAI error JSON."""

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
