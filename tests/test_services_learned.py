"""The learned drafters that ship for the default model, over the five services.

Apart from test_services.py so that its deployments are gone before these start: each
deployment holds the model in five processes, and a test machine holds only so many.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deployment import CHAT_GREEDY, CHATS, chat, chat_text, specmesh_up
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.infra import start_nats
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer

SERVED = CHATS[:3]  # compared with the engine's text
FRESH = CHATS[3:7]  # sent once each: prefill's path


@pytest.fixture(scope="module", params=["EAGLE3", "NEXTN", "DFLASH", "STANDALONE"])
def learned(smollm_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """A learned drafter that ships for the default model (the EAGLE-3 head, the NEXTN
    layer, the DFLASH block draft, the STANDALONE draft LM): the prompt's target features,
    for those that read them, travel from prefill with its K/V, then with each draft step.
    Fixed draft budgets, so that drafts do not depend on timings (adaptive budgets follow
    measured costs). (HTTP url, algorithm)"""
    args = ["--speculative-algorithm", request.param, "--no-speculative-adaptive"]
    with start_nats() as bus, specmesh_up(smollm_dir, "--nats-url", bus.url, *args) as url:
        yield url, request.param


def test_learned_drafters_over_the_services_are_lossless(
    learned: tuple[str, str], chat_reference: dict[str, str]
) -> None:
    url, algorithm = learned
    for prompt in SERVED:
        assert chat_text(url, prompt, **CHAT_GREEDY) == chat_reference[prompt]
    state = httpx.get(f"{url}/get_server_info").json()["internal_states"][0]
    assert state["speculative_algorithm"] == algorithm and state["spec_draft_tokens"] > 0


def test_prompt_features_reach_the_drafter(learned: tuple[str, str], smollm_dir: Path) -> None:
    """The head is warm at the first decode step over the services as in one process:
    the same verify steps and accepted drafts over each request's first 16 tokens."""
    url, algorithm = learned
    tok = Tokenizer(smollm_dir)
    spec = SpeculativeConfig(speculative_algorithm=algorithm, speculative_adaptive=False)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for prompt in FRESH:
        # A fresh engine: its prefix cache would start the head after a cached prefix, while
        # over the services the cached prefix's features come from the transport.
        engine = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25), spec)
        engine.generate([tok.encode_chat([{"role": "user", "content": prompt}])], params)
        stats = engine.speculator.stats
        local = (stats.steps, stats.accepted_tokens)
        body = chat(url, prompt, temperature=0, max_tokens=16).json()
        remote = body["metrics"]["speculative_decoding"]
        assert (remote["num_spec_steps"], remote["num_accepted_draft_tokens"]) == local, prompt
