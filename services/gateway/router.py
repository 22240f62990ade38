"""Which decode worker takes a request, and whether prefill computes its prompt.

`load`: the worker with the fewest requests (active + waiting + routed since its last
heartbeat), then the most free KV blocks.

`kv-aware` (the cost of Dynamo's KV router, in KV blocks): worker i costs

    w * new_i + used_i

where new_i is the number of the prompt's blocks i would compute (those past the prefix
its cache holds, known from its CacheEvents), used_i the blocks its requests hold: total
- free at its last heartbeat, plus the prompts' blocks of the requests this gateway
routed to it since, minus the blocks of those that finished since (a turn that just
ended on a worker holds nothing there any more, only cache), and w is
`--router-kv-overlap-weight`. The lowest cost wins, ties by load. A
worker whose cache holds most of the prompt computes the rest itself, skipping prefill
and the K/V transfer, when that rest is at most `--router-local-prefill-tokens`:
prefill's reuse goes through the KV store, which holds prompts, while decode caches also
hold what was generated (a conversation's next turn).
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.services.gateway.config import GatewayConfig

DEFAULT_BLOCK_SIZE = 16  # for a worker not heard from yet: used in the cost only


@dataclass
class Candidate:
    instance_id: str
    requests: int  # active + waiting + routed since its heartbeat
    blocks_free: int
    blocks_used: int  # by its requests, as estimated (see the module doc)
    block_size: int
    cached_tokens: int  # of this prompt, in its prefix cache


def load_key(c: Candidate) -> tuple[int, int]:
    return c.requests, -c.blocks_free


def kv_cost(c: Candidate, prompt_tokens: int, weight: float) -> float:
    new = -(-(prompt_tokens - c.cached_tokens) // c.block_size)
    return weight * new + c.blocks_used


def best(candidates: list[Candidate], prompt_tokens: int, cfg: GatewayConfig) -> Candidate:
    if cfg.router_policy == "load":
        return min(candidates, key=load_key)
    weight = cfg.router_kv_overlap_weight
    return min(candidates, key=lambda c: (kv_cost(c, prompt_tokens, weight), load_key(c)))


def computes_locally(c: Candidate, prompt_tokens: int, cfg: GatewayConfig) -> bool:
    """Whether the chosen worker computes the prompt itself (prefill skipped): its cache
    holds most of it, and the rest is short."""
    rest = prompt_tokens - c.cached_tokens
    kv_aware = cfg.router_policy == "kv-aware"
    return kv_aware and c.cached_tokens >= rest and rest <= cfg.router_local_prefill_tokens
