"""A prompt's images as the engine carries them: resized pixels, where their tokens sit,
and what makes cached K/V after them differ from the same tokens with other images."""

from __future__ import annotations

import functools
import hashlib
from bisect import bisect_left
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PromptImage:
    """One image, resized as the processor does; rescaling and normalizing happen on the
    encoder's device (uint8 pixels are a quarter of float32's bytes on the wire)."""

    pixels: torch.Tensor  # [3, H, W] uint8, H and W multiples of the merged patch side
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float  # 1/255: pixel values to [0, 1] before normalizing

    @functools.cached_property
    def digest(self) -> bytes:
        """Identifies the encoder's input: shape, pixels and normalization."""
        h = hashlib.blake2b(digest_size=16)
        h.update(repr((tuple(self.pixels.shape), self.mean, self.std, self.rescale)).encode())
        h.update(self.pixels.contiguous().numpy().tobytes())
        return h.digest()


@dataclass
class PromptImages:
    """Images of one prompt. Row i of their features (image after image) replaces the
    embedding of prompt position `positions[i]`."""

    images: list[PromptImage]
    positions: list[int]  # sorted prompt positions of the image tokens
    starts: list[int]  # each image's first position
    digests: list[bytes] = field(init=False)
    # The encoder's output [len(positions), hidden] while the prompt's prefill needs it.
    features: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.digests = [image.digest for image in self.images]

    @property
    def end(self) -> int:
        """One past the last image token: prefill beyond it needs no features."""
        return self.positions[-1] + 1

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The feature rows [lo, hi) whose positions are in [start, end)."""
        return bisect_left(self.positions, start), bisect_left(self.positions, end)

    def salt(self, start: int, end: int) -> bytes:
        """The digests of the images that begin in positions [start, end): mixed into that
        block's hash, so (hashes being chained) it and every later block differ by image."""
        return b"".join(
            d for d, s in zip(self.digests, self.starts, strict=True) if start <= s < end
        )
