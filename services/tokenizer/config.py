"""The tokenizer service's options."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import model_option


@dataclass
class TokenizerConfig:
    model: str | None = model_option()
