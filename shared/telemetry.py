"""Tracing and metrics, set up the same way in every service.

Traces: OpenTelemetry, exported over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT`
is set (the standard variables configure the exporter); the trace context
travels in NATS headers (see shared/bus.py).

Metrics: Prometheus, one definition of each here; a service serves the ones it
updates on `/metrics`. Names follow the vLLM/Dynamo style so dashboards carry over.
"""

from __future__ import annotations

import os

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)


def setup_tracing(service: str, instance_id: str) -> None:
    """Install an SDK tracer provider exporting over OTLP, if an endpoint is configured.
    Without one the API's no-op tracer still carries incoming trace context onward."""
    if not (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create(
        {"service.name": f"specmesh-{service}", "service.instance.id": instance_id}
    )
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    """Flush spans still queued (a service calls this on its way out)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


# Gateway
REQUESTS = Counter("specmesh_requests", "finished HTTP generation requests", ["status"])
TTFT = Histogram(
    "specmesh_time_to_first_token_seconds",
    "request arrival to first token",
    buckets=_LATENCY_BUCKETS,
)
ITL = Histogram(
    "specmesh_inter_token_latency_seconds",
    "time between streamed tokens (per token, deltas of several tokens averaged)",
    buckets=_LATENCY_BUCKETS,
)
E2E = Histogram(
    "specmesh_e2e_request_latency_seconds",
    "request arrival to last token",
    buckets=_LATENCY_BUCKETS,
)
PROMPT_TOKENS = Counter("specmesh_prompt_tokens", "prompt tokens of finished requests")
GENERATION_TOKENS = Counter("specmesh_generation_tokens", "generated tokens of finished requests")
ROUTED = Counter("specmesh_routed_requests", "requests routed to an instance", ["kind", "instance"])
MIGRATED = Counter(
    "specmesh_migrated_requests", "requests resumed on another decode worker", ["outcome"]
)
INSTANCES = Gauge("specmesh_instances", "live instances the gateway sees", ["kind"])

# Every service with a queue
QUEUE_LENGTH = Gauge("specmesh_queue_length", "requests waiting", ["service"])
ACTIVE_REQUESTS = Gauge("specmesh_active_requests", "requests in progress", ["service"])

# Prefill and decode
KV_BLOCKS_USED = Gauge("specmesh_kv_blocks_used", "KV-cache blocks in use", ["service"])
KV_BLOCKS_FREE = Gauge("specmesh_kv_blocks_free", "KV-cache blocks free", ["service"])
TRANSPORT_BYTES = Counter(
    "specmesh_kv_transport_bytes", "bytes moved through the KV transport", ["service", "direction"]
)
PREFILL_TOKENS = Counter(
    "specmesh_prefill_tokens", "prompt tokens by how prefill got their K/V", ["source"]
)  # source: computed | cached (local prefix cache or the transport)

# Speculation (decode verifies, drafter drafts)
VERIFY_SECONDS = Histogram(
    "specmesh_verify_seconds", "one decode/verify forward step", buckets=_LATENCY_BUCKETS
)
DRAFT_SECONDS = Histogram(
    "specmesh_draft_seconds", "one drafting call (all requests of a step)", buckets=_LATENCY_BUCKETS
)
DRAFT_WAIT_SECONDS = Counter("specmesh_draft_wait_seconds", "time decode spent waiting for drafts")
SPEC_VERIFY_STEPS = Counter("specmesh_spec_verify_steps", "verification steps", ["algorithm"])
SPEC_DRAFT_TOKENS = Counter("specmesh_spec_draft_tokens", "draft tokens verified", ["algorithm"])
SPEC_ACCEPTED_TOKENS = Counter(
    "specmesh_spec_accepted_tokens", "draft tokens accepted", ["algorithm"]
)
SPEC_ACCEPTANCE_LENGTH = Histogram(
    "specmesh_spec_acceptance_length",
    "tokens per verification step of finished requests",
    ["algorithm"],
    buckets=(1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5, 6, 8, 12),
)
