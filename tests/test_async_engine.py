"""The background-thread driver the server uses: streaming, concurrency, abort."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from specmesh.shared.engine.async_engine import AsyncEngine
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.sampling.params import SamplingParams

PROMPTS = [[1, 9690, 198, 30] + [100 + i] * (i + 1) for i in range(4)]


@pytest.fixture(scope="module")
def engine(smollm_dir: Path) -> Iterator[AsyncEngine]:
    driver = AsyncEngine(LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.1)))
    yield driver
    driver.shutdown()


async def collect(engine: AsyncEngine, rid: str, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [out.token_id async for step in engine.generate(rid, ids, params) for out in step]


def test_concurrent_streams_match_offline_generation(engine: AsyncEngine, smollm_dir: Path) -> None:
    async def main() -> list[list[int]]:
        tasks = [collect(engine, f"c{i}", ids, 6 + 2 * i) for i, ids in enumerate(PROMPTS)]
        return await asyncio.gather(*tasks)

    streamed = asyncio.run(main())
    # A separate engine: the driver's thread owns its engine, nobody else may step it.
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.05))
    offline = [
        plain.generate([ids], SamplingParams(temperature=0, max_tokens=6 + 2 * i))[0]
        for i, ids in enumerate(PROMPTS)
    ]
    assert streamed == offline


def test_leaving_a_stream_early_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    free = engine.engine.block_manager.num_free

    async def main() -> None:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        stream = engine.generate("leaver", PROMPTS[0], params)
        async for _ in stream:
            break  # like a client that disconnects after the first token
        await stream.aclose()

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while engine.engine.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.engine.has_work()
    assert engine.engine.block_manager.num_free == free


def test_invalid_request_raises_before_streaming(engine: AsyncEngine) -> None:
    async def main() -> None:
        await collect(engine, "bad", [], 4)

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(main())
    assert asyncio.run(collect(engine, "after-bad", PROMPTS[1], 3))  # still serving


def test_a_sequence_that_fails_its_step_fails_alone(engine: AsyncEngine) -> None:
    """A sequence whose sampling blows up (here: a top_k no validation would pass, set
    behind the engine's back) fails itself; the others in its steps go on unchanged."""
    reference = [asyncio.run(collect(engine, f"ref{i}", ids, 8)) for i, ids in enumerate(PROMPTS)]
    inner = engine.engine

    async def poisoned(rid: str, ids: list[int]) -> list[int]:
        params = SamplingParams(temperature=0.7, max_tokens=8, ignore_eos=True)
        tokens = []
        async for step in engine.generate(rid, ids, params):
            params.top_k = 2**63 + 5  # once admitted: it overflows the sampler's tensor
            tokens += [out.token_id for out in step]
        return tokens

    async def main() -> list[list[int] | BaseException]:
        tasks = [collect(engine, f"ok{i}", ids, 8) for i, ids in enumerate(PROMPTS)]
        tasks.insert(2, poisoned("poisoned", PROMPTS[0]))
        return await asyncio.gather(*tasks, return_exceptions=True)

    free = inner.block_manager.num_free
    results = asyncio.run(main())
    failure = results.pop(2)
    assert isinstance(failure, RuntimeError) and "engine step failed" in str(failure)
    assert results == reference
    assert "poisoned" not in inner.sequences and inner.block_manager.num_free == free
