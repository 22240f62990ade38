"""Fixtures shared across the test suite."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from specmesh.kernels.check.suite import device
from specmesh.shared.model.fetch import fetch_default_model

# Nothing may come from a model hub; set before any test module imports transformers.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton picks its interpreter or its compiler once, when triton.language is first imported,
# which importing transformers does while tests are collected: without a GPU, pick the
# interpreter (what the Triton kernel tests run on) before any test module is imported.
device()


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory in the default cache (fetched once, then reused)."""
    return fetch_default_model()
