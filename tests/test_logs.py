"""shared/logs.py's two formats and the gateway's access log, on a small ASGI app."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Iterator
from datetime import datetime

import httpx
import pytest
from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider
from specmesh.services.gateway.access import AccessLog
from specmesh.shared.logs import configure_logging
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

pytestmark = pytest.mark.unit

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
log = logging.getLogger("specmesh.test")


@pytest.fixture
def lines(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[[], list[str]]]:
    """What configure_logging's handler wrote to stderr (the root logger is restored after)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield lambda: capsys.readouterr().err.splitlines()
    root.handlers[:] = handlers
    root.setLevel(level)


def _fail() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")


def test_text_lines_name_the_service_and_end_with_the_ids(
    lines: Callable[[], list[str]],
) -> None:
    configure_logging("decode-0", "info", "text")
    log.info("hello %s", "there", extra={"request_id": "chatcmpl-1", "trace_id": TRACE_ID})
    log.debug("below the level")
    _fail()
    hello, failed, *traceback = lines()
    time = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
    ids = f"request_id=chatcmpl-1 trace_id={TRACE_ID}"
    assert re.fullmatch(rf"{time} decode-0 INFO specmesh.test: hello there {ids}", hello)
    assert re.fullmatch(rf"{time} decode-0 ERROR specmesh.test: failed", failed)
    assert traceback[0] == "Traceback (most recent call last):"
    assert traceback[-1] == "ValueError: bad"


def test_json_lines_are_one_object_each(lines: Callable[[], list[str]]) -> None:
    configure_logging("gateway", "debug", "json")
    log.debug("hello %s", "there", extra={"request_id": "cmpl-1", "status": 200})
    _fail()
    hello, failed = (json.loads(line) for line in lines())
    assert datetime.fromisoformat(hello.pop("time")).utcoffset().total_seconds() == 0
    assert hello == {
        "level": "DEBUG",
        "service": "gateway",
        "logger": "specmesh.test",
        "message": "hello there",
        "request_id": "cmpl-1",
        "status": 200,
    }
    assert failed["message"] == "failed" and failed["level"] == "ERROR"
    assert failed["exception"].endswith("ValueError: bad")


def test_a_record_logged_in_a_span_carries_its_trace_id(lines: Callable[[], list[str]]) -> None:
    configure_logging("prefill-0", "info", "json")
    with TracerProvider().get_tracer("test").start_as_current_span("request") as span:
        log.info("inside")
    log.info("outside")
    inside, outside = (json.loads(line) for line in lines())
    assert inside["trace_id"] == f"{span.get_span_context().trace_id:032x}"
    assert "trace_id" not in outside


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="--log-level must be one of debug, info"):
        configure_logging("x", "loud", "text")
    with pytest.raises(ValueError, match="--log-format must be one of text, json"):
        configure_logging("x", "info", "xml")


async def _generate(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok", headers={"x-request-id": "chatcmpl-7"})


async def _health(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


async def _fails(_: Request) -> PlainTextResponse:
    raise RuntimeError("broken")


def test_the_access_log_has_a_line_per_request(lines: Callable[[], list[str]]) -> None:
    """The request id the response names, else the client's; the trace id of the span the
    request ran in; a failure before any response as the 500 the server sends."""
    routes = [
        Route("/v1/generate", _generate, methods=["POST"]),
        Route("/health", _health),
        Route("/fails", _fails),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(AccessLog, untraced={"/health"})])
    configure_logging("gateway-0", "info", "json")

    async def requests() -> None:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            traced = {"x-request-id": "client-1"}
            propagate.inject(traced)  # the client's traceparent
            await client.post("/v1/generate", headers=traced)
            await client.get("/health", headers={"x-request-id": "client-2"})
            await client.get("/fails")

    # The client's span: the gateway's, without a tracer provider here, continues its trace.
    with TracerProvider().get_tracer("client").start_as_current_span("client") as span:
        asyncio.run(requests())
    trace_id = f"{span.get_span_context().trace_id:032x}"
    entries = [json.loads(line) for line in lines()]
    generate, health, fails = (e for e in entries if e["logger"] == "specmesh.access")
    assert generate["message"] == f"POST /v1/generate 200 {generate['duration_ms']:.1f} ms"
    assert generate["request_id"] == "chatcmpl-7" and generate["trace_id"] == trace_id
    assert generate["method"] == "POST" and generate["status"] == 200
    assert (health["path"], health["status"], health["request_id"]) == ("/health", 200, "client-2")
    assert (fails["status"], fails["level"]) == (500, "INFO") and "request_id" not in fails
