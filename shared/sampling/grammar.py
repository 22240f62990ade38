"""Grammar-constrained decoding, with llguidance.

A request's `Grammar` is compiled once per distinct grammar (`GrammarCompiler`: an LRU
cache of llguidance grammars, each validated against the model's vocabulary in a child
process under time and size limits, so a bad, huge or slow grammar is a ValueError before
anything runs). Each sequence gets
a `GrammarMatcher` that follows the tokens it emits and says which may come next: a mask
over the vocabulary (llguidance's bitmask, a bit per token), applied to the logits before
sampling. For a draft tree,
`masks_after` gives the mask after every node's path, so verification never accepts a
draft the grammar forbids and the bonus token is drawn from the masked distribution:
constrained output is the same with speculation as without.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import llguidance as llg
import llguidance.torch as llg_torch
import torch
from specmesh.shared.sampling.grammar_worker import (
    COMPILE_TIMEOUT_S,
    GrammarWorker,
    limits,
    read_tokenizer,
)
from specmesh.shared.sampling.params import Grammar

CACHE_SIZE = 256  # grammars kept, compiled or refused


class GrammarCompiler:
    """The model's vocabulary as llguidance sees it, and the grammars compiled for it
    (in a child process, grammar_worker.py), each remembered with its error if refused."""

    def __init__(
        self,
        tokenizer_json: Path,
        vocab_size: int,
        eos_token_ids: list[int],
        timeout_s: float = COMPILE_TIMEOUT_S,
    ) -> None:
        if not tokenizer_json.is_file():
            raise ValueError(f"constrained decoding needs the model's {tokenizer_json.name}")
        self.vocab_size = vocab_size
        self.tokenizer = read_tokenizer(tokenizer_json, vocab_size, eos_token_ids)
        self.worker = GrammarWorker(tokenizer_json, vocab_size, eos_token_ids, timeout_s)
        self._compiled: OrderedDict[Grammar, str | ValueError] = OrderedDict()
        self._lock = threading.Lock()  # services check requests off the engine's thread

    def compile(self, grammar: Grammar) -> str:
        """The validated llguidance grammar; ValueError says what is wrong with it."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is None:
            try:
                compiled = self.worker.compile(grammar)
            except ValueError as exc:
                compiled = exc
            with self._lock:
                self._compiled[grammar] = compiled
                if len(self._compiled) > CACHE_SIZE:
                    self._compiled.popitem(last=False)
        if isinstance(compiled, ValueError):
            raise ValueError(str(compiled))
        return compiled

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        return GrammarMatcher(self, self.compile(grammar))

    def start(self) -> None:
        """Start compiling's process now, not at the first grammar (services do)."""
        self.worker.start()


class GrammarMatcher:
    """One sequence's place in its grammar."""

    def __init__(self, compiler: GrammarCompiler, compiled: str) -> None:
        self.vocab_size = compiler.vocab_size
        self.matcher = llg.LLMatcher(compiler.tokenizer, compiled, log_level=0, limits=limits())
        self._check()

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the tokens that may come next."""
        return self.masks_after([[]])[0]

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (not even EOS)."""
        return self.matcher.is_stopped()

    def accept(self, token: int) -> None:
        """Follow an emitted token (one the mask allowed)."""
        self.matcher.consume_token(token)
        self._check()

    def masks_after(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: what may follow each path of tokens from here (a
        draft tree's nodes). A path that leaves the grammar is never reached by acceptance:
        its row allows everything. The matcher's own state is left as it was."""
        bitmask = llg_torch.allocate_token_bitmask(len(paths), self.vocab_size)  # all allowed
        for row, path in enumerate(paths):
            taken = self.matcher.try_consume_tokens(path)
            if taken == len(path):
                llg_torch.fill_next_token_bitmask(self.matcher, bitmask, row)
            self.matcher.rollback(taken)
        return unpack_bitmask(bitmask, self.vocab_size)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 words, bit j of word w for token 32 w + j ->
    [rows, vocab] bool."""
    return ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab_size]
