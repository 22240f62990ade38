"""An OTLP/HTTP trace endpoint that keeps the spans it gets and serves them as JSON.

scripts/compose-local runs it as `otel-collector` where no package provides the OpenTelemetry
collector or Jaeger: the services export to it exactly as to the collector (protobuf over
HTTP, gzip or not), and `GET /v1/spans` returns what arrived, one object per span (service,
instance, name, trace and span ids, the request id on the gateway's span), for checks that
follow a request across containers. The newest MAX_SPANS are kept; `GET /health` answers 200.
"""

from __future__ import annotations

import argparse
import gzip
import json
import signal
import sys
import threading
import zlib
from collections import deque
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

PROTOBUF = "application/x-protobuf"
MAX_SPANS = 200_000
REQUEST_ID = "specmesh.request_id"


class SpanStore:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: deque[dict[str, str]] = deque(maxlen=MAX_SPANS)

    def add(self, spans: list[dict[str, str]]) -> None:
        with self._lock:
            self._spans.extend(spans)

    def all(self) -> list[dict[str, str]]:
        with self._lock:
            return list(self._spans)


def decode_spans(body: bytes) -> list[dict[str, str]]:
    """The spans of an OTLP ExportTraceServiceRequest, with their resource's service and
    instance (service.name, service.instance.id)."""
    spans = []
    for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
        resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                attributes = {a.key: a.value.string_value for a in span.attributes}
                spans.append(
                    {
                        "service": resource.get("service.name", ""),
                        "instance": resource.get("service.instance.id", ""),
                        "name": span.name,
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        # the gateway's request span: the id it answered with (x-request-id)
                        "request_id": attributes.get(REQUEST_ID, ""),
                    }
                )
    return spans


def _decompress(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.decompress(body)
    if encoding == "deflate":
        return zlib.decompress(body)
    return body


class OtlpTraceHandler(BaseHTTPRequestHandler):
    """OTLP/HTTP's trace export as a collector takes it (protobuf, gzip or deflate or
    neither): each export's protobuf body goes to `receive`, which may raise DecodeError
    (a 400); metrics and logs are accepted and dropped, anything else is a 4xx."""

    def receive(self, body: bytes) -> None:
        """Where an export's body goes: each subclass says (the sink's store, a test's
        receiver); the base takes none."""
        raise NotImplementedError

    def do_POST(self) -> None:
        length = self.headers.get("Content-Length")
        if length is None:
            self._reply(411)
            return
        body = self.rfile.read(int(length))
        if self.path.rstrip("/") != "/v1/traces":
            self._reply(200)  # metrics and logs: accepted, not kept
            return
        if self.headers.get_content_type() != PROTOBUF:
            self._reply(415)
            return
        try:
            encoding = self.headers.get("Content-Encoding", "identity").lower()
            self.receive(_decompress(body, encoding))
        except (OSError, EOFError, zlib.error, DecodeError) as exc:
            self._reply(400, str(exc).encode())
            return
        self._reply(200, ExportTraceServiceResponse().SerializeToString(), PROTOBUF)

    def _reply(self, status: int, body: bytes = b"", content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: a line per export would bury the container's (or a test's) output."""


class _SinkHandler(OtlpTraceHandler):
    def __init__(self, *args: Any, store: SpanStore, **kwargs: Any) -> None:
        self.store = store  # set first: the base __init__ handles the request
        super().__init__(*args, **kwargs)

    def receive(self, body: bytes) -> None:
        self.store.add(decode_spans(body))

    def do_GET(self) -> None:
        if self.path == "/health":
            self._reply(200, b"ok")
        elif self.path == "/v1/spans":
            self._reply(200, json.dumps(self.store.all()).encode(), "application/json")
        else:
            self._reply(404)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=4318)
    args = parser.parse_args()
    handler = partial(_SinkHandler, store=SpanStore())
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    # PID 1 in its container: without a handler SIGTERM is ignored and `docker stop` waits.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"OTLP/HTTP span sink on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
