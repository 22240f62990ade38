"""Reasoning formats: split a thinking section (reasoning_content) from the answer (content).

Whitespace right after the end tag is dropped from the content. Parsing a whole
output and streaming it chunk by chunk give the same result.

Where the output starts depends on the prompt, which a request's template switches
(enable_thinking, reasoning_effort, ...): a prompt that ends inside an open thinking
section (the template wrote the start tag) continues in reasoning; one that ends
right after a closed section (thinking off: an empty section written for the model)
leaves only the answer to come.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from specmesh.shared.parsers import held_back

# "start": the output may open the section; "opened": the section is open, though the
# output may still repeat the start tag.
Phase = Literal["start", "opened", "reasoning", "after_end", "content"]


class ReasoningParser:
    name: ClassVar[str]
    start_tag: ClassVar[str]
    end_tag: ClassVar[str]
    # True when the model's chat template opens the section, so an output without the
    # start tag is reasoning too (until the end tag, or to the end of the output), also
    # where the prompt does not show it.
    opened_by_template: ClassVar[bool] = False

    def parse(self, text: str, prompt: str = "") -> tuple[str | None, str]:
        """A complete output -> (reasoning_content, or None when there is none; content).
        `prompt`: the prompt text the output continues (empty: unknown)."""
        stream = self.stream(prompt)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, content + more_content

    def stream(self, prompt: str = "") -> ReasoningStream:
        """An output's parser; `prompt` as for parse()."""
        return ReasoningStream(self, self.first_phase(prompt))

    def first_phase(self, prompt: str) -> Phase:
        """Where an output of `prompt` starts: inside the section if the prompt opened it,
        in the answer if the prompt closed it, else where this format starts."""
        tail = prompt.rstrip()
        if tail.endswith(self.start_tag):
            return "opened"
        if tail.endswith(self.end_tag):
            return "content"
        return "opened" if self.opened_by_template else "start"


class ReasoningStream:
    """Parses an output incrementally; the deltas add up to what parse() gives."""

    def __init__(self, parser: ReasoningParser, phase: Phase) -> None:
        self._parser = parser
        self._pending = ""  # text not emitted yet
        self._phase = phase

    def feed(self, text: str) -> tuple[str, str]:
        """Add output text; return the (reasoning, content) now safe to emit."""
        self._pending += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: whatever is left."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        start_tag, end_tag = self._parser.start_tag, self._parser.end_tag
        if self._phase in ("start", "opened"):
            body = self._pending.lstrip()
            if body.startswith(start_tag):
                self._phase, self._pending = "reasoning", body[len(start_tag) :]
            elif start_tag.startswith(body) and not final:  # blank, or part of the tag
                return "", ""
            else:
                self._phase = "reasoning" if self._phase == "opened" else "content"
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
