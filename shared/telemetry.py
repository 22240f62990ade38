"""Tracing and metrics, set up the same way in every service.

Traces: OpenTelemetry, exported over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT`
is set (the standard variables configure the exporter; `OTEL_TRACES_EXPORTER`,
`OTEL_SERVICE_NAME` and `OTEL_SDK_DISABLED` are honoured too); the trace context
travels in NATS headers (see shared/bus.py), and the gateway continues a caller's
W3C `traceparent` (services/gateway/access.py).

Metrics: Prometheus, one definition of each here; a service serves the ones it
updates on `/metrics`. Where SGLang has a metric, ours is SGLang's: its name (`sglang:`
prefix), its `model_name` label and its latency range, so SGLang's Grafana dashboard
works against us unchanged. `specmesh_` names cover what SGLang has no metric for
(per-service load, KV blocks and transport bytes, drafting, routing, restarts).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from opentelemetry import trace
from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:  # the SDK is imported only where tracing is on
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExporter

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5, 10)
# SGLang's ranges: a long chat's first token or whole answer must not read as 10 s.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1)
_TTFT_BUCKETS += (2.5, 5, 7.5, 10, 15, 20, 25, 30, 60, 120, 300)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1)
_ITL_BUCKETS += (0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 90)
_E2E_BUCKETS += (120, 180, 300, 600, 1200, 2400)
MODEL = ["model_name"]
TRACES_EXPORTERS = ("otlp", "console", "none")  # OTEL_TRACES_EXPORTER's values served here


def setup_tracing(service: str, instance_id: str) -> None:
    """Install an SDK tracer provider sending spans to the exporters the standard variables
    choose (span_exporters), if any. Without one the API's no-op tracer still carries
    incoming trace context onward."""
    exporters = span_exporters()
    if not exporters:
        return
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=tracing_resource(service, instance_id))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)


def span_exporters() -> list[SpanExporter]:
    """The exporters `OTEL_TRACES_EXPORTER` names (comma-separated; default otlp): otlp, sent
    only where an OTLP endpoint is configured (the standard variables configure it), console
    (JSON on stdout), none. None at all under `OTEL_SDK_DISABLED=true`."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    chosen = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").lower().split(",")
    names = {name.strip() for name in chosen}
    if unknown := names - set(TRACES_EXPORTERS):
        raise ValueError(
            f"OTEL_TRACES_EXPORTER: unknown exporter {', '.join(sorted(unknown))} "
            f"(known: {', '.join(TRACES_EXPORTERS)})"
        )
    exporters: list[SpanExporter] = []
    if "none" in names:
        return exporters
    if "otlp" in names and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporters.append(OTLPSpanExporter())
    if "console" in names:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters.append(ConsoleSpanExporter())
    return exporters


def tracing_resource(service: str, instance_id: str) -> Resource:
    """Who sends the spans: `specmesh-<service>`, unless `OTEL_SERVICE_NAME` names it (the SDK
    reads that, and `OTEL_RESOURCE_ATTRIBUTES`, itself; attributes given here would win)."""
    from opentelemetry.sdk.resources import Resource

    attributes = {"service.instance.id": instance_id}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = f"specmesh-{service}"
    return Resource.create(attributes)


def shutdown_tracing() -> None:
    """Flush spans still queued (a service calls this on its way out)."""
    provider = trace.get_tracer_provider()
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()


# Gateway
REQUESTS = Counter("specmesh_requests", "finished HTTP generation requests", ["status"])
TTFT = Histogram(
    "sglang:time_to_first_token_seconds",
    "request arrival to first token",
    MODEL,
    buckets=_TTFT_BUCKETS,
)
ITL = Histogram(
    "sglang:inter_token_latency_seconds",
    "time between streamed tokens (per token, deltas of several tokens averaged)",
    MODEL,
    buckets=_ITL_BUCKETS,
)
E2E = Histogram(
    "sglang:e2e_request_latency_seconds",
    "request arrival to last token",
    MODEL,
    buckets=_E2E_BUCKETS,
)
PROMPT_TOKENS = Counter("sglang:prompt_tokens", "prompt tokens of finished requests", MODEL)
GENERATION_TOKENS = Counter(
    "sglang:generation_tokens", "generated tokens of finished requests", MODEL
)
ROUTED = Counter(
    "specmesh_routed_requests", "requests routed to an instance", ["kind", "instance_id"]
)
MIGRATED = Counter(
    "specmesh_migrated_requests", "requests resumed on another decode worker", ["outcome"]
)
INSTANCES = Gauge("specmesh_instances", "live instances the gateway sees", ["kind"])

# Prefill and decode, per instance, as SGLang's scheduler reports them
NUM_RUNNING_REQS = Gauge("sglang:num_running_reqs", "sequences in the running batch", MODEL)
NUM_QUEUE_REQS = Gauge("sglang:num_queue_reqs", "sequences waiting to be scheduled", MODEL)
TOKEN_USAGE = Gauge("sglang:token_usage", "fraction of the KV cache in use", MODEL)
NUM_USED_TOKENS = Gauge("sglang:num_used_tokens", "KV-cache token slots in use", MODEL)
GEN_THROUGHPUT = Gauge(
    "sglang:gen_throughput", "tokens/s generated since the previous report", MODEL
)
CACHE_HIT_RATE = Gauge(
    "sglang:cache_hit_rate", "share of prompt tokens served from a prefix cache", MODEL
)
SPEC_ACCEPT_LENGTH = Gauge(
    "sglang:spec_accept_length", "tokens per verify step since the previous report", MODEL
)

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

# Online learning (drafters follow head versions, the learner trains and publishes them)
ONLINE_HEAD_VERSION = Gauge(
    "specmesh_online_head_version", "head version in use or announced", ["service"]
)
HEAD_SWAPS = Counter("specmesh_online_head_swaps", "head versions a drafter switched to")
HEAD_REFUSALS = Counter("specmesh_online_head_refusals", "announced versions a drafter refused")
EXAMPLES_BUFFERED = Gauge(
    "specmesh_online_examples_buffered", "served requests the learner keeps", ["set"]
)  # set: train | heldout
TRAIN_STEPS = Counter("specmesh_online_train_steps", "the learner's optimizer steps")
HELDOUT_ACCEPTANCE = Gauge(
    "specmesh_online_heldout_acceptance", "acceptance length on held-out traffic", ["version"]
)
LIVE_ACCEPTANCE = Gauge(
    "specmesh_online_live_acceptance", "acceptance length drafters measured", ["version"]
)
PUBLISHED_VERSIONS = Counter(
    "specmesh_online_published_versions", "versions announced", ["source"]
)  # source: trained | pushed
ROLLBACKS = Counter(
    "specmesh_online_rollbacks", "versions taken back (worse live acceptance, or refused)"
)
