"""The engine features the services split rests on, tested in one process:
prompts prefilled elsewhere (K/V through the transport), and overlapped drafting."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from helpers import GREEDY, PROMPTS
from specmesh.services.prefill.service import PrefillEngine
from specmesh.shared.core.sequence import RemotePrefix
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.engine import EngineConfig, FirstToken, LLMEngine
from specmesh.shared.kvcache.exchange import KVExchange, model_fingerprint
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest
from specmesh.shared.speculative.ngram import NgramDrafter
from specmesh.shared.tokenizer import Tokenizer
from specmesh.shared.transport import KVTransport
from specmesh.shared.transport.shm import ShmTransport


@pytest.fixture(scope="module")
def prompt_ids(smollm_dir: Path) -> list[list[int]]:
    tok = Tokenizer(smollm_dir)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:8]]


@pytest.fixture(scope="module")
def reference(smollm_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    return plain.generate(prompt_ids, GREEDY)


@pytest.fixture
def transport() -> Iterator[ShmTransport]:
    store = ShmTransport(f"test-{uuid.uuid4().hex[:8]}")
    yield store
    store.remove_all()


@pytest.fixture
def split(smollm_dir: Path, transport: ShmTransport) -> tuple[PrefillEngine, LLMEngine]:
    """A prefill engine and a decode engine sharing a KV transport."""
    cfg = EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25)
    prefill = PrefillEngine(cfg, transport, ttl_s=60)
    decode = LLMEngine(cfg)
    fingerprint = model_fingerprint(decode.model, decode.kv_cache)
    assert fingerprint == prefill.kv_exchange.fingerprint
    decode.kv_exchange = KVExchange(decode.kv_cache, transport, fingerprint, 60, "decode")
    return prefill, decode


def run_prefilled(
    split: tuple[PrefillEngine, LLMEngine],
    prompts: list[list[int]],
    params: SamplingParams,
    tamper: Callable[[KVTransport, list[str]], None] | None = None,
) -> list[list[int]]:
    """What the services do, in one process: prefill to the first token, then decode.
    `tamper` does what it likes to the stored blocks before decode loads them."""
    prefill, decode = split
    outputs: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        (first,) = prefill.generate([ids], dataclasses.replace(params, max_tokens=1))
        keys = prefill.handoff.popitem()[1]
        if tamper is not None:
            tamper(prefill.kv_exchange.transport, keys)
        first_token = FirstToken(first[0])
        emitted = decode.add_request(rid, ids, params, RemotePrefix(keys, len(ids)), first_token)
        outputs[rid] = [o.token_id for o in emitted]
    while decode.has_work():
        for out in decode.step():
            outputs[out.request_id].append(out.token_id)
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def test_prefilled_prompts_decode_exactly_like_local_ones(
    split: tuple[PrefillEngine, LLMEngine],
    prompt_ids: list[list[int]],
    reference: list[list[int]],
    transport: ShmTransport,
) -> None:
    assert run_prefilled(split, prompt_ids, GREEDY) == reference
    # Decode loaded every prompt and computed one token per step, nothing more.
    assert split[1].stats.computed_tokens == sum(len(out) - 1 for out in reference)
    assert transport.bytes_read >= transport.bytes_written > 0


def test_prefilled_seeded_sampling_matches_local(
    split: tuple[PrefillEngine, LLMEngine], prompt_ids: list[list[int]]
) -> None:
    # Draws are keyed by token position, so no generator state travels with the request.
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16)
    local = split[1].generate(prompt_ids[:3], params)
    assert run_prefilled(split, prompt_ids[:3], params) == local


def _rewrite_last(
    transport: KVTransport, keys: list[str], change: Callable[[bytes], bytes]
) -> None:
    (blob,) = transport.get_many(keys[-1:])
    transport.put_many({keys[-1]: change(blob)}, ttl_s=60)


TAMPERS = {
    "lost": lambda t, keys: t.delete_many(keys),
    "truncated": lambda t, keys: _rewrite_last(t, keys, lambda b: b[:-8]),
    "NaN": lambda t, keys: _rewrite_last(
        t, keys, lambda b: b[:-4] + torch.tensor([float("nan")]).numpy().tobytes()
    ),
}


@pytest.mark.parametrize("tamper", TAMPERS)
def test_missing_or_bad_blocks_are_computed_instead(
    split: tuple[PrefillEngine, LLMEngine],
    prompt_ids: list[list[int]],
    reference: list[list[int]],
    tamper: str,
) -> None:
    assert run_prefilled(split, prompt_ids[:2], GREEDY, TAMPERS[tamper]) == reference[:2]
    assert split[1].stats.computed_tokens > sum(map(len, prompt_ids[:2]))


class SlowNgramDrafter(NgramDrafter):
    """An n-gram drafter that answers from another thread after DELAY seconds, like a
    drafter service: `submit` returns before the trees exist."""

    DELAY = 0.02

    def __init__(self, cfg: SpeculativeConfig) -> None:
        super().__init__(cfg)
        self.pool = ThreadPoolExecutor(1)
        self.calls = 0

    def submit(self, requests: list[DraftRequest]) -> Future[list[DraftTree]]:
        self.calls += 1

        def later() -> list[DraftTree]:
            time.sleep(self.DELAY)
            return self.propose(requests)

        return self.pool.submit(later)


@pytest.mark.parametrize("overlap", [False, True])
def test_overlapped_drafting_is_lossless_and_hides_draft_time(
    smollm_dir: Path, prompt_ids: list[list[int]], reference: list[list[int]], overlap: bool
) -> None:
    spec = SpeculativeConfig(speculative_algorithm="NGRAM").resolved()
    drafter = SlowNgramDrafter(spec)
    cfg = EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25)
    engine = LLMEngine(cfg, spec, drafter, overlap=overlap)
    assert engine.generate(prompt_ids, GREEDY) == reference
    assert engine.speculator.stats.accepted_tokens > 0
    # Without overlap every draft is waited for; with it, the other lane's forward
    # runs meanwhile and most of the drafting time is hidden.
    waited = engine.stats.draft_wait_seconds / (drafter.calls * drafter.DELAY)
    assert (waited < 0.5) if overlap else (waited > 0.9)
    # Aborting requests while their drafts are in flight leaves nothing behind.
    for i, ids in enumerate(prompt_ids):
        engine.add_request(f"a{i}", ids, GREEDY)
    for _ in range(3):
        engine.step()
    for i in range(len(prompt_ids)):
        engine.abort(f"a{i}")
    while engine.has_work():
        engine.step()
    assert engine.block_manager.num_free == engine.kv_cache.num_blocks
    assert not drafter.requests
