"""The drafter service's own options (besides speculation's)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import model_option, option


@dataclass
class DrafterConfig:
    model: str | None = model_option()  # the target: EAGLE heads use its embeddings and head
    device: str | None = option(None, "cpu, cuda, cuda:N (default: cuda when available)")
    dtype: str | None = option(None, "float32, bfloat16, float16 (default: fp32 CPU, bf16 GPU)")
