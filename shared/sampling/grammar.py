"""Grammar-constrained decoding, with llguidance.

A request's `Grammar` is compiled once per distinct grammar (`GrammarCompiler`: an LRU
cache of llguidance grammars, each validated against the model's vocabulary in a child
process under time and size limits, so a bad, huge or slow grammar is a ValueError before
anything runs). Each sequence gets
a `GrammarMatcher` that follows the tokens it emits and says which may come next: a mask
over the vocabulary, applied to the logits before sampling. For a draft tree,
`masks_after` gives the mask after every node's path, so verification never accepts a
draft the grammar forbids and the bonus token is drawn from the masked distribution:
constrained output is the same with speculation as without.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import llguidance as llg
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
        bias = self.matcher.compute_logit_bias()  # one byte per token: 0 or 200
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8) != 0
        if len(allowed) < self.vocab_size:  # model rows past the tokenizer's vocabulary
            allowed = torch.cat([allowed, allowed.new_zeros(self.vocab_size - len(allowed))])
        return allowed[: self.vocab_size]

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
        rows = []
        for path in paths:
            taken = self.matcher.try_consume_tokens(path)
            reached = taken == len(path)
            rows.append(self.allowed() if reached else torch.ones(self.vocab_size, dtype=bool))
            self.matcher.rollback(taken)
        return torch.stack(rows)
