"""Fixtures shared across the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.model.fetch import fetch_default_model

# Nothing may come from a model hub; set before any test module imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory in the default cache (fetched once, then reused)."""
    return fetch_default_model()
