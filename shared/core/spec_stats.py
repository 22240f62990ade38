"""Speculation totals: kept by the engine per request and in all, carried as they are
to the gateway (a msgspec struct, so the same type is the message field)."""

from __future__ import annotations

from typing import Annotated

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]


class SpecStats(msgspec.Struct, kw_only=True):
    steps: Count = 0  # verification steps
    draft_tokens: Count = 0  # draft nodes verified
    accepted_tokens: Count = 0  # draft tokens accepted

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus token)."""
        return 1.0 + self.accepted_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """The share of verified draft tokens that were accepted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def add(self, drafts: int, accepted: int) -> None:
        self.steps += 1
        self.draft_tokens += drafts
        self.accepted_tokens += accepted

    def __add__(self, other: SpecStats) -> SpecStats:
        return SpecStats(
            steps=self.steps + other.steps,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_tokens=self.accepted_tokens + other.accepted_tokens,
        )

    def since(self, earlier: SpecStats) -> SpecStats:
        """What these running totals gained after `earlier`, a copy of them."""
        return SpecStats(
            steps=self.steps - earlier.steps,
            draft_tokens=self.draft_tokens - earlier.draft_tokens,
            accepted_tokens=self.accepted_tokens - earlier.accepted_tokens,
        )
