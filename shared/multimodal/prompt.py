"""The tokenizer's part of image input: each image placeholder of a rendered chat becomes
the image's tokens, and the image its encoder input."""

from __future__ import annotations

import json
from pathlib import Path

from specmesh.shared.core.images import PromptImage
from specmesh.shared.model.vision_config import VisionConfig
from specmesh.shared.multimodal.data_url import IMAGE_PLACEHOLDER
from specmesh.shared.multimodal.preprocess import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageProcessing,
    image_token_ids,
)
from specmesh.shared.tokenizer import Tokenizer

LAYOUT_TOKENS = (IMAGE_PLACEHOLDER, "[IMG_BREAK]", "[IMG_END]")
# The resized pixels of one prompt's images, together: they ride in one NATS message
# (8 MiB at most) to prefill.
MAX_PROMPT_PIXEL_BYTES = 6 * 1024 * 1024


class ImagePrompts:
    def __init__(
        self, model_dir: Path, tokenizer: Tokenizer, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    ) -> None:
        """`max_pixels`: the largest decoded image (width x height) accepted."""
        cfg = json.loads((model_dir / "config.json").read_text())
        self.max_pixels = max_pixels
        self.processing: ImageProcessing | None = None
        ids = [tokenizer.backend.token_to_id(t) for t in LAYOUT_TOKENS]
        if "vision_config" in cfg and None not in ids:
            side = VisionConfig.from_hf(cfg).token_side
            self.processing = ImageProcessing.from_model_dir(model_dir, side)
        self.layout_ids = tuple(ids)

    def expand(self, ids: list[int], images: list[bytes]) -> tuple[list[int], list[PromptImage]]:
        """The prompt with each placeholder token replaced by its image's tokens, and the
        images prepared; ValueError if the model takes no images or they do not fit."""
        if self.processing is None:
            raise ValueError("this model does not take image input (it has no vision encoder)")
        prepared = [self.processing.prepare(data, self.max_pixels) for data in images]
        if sum(image.pixels.numel() for image in prepared) > MAX_PROMPT_PIXEL_BYTES:
            raise ValueError("the images are too large together: send fewer or smaller ones")
        placeholder = self.layout_ids[0]
        if ids.count(placeholder) != len(images):
            raise ValueError(
                f"the messages hold {len(images)} images but {ids.count(placeholder)} "
                f"{IMAGE_PLACEHOLDER} tokens"
            )
        out, side, images_left = [], self.processing.token_side, iter(prepared)
        for token in ids:
            if token == placeholder:
                out += image_token_ids(next(images_left), side, self.layout_ids)
            else:
                out.append(token)
        return out, prepared
