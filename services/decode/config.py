"""The decode service's own options (besides the engine's, speculation's and the KV
transport's)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.shared.config import option


@dataclass(frozen=True)
class DecodeConfig:
    overlap: bool = option(
        False,
        "keep two micro-batches in flight, one drafted while the other is verified: pays "
        "when drafters have their own device and drafting costs about what verifying does; "
        "on shared CPU cores it costs a forward pass per lane (benchmarks/bench_services.py). "
        "Works with every algorithm and any --speculative-eagle-topk (SGLang's overlap "
        "scheduler: topk 1 only); needs --speculative-algorithm",
    )
    draft_timeout: float = option(5.0, "seconds to wait for a drafter's trees")
    stream_interval: int = option(
        1, "tokens a request's output gathers before it is streamed on (larger: fewer messages)"
    )

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError("--stream-interval must be at least 1")
