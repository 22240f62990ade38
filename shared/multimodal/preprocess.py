"""Images as Pixtral's processor prepares them: decoded (PNG, JPEG, WebP via Pillow), RGB,
shrunk to fit `longest_edge` keeping the aspect ratio, then each side rounded up to a
multiple of the merged patch (bicubic). Rescaling and normalizing are left to the encoder
(shared.model.mistral3), so the image travels as uint8."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from specmesh.shared.core.images import PromptImage

DEFAULT_MAX_IMAGE_PIXELS = 16_000_000  # a decoded image's width x height, before resizing
# Pixtral's processor defaults (preprocessor_config.json overrides them).
PIXTRAL_MEAN = (0.48145466, 0.4578275, 0.40821073)
PIXTRAL_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ImageProcessing:
    longest_edge: int
    token_side: int  # pixels per image token along each side (patch x spatial merge)
    mean: tuple[float, float, float] = PIXTRAL_MEAN
    std: tuple[float, float, float] = PIXTRAL_STD
    rescale: float = 1 / 255

    @classmethod
    def from_model_dir(cls, model_dir: Path, token_side: int) -> ImageProcessing:
        """preprocessor_config.json's settings, the processor's defaults where it has none."""
        path = model_dir / "preprocessor_config.json"
        cfg = json.loads(path.read_text()) if path.exists() else {}
        return cls(
            longest_edge=(cfg.get("size") or {}).get("longest_edge", 1024),
            token_side=token_side,
            mean=tuple(cfg.get("image_mean", PIXTRAL_MEAN)),
            std=tuple(cfg.get("image_std", PIXTRAL_STD)),
            rescale=cfg.get("rescale_factor", 1 / 255),
        )

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) after resizing, as transformers' get_resize_output_image_size."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:  # floor: never over longest_edge before rounding up to the token side
            height, width = math.floor(height / ratio), math.floor(width / ratio)
        side = self.token_side
        return (height - 1) // side * side + side, (width - 1) // side * side + side

    def prepare(self, data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> PromptImage:
        """An encoded image as the encoder's input; ValueError if it cannot be one."""
        image = decode_image(data, max_pixels)
        height, width = self.resized_size(image.height, image.width)
        resized = image.resize((width, height), Image.Resampling.BICUBIC)
        pixels = torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy()).permute(2, 0, 1)
        return PromptImage(pixels.contiguous(), self.mean, self.std, self.rescale)


def decode_image(data: bytes, max_pixels: int) -> Image.Image:
    """The RGB image `data` encodes; ValueError for anything Pillow cannot read or an image
    over `max_pixels` (checked from its header, before the pixels are decoded)."""
    try:
        image = Image.open(io.BytesIO(data))
        if image.width * image.height > max_pixels:
            raise ValueError(
                f"the image is {image.width}x{image.height} pixels, over the limit of "
                f"{max_pixels} pixels"
            )
        return image.convert("RGB")
    except (OSError, Image.DecompressionBombError, SyntaxError) as exc:
        raise ValueError(f"the image cannot be decoded: {exc}") from exc


def image_token_ids(image: PromptImage, token_side: int, ids: tuple[int, int, int]) -> list[int]:
    """The tokens standing for an image, as Pixtral's processor lays them: `[IMG]` per image
    token, `[IMG_BREAK]` after each row, `[IMG_END]` in place of the last break.
    ids: the ([IMG], [IMG_BREAK], [IMG_END]) token ids."""
    image_id, break_id, end_id = ids
    _, height, width = image.pixels.shape
    rows, cols = height // token_side, width // token_side
    tokens = ([image_id] * cols + [break_id]) * rows
    tokens[-1] = end_id
    return tokens
