"""A request as the engine tracks it: its tokens, KV blocks and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.shared.core.images import PromptImages
from specmesh.shared.sampling.params import SamplingParams

if TYPE_CHECKING:  # the grammar module builds on core types
    from specmesh.shared.sampling.grammar import GrammarMatcher


@dataclass
class RemotePrefix:
    """K/V of a sequence's first `num_tokens` tokens, in the KV transport under `keys`
    (one per block, the last one possibly partial); `source`: the direct store holding
    them, None for the shared one."""

    keys: list[str]
    num_tokens: int
    source: str | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = field(init=False)
    # Tokens whose K/V are in the cache. The step after reaching len(self)-1 samples.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    num_reused_tokens: int = 0  # prompt tokens taken from the prefix cache
    lane: int = 0  # overlapped speculation: which of the two alternating batches
    # K/V of a prefix computed elsewhere (prefill service), loaded instead of computed.
    remote_kv: RemotePrefix | None = None
    grammar: GrammarMatcher | None = None  # where its output is in `params.grammar`
    images: PromptImages | None = None  # the prompt's images (Mistral3), with their tokens
    # What its K/V depends on besides its tokens and images (mixed into the first block's
    # hash, so into every later one's): a drafter's sequence, the context before it.
    cache_salt: bytes = b""

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self) - self.num_computed_tokens
