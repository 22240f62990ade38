"""OpenAI `image_url` parts: only inline `data:image/...;base64,` URLs (nothing is ever
downloaded). Every refusal is a ValueError whose message the client sees."""

from __future__ import annotations

import base64
import binascii

DEFAULT_MAX_IMAGE_BYTES = 8 * 1024 * 1024  # an encoded image (PNG, JPEG, WebP)
# What a chat message's image part becomes in the template's text: Pixtral's image token,
# which the tokenizer service then expands into the image's tokens, as its processor does.
IMAGE_PLACEHOLDER = "[IMG]"


def image_bytes(url: str, max_bytes: int = DEFAULT_MAX_IMAGE_BYTES) -> bytes:
    """The encoded image a data URL carries."""
    if url.startswith(("http://", "https://")):
        raise ValueError("image URLs are not fetched: send the image inline as a base64 data URL")
    head, comma, payload = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64") or not comma:
        raise ValueError("image_url must be a data:image/...;base64,<data> URL")
    if len(payload) * 3 // 4 > max_bytes:  # before decoding: no allocation for a huge one
        raise ValueError(f"the image is over the limit of {max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"the image's base64 data is malformed: {exc}") from exc
