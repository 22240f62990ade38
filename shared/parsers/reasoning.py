"""Reasoning formats: split a thinking section (reasoning_content) from the answer (content).

Whitespace right after the end tag is dropped from the content. Parsing a whole
output and streaming it chunk by chunk give the same result.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from shared.parsers import held_back

Phase = Literal["start", "reasoning", "after_end", "content"]


class ReasoningParser:
    name: ClassVar[str]
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    # True when the chat template itself opens the section, so an output without the
    # start tag is reasoning too (until the end tag, or to the end of the output).
    opened_by_template: ClassVar[bool] = False

    def parse(self, text: str) -> tuple[str | None, str]:
        """A complete output -> (reasoning_content, or None when there is none; content)."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ReasoningStream:
    """Parses an output incrementally; the deltas add up to what parse() gives."""

    def __init__(self, parser: ReasoningParser) -> None:
        self._parser = parser
        self._pending = ""  # text not emitted yet
        self._phase: Phase = "start"

    def feed(self, text: str) -> tuple[str, str]:
        """Add output text; return the (reasoning, content) now safe to emit."""
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: whatever is left."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        start_tag, end_tag = self._parser.start_tag, self._parser.end_tag
        if self._phase == "start":
            body = self._pending.lstrip()
            if body.startswith(start_tag):
                self._phase, self._pending = "reasoning", body[len(start_tag) :]
            elif start_tag.startswith(body) and not final:  # blank, or part of the tag
                return "", ""
            else:
                self._phase = "reasoning" if self._parser.opened_by_template else "content"
        reasoning = content = ""
        if self._phase == "reasoning":
            end = self._pending.find(end_tag)
            if end >= 0:
                reasoning, self._pending = self._pending[:end], self._pending[end + len(end_tag) :]
                self._phase = "after_end"
            else:  # no end tag (yet): all reasoning, but for what may start the end tag
                cut = len(self._pending) - (0 if final else held_back(self._pending, [end_tag]))
                reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        if self._phase == "after_end":
            self._pending = self._pending.lstrip()
            if self._pending:
                self._phase = "content"
        if self._phase == "content":
            content, self._pending = self._pending, ""
        return reasoning, content


class DeepSeekR1ReasoningParser(ReasoningParser):
    """<think>...</think>; the template already opened <think>."""

    name = "deepseek_r1"
    start_tag = "<think>"
    end_tag = "</think>"
    opened_by_template = True


class Qwen3ReasoningParser(ReasoningParser):
    """<think>...</think>, only when the output opens with <think>."""

    name = "qwen3"
    start_tag = "<think>"
    end_tag = "</think>"


class MistralReasoningParser(ReasoningParser):
    """[THINK]...[/THINK], only when the output opens with [THINK]."""

    name = "mistral"
    start_tag = "[THINK]"
    end_tag = "[/THINK]"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser
    for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, MistralReasoningParser)
}
REASONING_PARSERS["deepseek-r1"] = DeepSeekR1ReasoningParser  # SGLang's spelling


def make_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        choices = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {choices}")
    return REASONING_PARSERS[name]()
