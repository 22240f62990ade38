"""The prefill service's own options (besides the engine's, speculation's and the KV
transport's)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.shared.config import option


@dataclass(frozen=True)
class PrefillConfig:
    max_queued_requests: int = option(
        512,
        "prompts in flight at one prefill instance (queued or computing) before new ones "
        "are refused with 503, so an overload is answered at once instead of by timeouts",
    )
