"""The gateway's options (CLI flags and SPECMESH_* environment variables)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.shared.config import model_name_of, model_option, option, secret_option
from specmesh.shared.parsers.reasoning import REASONING_PARSERS
from specmesh.shared.parsers.tools import TOOL_PARSERS

ROUTER_POLICIES = ("load", "kv-aware")  # services/gateway/router.py


@dataclass(frozen=True)
class GatewayConfig:
    host: str = option("127.0.0.1", "HTTP address to listen on")
    port: int = option(8000, "HTTP port")
    model: str | None = model_option()  # the gateway only needs its name
    served_model_name: str | None = option(None, "model id in the API (default: from --model)")
    api_key: str | None = secret_option(
        "require `Authorization: Bearer <key>` everywhere but /health and /metrics"
    )
    tool_call_parser: str | None = option(
        None, "the model's tool call format", choices=sorted(TOOL_PARSERS)
    )
    reasoning_parser: str | None = option(
        None, "split reasoning into reasoning_content", choices=sorted(REASONING_PARSERS)
    )
    max_pending_requests: int = option(
        256, "sequences in flight at this gateway before new requests get 429"
    )
    max_request_bytes: int = option(4 << 20, "larger request bodies get 413")
    header_timeout: float = option(
        10.0, "seconds a connection may take to send its request headers before it is closed"
    )
    instance_timeout: float = option(3.0, "seconds without a heartbeat before an instance is gone")
    request_timeout: float = option(120.0, "seconds a prefill may take, queueing included")
    request_idle_timeout: float = option(
        60.0, "seconds an admitted request may go without output before it fails"
    )
    router_policy: str = option(
        "kv-aware",
        "how a request picks its decode worker: load, or kv-aware (load and prefix-cache overlap)",
        choices=ROUTER_POLICIES,
    )
    router_kv_overlap_weight: float = option(
        1.0, "kv-aware: the cost of a prompt block to compute, against a KV block in use"
    )
    router_local_prefill_tokens: int = option(
        256,
        "kv-aware: a decode worker whose prefix cache holds most of a prompt computes the "
        "rest itself, without prefill, when it is at most this many tokens (0: never)",
    )

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        return model_name_of(self.model)
