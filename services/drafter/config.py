"""The drafter service's own options (besides speculation's)."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.shared.config import device_option, dtype_option, model_option


@dataclass(frozen=True)
class DrafterConfig:
    model: str | None = model_option()  # the target: EAGLE heads use its embeddings and head
    device: str | None = device_option()
    dtype: str | None = dtype_option()
