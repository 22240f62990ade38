"""PromptImage <-> the protocol's ImageData."""

from __future__ import annotations

import torch
from specmesh.shared.core.images import PromptImage
from specmesh.shared.protocol import ImageData


def to_wire(image: PromptImage) -> ImageData:
    _, height, width = image.pixels.shape
    return ImageData(
        pixels=image.pixels.contiguous().numpy().tobytes(),
        height=height,
        width=width,
        mean=list(image.mean),
        std=list(image.std),
        rescale=image.rescale,
    )


def from_wire(data: ImageData) -> PromptImage:
    """ValueError if the fields do not make an RGB image."""
    if len(data.pixels) != 3 * data.height * data.width or not data.height * data.width:
        raise ValueError(f"image data is not 3 x {data.height} x {data.width} bytes")
    if len(data.mean) != 3 or len(data.std) != 3:
        raise ValueError("image mean and std need one value per channel")
    pixels = torch.frombuffer(bytearray(data.pixels), dtype=torch.uint8)
    shape = (3, data.height, data.width)
    return PromptImage(pixels.view(shape), tuple(data.mean), tuple(data.std), data.rescale)


def images_from_wire(images: list[ImageData] | None) -> list[PromptImage] | None:
    return None if images is None else [from_wire(image) for image in images]
