"""A head version as it travels through the KV store: the checkpoint's weights file as one
blob, named by its sha256, and its config.json in the announcement.

The learner relays bytes; a drafter checks them (`write_head`) and then loads them like
any checkpoint, so nothing it has not checked is ever drafted with.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


def blob_sha256(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


def head_key(algorithm: str, sha256: str) -> str:
    """The store key of a blob: by content, so a key never names other bytes."""
    return f"head-{algorithm.lower()}-{sha256}"


def write_head(blob: bytes, sha256: str, config: str, path: Path) -> None:
    """A checkpoint directory at `path` from an announced version; ValueError (corrupt)
    when the bytes are not the announced ones."""
    if (actual := blob_sha256(blob)) != sha256:
        raise ValueError(f"corrupt: its weights' sha256 is {actual}, announced {sha256}")
    path.mkdir(parents=True, exist_ok=True)
    (path / WEIGHTS).write_bytes(blob)
    (path / CONFIG).write_text(config)
