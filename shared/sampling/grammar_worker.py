"""Grammars are compiled in a child process, under llguidance's limits and a time limit.

Compiling a grammar can take seconds (the GBNF converter is quadratic in its rules) or
overflow the compiler's stack (a deeply nested grammar): neither may stall or crash the
service that asked. The child converts the grammar, validates it against the model's
vocabulary, and builds a matcher and its first mask (what the service does next with it);
it answers with the compiled grammar or a short error. A child that runs out of time is
killed and a new one starts for the next grammar; one that dies refuses only the grammar
that killed it. This module imports no torch: the child stays small.
"""

from __future__ import annotations

import contextlib
import json
import select
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import llguidance as llg
from llguidance.gbnf_to_lark import gbnf_to_lark
from specmesh.shared.sampling.params import JSON_LAYOUT, Grammar

MAX_ERROR_CHARS = 300  # of an error message; llguidance's can quote the whole grammar
START_TIMEOUT_S = 60.0  # the child imports llguidance and reads the tokenizer once
WALK_TOKENS = 4  # tokens a new grammar's matcher takes before it is accepted
COMPILE_TIMEOUT_S = 1.0  # default: a 4xx within 2 s, a new child's start included


def limits() -> llg.LLParserLimits:
    """llguidance's own limits, with errors that do not echo the grammar back."""
    return llg.LLParserLimits(verbose_errors=False)


def short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def llguidance_grammar(grammar: Grammar) -> str:
    """llguidance's grammar for `grammar` (not validated yet)."""
    try:
        if grammar.kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_LAYOUT)
        if grammar.kind == "json_schema":
            return llg.LLMatcher.grammar_from_json_schema(grammar.source, JSON_LAYOUT)
        if grammar.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(grammar.source)
        if grammar.kind == "ebnf":
            return llg.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar.source))
        return llg.LLMatcher.grammar_from_lark(grammar.source)
    except Exception as exc:  # malformed JSON, or GBNF (its converter raises bare Exception)
        raise ValueError(f"invalid {grammar.kind} grammar: {short(str(exc))}") from None


def compile_checked(grammar: Grammar, tokenizer: llg.LLTokenizer) -> str:
    """The compiled grammar, once a matcher built from it has walked its first few tokens
    (each time the lowest allowed id): a grammar whose parser outgrows llguidance's limits
    there fails here, not in a service's step. ValueError says what is wrong."""
    compiled = llguidance_grammar(grammar)
    if error := llg.LLMatcher.validate_grammar(compiled, tokenizer, limits=limits()):
        raise ValueError(f"invalid {grammar.kind} grammar: {short(error)}")
    matcher = llg.LLMatcher(tokenizer, compiled, log_level=0, limits=limits())
    for _ in range(WALK_TOKENS):
        bias = matcher.compute_logit_bias()  # a byte per token, 0 where it is not allowed
        first = len(bias) - len(bias.lstrip(b"\0"))
        if matcher.is_error() or matcher.is_stopped() or first == len(bias):
            break
        matcher.consume_token(first)
    if matcher.is_error():
        raise ValueError(f"invalid {grammar.kind} grammar: {short(matcher.get_error())}")
    return compiled


def read_tokenizer(tokenizer_json: Path, vocab_size: int, eos: list[int]) -> llg.LLTokenizer:
    return llg.LLTokenizer(tokenizer_json.read_text(), n_vocab=vocab_size, eos_token=eos)


def _serve(tokenizer_json: Path, vocab_size: int, eos: list[int]) -> None:
    """The child: a ready line, then one line per grammar line on stdin, until it closes."""
    tokenizer = read_tokenizer(tokenizer_json, vocab_size, eos)
    _answer("ready", "")
    for line in sys.stdin:
        request = json.loads(line)
        grammar = Grammar(request["kind"], request["source"])
        try:
            _answer("ok", compile_checked(grammar, tokenizer))
        except ValueError as exc:
            _answer("error", str(exc))
        except Exception as exc:  # anything else llguidance raises is about the grammar too
            _answer("error", f"invalid {grammar.kind} grammar: {short(str(exc))}")


def _answer(status: str, payload: str) -> None:
    sys.stdout.write(json.dumps([status, payload]) + "\n")
    sys.stdout.flush()


class GrammarWorker:
    """The parent's side: one child compiling, one at a time, and a spare already started
    to take over from a child that is killed."""

    def __init__(
        self, tokenizer_json: Path, vocab_size: int, eos: list[int], timeout_s: float
    ) -> None:
        eos_list = ",".join(map(str, eos))
        self.argv = [sys.executable, "-m", __name__, str(tokenizer_json), str(vocab_size), eos_list]
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen[str] | None = None
        self._ready = False  # the child said it has read the tokenizer
        self._spare: subprocess.Popen[str] | None = None
        self._stops: dict[subprocess.Popen[str], weakref.finalize] = {}  # also on collection

    def compile(self, grammar: Grammar) -> str:
        """The compiled grammar; ValueError if it is invalid, too slow, or crashes."""
        with self._lock:
            child = self._started()
            assert child.stdin is not None
            with contextlib.suppress(BrokenPipeError):  # it died: _reply finds out
                child.stdin.write(json.dumps({"kind": grammar.kind, "source": grammar.source}))
                child.stdin.write("\n")
                child.stdin.flush()
            status, payload = self._reply(grammar, child)
        if status != "ok":
            raise ValueError(payload)
        return payload

    def _reply(self, grammar: Grammar, child: subprocess.Popen[str]) -> list[str]:
        line = _read_line(child, self.timeout_s)
        if line:
            return json.loads(line)
        self.start()  # the spare takes over: the next grammar does not wait for a start
        if line is None:
            return ["error", f"{grammar.kind} grammar took over {self.timeout_s:g} s to compile"]
        return ["error", f"{grammar.kind} grammar: the compiler failed on it (too deep?)"]

    def _started(self) -> subprocess.Popen[str]:
        if self._child is None or self._child.poll() is not None:
            self.start()
        assert self._child is not None
        if not self._ready:
            if not _read_line(self._child, START_TIMEOUT_S):
                self.close()
                raise RuntimeError("the grammar compiler did not start")
            self._ready = True
        return self._child

    def start(self) -> None:
        """A new child compiles from now on (the spare, if one is up), with a new spare."""
        self._stop(self._child)
        self._child, self._ready = self._spare or self._spawn(), False
        self._spare = self._spawn()

    def close(self) -> None:
        self._stop(self._child)
        self._stop(self._spare)
        self._child = self._spare = None
        self._ready = False

    def _spawn(self) -> subprocess.Popen[str]:
        pipe = subprocess.PIPE
        child = subprocess.Popen(self.argv, stdin=pipe, stdout=pipe, text=True)
        self._stops[child] = weakref.finalize(self, _stop, child)
        return child

    def _stop(self, child: subprocess.Popen[str] | None) -> None:
        if child is not None:
            self._stops.pop(child)()


def _read_line(child: subprocess.Popen[str], timeout_s: float) -> str | None:
    """The child's next line; "" if it died, None if it said nothing in time."""
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout_s)
    return child.stdout.readline() if ready else None


def _stop(child: subprocess.Popen[str]) -> None:
    child.kill()
    child.wait()
    for pipe in (child.stdin, child.stdout):
        if pipe is not None:
            pipe.close()


if __name__ == "__main__":
    _serve(Path(sys.argv[1]), int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",") if t])
