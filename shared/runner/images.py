"""Image features for the rows of an engine step: which batch rows are image tokens, and
the encoder's output for them (computed once per prompt, kept until its prefill passes
the last image token, so a chunked prefill that splits an image encodes it once)."""

from __future__ import annotations

import torch
from specmesh.shared.core.images import PromptImage, PromptImages
from specmesh.shared.core.sequence import Sequence
from torch import nn


def place_images(
    model: nn.Module, prompt_ids: list[int], images: list[PromptImage]
) -> PromptImages:
    """The prompt's image tokens matched to its images; ValueError if they do not match
    (a model without an image encoder, or a token count the images do not make)."""
    vision = getattr(model, "vision", None)
    if vision is None:
        raise ValueError("this model takes no images (it has no vision encoder)")
    token = vision.config.image_token_id
    positions = [i for i, t in enumerate(prompt_ids) if t == token]
    counts = [vision.tokens_for(image) for image in images]
    if not images or len(positions) != sum(counts):
        raise ValueError(
            f"the prompt has {len(positions)} image tokens; its {len(images)} images make "
            f"{sum(counts)}"
        )
    starts, first = [], 0
    for count in counts:
        starts.append(positions[first])
        first += count
    return PromptImages(images, positions, starts)


def step_embeds(
    model: nn.Module, seq: Sequence, start: int, num: int, first_row: int
) -> tuple[list[int], torch.Tensor] | None:
    """(batch rows, features) for `seq`'s image tokens among its positions
    [start, start + num), which sit at batch rows first_row.. ; None: no image token there."""
    images = seq.images
    if images is None or start >= images.end:
        return None
    lo, hi = images.rows_in(start, start + num)
    if lo == hi:
        return None
    if images.features is None:
        images.features = model.vision.encode(images.images)
    rows = [first_row + p - start for p in images.positions[lo:hi]]
    features = images.features[lo:hi]
    if start + num >= images.end:  # no later chunk needs them (a rerun encodes again)
        images.features = None
    return rows, features
