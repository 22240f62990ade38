"""A real OTLP/HTTP trace receiver, so tests check the spans services actually export.

Point OTEL_EXPORTER_OTLP_ENDPOINT at `endpoint` (or an exporter at endpoint + "/v1/traces"):
spans arrive over HTTP as protobuf exactly as a collector would get them, then the test
waits for the ones it expects. Metrics and logs are accepted and dropped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from http.server import ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from specmesh.services.compose_local.otlp_sink import OtlpTraceHandler


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # hex
    span_id: str  # hex
    parent_span_id: str  # hex, "" for a root span
    attributes: dict[str, Any]


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return _attributes(v.kvlist_value.values)
    return None if kind is None else getattr(v, kind)


def _attributes(kvs: Iterable[KeyValue]) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def _decode(body: bytes) -> list[ReceivedSpan]:
    request = ExportTraceServiceRequest.FromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service=service,
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes=_attributes(span.attributes),
                    )
                )
    return spans


class _Handler(OtlpTraceHandler):
    def __init__(self, *args: Any, receiver: OtlpReceiver, **kwargs: Any) -> None:
        self.receiver = receiver  # set first: the base __init__ handles the request
        super().__init__(*args, **kwargs)

    def receive(self, body: bytes) -> None:
        self.receiver._record(_decode(body))


class OtlpReceiver:
    """OTLP/HTTP receiver on a free loopback port, serving from a daemon thread.

    Use as a context manager; the port is bound (and `endpoint` valid) from construction.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, receiver=self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="otlp-receiver", daemon=True
        )

    @property
    def endpoint(self) -> str:
        """The base URL, as OTEL_EXPORTER_OTLP_ENDPOINT wants it (no /v1/traces)."""
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _record(self, spans: list[ReceivedSpan]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order (a copy)."""
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """Poll until predicate(spans) holds (exporters send in batches, later); return spans."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                seen = ", ".join(f"{s.service}:{s.name}" for s in spans[:50])
                raise AssertionError(
                    f"spans not as expected after {timeout} s; got {len(spans)}: {seen or 'none'}"
                )
            time.sleep(0.02)
