"""Fixtures shared across the test suite."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

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


@pytest.fixture(scope="session")
def chat_reference(smollm_dir: Path) -> dict[str, str]:
    """The in-process engine's greedy text for each of deployment.CHATS, which deployments
    must give too (computed once for every module that compares). Imported here, where
    HF_HUB_OFFLINE is set."""
    from deployment import CHAT_TOKENS, CHATS
    from specmesh.shared.engine.engine import EngineConfig, LLMEngine
    from specmesh.shared.sampling.params import SamplingParams
    from specmesh.shared.tokenizer import Tokenizer

    tok = Tokenizer(smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    params = SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS)
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHATS]
    outs = engine.generate(ids, params)
    return {p: tok.decode(out) for p, out in zip(CHATS, outs, strict=True)}


def _has_vnni() -> bool:
    """Whether quant_linear runs on AVX-512 VNNI by default (it does where the CPU has it)."""
    from specmesh.kernels.cpu import load

    kernel = load()
    return kernel is not None and kernel.quant_vnni()


@pytest.fixture(
    params=[
        "avx2",
        pytest.param(
            "avx512-vnni",
            marks=pytest.mark.skipif(not _has_vnni(), reason="this CPU has no AVX-512 VNNI"),
        ),
    ]
)
def quant_kernel(request: pytest.FixtureRequest) -> Iterator[ModuleType]:
    """The compiled kernels with quant_linear on each of its instruction sets this CPU has."""
    from specmesh.kernels.cpu import load

    kernel = load()
    was = kernel.quant_vnni()
    kernel.quant_vnni(request.param == "avx512-vnni")
    yield kernel
    kernel.quant_vnni(was)
