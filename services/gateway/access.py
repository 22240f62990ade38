"""The gateway's access log, and the span every HTTP request runs in.

Each request is one trace: this span is its root (or, where the caller sends a W3C
`traceparent`, a child of the caller's span: the client's trace goes on through us), a
generation route starts its sequences in a child span tagged with its request id
(respond.py `start`), and every service's spans for the request hang below.
It stays open until the response's last byte, streamed or not. The access line is logged
inside it, so it carries the trace id (shared/logs.py) beside the request id.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterable

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("specmesh.access")
tracer = trace.get_tracer("specmesh.gateway")

REQUEST_ID = b"x-request-id"


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    return next((v.decode("latin-1") for k, v in headers if k.lower() == name), None)


def _caller_context(scope: Scope) -> Context:
    """The trace context the caller's headers carry (`traceparent`, `tracestate`, baggage:
    the configured propagators'), or an empty one."""
    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
    return propagate.extract(carrier)


class AccessLog:
    """ASGI middleware: a span per HTTP request (none on `untraced` paths: probes would
    bury the requests' traces) and a line when it ends: method, path, status, duration,
    and the request id, the one the response names (the generation routes') or else the
    client's `x-request-id`."""

    def __init__(self, app: ASGIApp, untraced: Collection[str] = ()) -> None:
        self.app, self.untraced = app, untraced

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        # Until a response starts, a failure is what the server will answer: 500.
        status, request_id = 500, _header(scope["headers"], REQUEST_ID)

        async def send_noted(message: Message) -> None:
            nonlocal status, request_id
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = _header(message.get("headers", ()), REQUEST_ID) or request_id
            await send(message)

        started = time.perf_counter()
        span = (
            contextlib.nullcontext(trace.INVALID_SPAN)
            if path in self.untraced
            else tracer.start_as_current_span(f"{method} {path}", context=_caller_context(scope))
        )
        with span as current:
            try:
                await self.app(scope, receive, send_noted)
            finally:
                current.set_attribute("http.response.status_code", status)
                ms = round((time.perf_counter() - started) * 1000, 1)
                fields = {"method": method, "path": path, "status": status, "duration_ms": ms}
                extra = {**fields, "request_id": request_id}
                log.info("%s %s %d %.1f ms", method, path, status, ms, extra=extra)
