"""The tokenizer service's options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specmesh.shared.config import model_option, option
from specmesh.shared.multimodal.preprocess import DEFAULT_MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class TokenizerConfig:
    model: str | None = model_option()
    chat_template: str | None = option(
        None, "a Jinja chat template file to use instead of the model's own"
    )
    max_image_pixels: int = option(
        DEFAULT_MAX_IMAGE_PIXELS, "larger images (decoded width x height) get 400"
    )

    def __post_init__(self) -> None:
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"--chat-template {self.chat_template}: no such file")
