"""The drafter interface every algorithm implements (`factory.py` picks one).

A drafter keeps per-request state. Each decode step the engine tells it which
tokens were accepted since the last step and how many draft nodes it may spend,
and gets back one draft tree per request, rooted at the request's last token.
The calls are batched so that a drafter in another process costs one message
per step, and a model-based drafter can run one forward for all requests.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from specmesh.shared.core.tree import DraftTree


@dataclass
class DraftRequest:
    request_id: str
    new_tokens: list[int]  # accepted since the last call (the last one is the tree's root)
    max_drafts: int  # draft nodes allowed, root excluded
    # EAGLE: target features of the positions from `feature_position` on, up to the one
    # before the last token (None for other drafters).
    features: torch.Tensor | None = None
    feature_position: int = 0


class Drafter(Protocol):
    # Target layers whose outputs the drafter reads, and whether the one is final-normed.
    target_features: tuple[tuple[int, ...], bool]

    def open(self, request_id: str, prompt_ids: list[int]) -> None: ...

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]: ...

    def submit(self, requests: list[DraftRequest]) -> Future[list[DraftTree]]:
        """Start `propose`; a drafter in another process returns before the trees exist,
        so the caller can verify other sequences meanwhile."""
        ...

    def close(self, request_id: str) -> None: ...


@runtime_checkable
class SwappableDrafter(Drafter, Protocol):
    """A model drafter whose weights a new version replaces while it serves (learning
    online: EAGLE's, DFLASH's and STANDALONE's)."""

    def prepared(self, path: Path) -> Any:
        """The checkpoint at `path`, loaded and checked to take the current weights' place
        (on any thread); ValueError if it does not fit this drafter."""
        ...

    def use(self, prepared: Any) -> None:
        """Draft with what `prepared` returned from the next call on, on the thread that
        drafts; nothing the old weights computed is read again by a later request."""
        ...


class LocalDrafter(abc.ABC):
    """Base of drafters in the caller's process: drafting is done when `submit` returns."""

    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]: ...

    def submit(self, requests: list[DraftRequest]) -> Future[list[DraftTree]]:
        done: Future[list[DraftTree]] = Future()
        done.set_result(self.propose(requests))
        return done


def target_feature_layers(algorithm: str, num_layers: int) -> tuple[tuple[int, ...], bool]:
    """Target layers whose outputs an EAGLE head reads, and whether the one is final-normed:
    EAGLE and NEXTN read the final normed hidden state, EAGLE-3 layers 1, L/2-1 and L-4."""
    if algorithm == "EAGLE3":
        return (1, num_layers // 2 - 1, num_layers - 4), False
    if algorithm in ("EAGLE", "NEXTN"):
        return (num_layers - 1,), True
    return (), False
