"""KV-aware routing's parts alone: the prefix cache's events, the gateway's index of
them, and the router's choice. The deployment is tested in test_services.py."""

from __future__ import annotations

import random

import pytest
from specmesh.services.gateway.cache_index import CacheIndex, WorkerCache
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.gateway.router import Candidate, best, computes_locally
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.kvcache.block_manager import BlockManager
from specmesh.shared.kvcache.events import CacheEventLog
from specmesh.shared.sampling.params import SamplingParams

pytestmark = pytest.mark.unit

BLOCK = 4


def test_event_batches_follow_the_prefix_cache_keys() -> None:
    """Whatever requests come and go, and batches taken at any moment, the batches applied
    in order rebuild exactly the cache's keys; a snapshot plus the batches from its next
    number on does too."""
    rng = random.Random(0)
    manager = BlockManager(num_blocks=12, block_size=BLOCK)
    manager.events = events = CacheEventLog()
    held: set[int] = set()
    snapshot: tuple[int, set[int]] | None = None
    running: list[Sequence] = []
    for step in range(400):
        if running and (len(running) > 2 or rng.random() < 0.4):
            manager.free(running.pop(rng.randrange(len(running))))
        else:
            prefix = [rng.randrange(3) for _ in range(rng.choice([4, 8]))]
            s = Sequence(
                f"r{step}", prefix + [rng.randrange(50) for _ in range(6)], SamplingParams()
            )
            if manager.can_allocate(s):
                manager.allocate(s)
                before, s.num_computed_tokens = s.num_computed_tokens, len(s)
                manager.seal(s, before)
                running.append(s)
        if step == 150:
            manager.flush()
        if step % 7 == 0 and (batch := events.take()) is not None:
            held.update(batch.stored)
            held.difference_update(batch.removed)
            if snapshot is not None and batch.seq >= snapshot[0]:
                snapshot[1].update(batch.stored)
                snapshot[1].difference_update(batch.removed)
            assert held == set(manager.hash_to_block)
        if step == 100:
            next_seq, keys = events.snapshot(manager.hash_to_block.keys)
            snapshot = (next_seq, set(keys))
    assert snapshot is not None and snapshot[1] == held


def test_the_index_counts_leading_cached_blocks_never_the_last_token() -> None:
    from specmesh.shared.kvcache.block_manager import block_hash

    prompt = list(range(13))  # 3 whole blocks and one token
    chain, prev = [], None
    for start in range(0, 12, BLOCK):
        prev = block_hash(prompt[start : start + BLOCK], prev)
        chain.append(prev)
    index = CacheIndex(bus=None)  # type: ignore[arg-type]  # no messages in this test
    index.workers["all"] = WorkerCache("i", BLOCK, 0, set(chain))
    index.workers["first"] = WorkerCache("i", BLOCK, 0, {chain[0], chain[2]})
    index.workers["none"] = WorkerCache("i", BLOCK, 0, {chain[1]})
    assert index.cached_tokens(prompt) == {"all": 12, "first": 4, "none": 0}
    assert index.cached_tokens(prompt[:12])["all"] == 8  # its last token is computed


def candidate(name: str, cached: int, used: int, requests: int = 1) -> Candidate:
    return Candidate(name, requests, 100 - used, used, 16, cached)


def test_the_router_trades_overlap_against_load() -> None:
    cfg = GatewayConfig()
    holder, other = candidate("holder", 160, used=15), candidate("other", 0, used=10)
    assert best([holder, other], 200, cfg).instance_id == "holder"  # 10 blocks saved > 5 used
    busy = candidate("holder", 160, used=40)
    assert best([busy, other], 200, cfg).instance_id == "other"
    load_only = GatewayConfig(router_policy="load")
    assert best([holder, candidate("other", 0, 10, requests=0)], 200, load_only).instance_id == (
        "other"
    )
    assert computes_locally(holder, 200, cfg)  # 40 tokens left to compute
    assert not computes_locally(holder, 200, GatewayConfig(router_local_prefill_tokens=16))
    assert not computes_locally(other, 200, cfg)
    assert not computes_locally(candidate("start", 96, used=0), 200, cfg)  # not most of it
    assert not computes_locally(holder, 200, load_only)
