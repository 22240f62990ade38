"""Tracing as OpenTelemetry users expect it: the gateway continues a caller's W3C
`traceparent` (spans captured in memory), and the standard OTEL_* variables choose the
exporters and the service name (shared/telemetry.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from opentelemetry import propagate
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from specmesh.services.gateway import access
from specmesh.services.gateway.access import AccessLog
from specmesh.shared.telemetry import span_exporters, tracing_resource
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

pytestmark = pytest.mark.unit

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN_ID = "b7ad6b7169203331"
OTEL_VARIABLES = (
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)


async def _onward_headers(_: Request) -> JSONResponse:
    """The trace headers a service call from this route would carry (shared/bus.py)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return JSONResponse(carrier)


def _request(headers: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> tuple[dict, ReadableSpan]:
    """One request through the access log's span, recorded in memory: the headers the route
    would send onward, and the gateway's span."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(access, "tracer", provider.get_tracer("specmesh.gateway"))
    route = Route("/v1/chat/completions", _onward_headers, methods=["POST"])
    app = Starlette(routes=[route], middleware=[Middleware(AccessLog)])

    async def post() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return (await client.post("/v1/chat/completions", headers=headers)).json()

    onward = asyncio.run(post())
    (span,) = exporter.get_finished_spans()
    return onward, span


def test_the_gateway_continues_the_callers_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
    onward, span = _request({"traceparent": traceparent}, monkeypatch)
    assert span.name == "POST /v1/chat/completions"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.span_id, "016x") == CALLER_SPAN_ID
    # Every service's spans hang below the gateway's, in the caller's trace.
    assert onward["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"


def test_without_a_traceparent_the_gateway_starts_the_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    onward, span = _request({}, monkeypatch)
    assert span.parent is None
    assert onward["traceparent"].split("-")[1] == format(span.context.trace_id, "032x")


@pytest.fixture
def otel_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTEL_* variable from the environment the tests run in."""
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _exporter_types() -> list[type]:
    return [type(exporter) for exporter in span_exporters()]


def test_otlp_is_the_default_exporter_once_an_endpoint_is_set(otel_env: pytest.MonkeyPatch) -> None:
    assert _exporter_types() == []  # nowhere to send spans: no tracing
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert _exporter_types() == [OTLPSpanExporter]
    otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp, console")
    assert _exporter_types() == [OTLPSpanExporter, ConsoleSpanExporter]


def test_none_and_sdk_disabled_turn_tracing_off(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    otel_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert _exporter_types() == []
    otel_env.setenv("OTEL_TRACES_EXPORTER", "console")
    assert _exporter_types() == [ConsoleSpanExporter]  # needs no endpoint
    otel_env.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert _exporter_types() == []


def test_an_unknown_exporter_is_refused(otel_env: pytest.MonkeyPatch) -> None:
    otel_env.setenv("OTEL_TRACES_EXPORTER", "otlp,zipkin")
    with pytest.raises(ValueError, match="unknown exporter zipkin .known: otlp, console, none"):
        span_exporters()


def test_otel_service_name_names_the_service(otel_env: pytest.MonkeyPatch) -> None:
    ours = tracing_resource("decode", "decode-1").attributes
    assert (ours["service.name"], ours["service.instance.id"]) == ("specmesh-decode", "decode-1")
    otel_env.setenv("OTEL_SERVICE_NAME", "llm-decode")
    theirs = tracing_resource("decode", "decode-1").attributes
    assert (theirs["service.name"], theirs["service.instance.id"]) == ("llm-decode", "decode-1")
