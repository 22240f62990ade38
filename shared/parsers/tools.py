"""Tool-call formats: parse model output into OpenAI tool calls, and render tools and calls.

Every format splits an output into content, then (from the first call marker on) a
call region. The region is read as a sequence of units, each a call or text; a unit
is decided by its own text alone, so reading the output whole or chunk by chunk
gives the same result. Region text that is not a valid call is returned as
content, unchanged, once the output ends.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.parsers import held_back
from shared.sampling.params import JSON_LAYOUT, Grammar


def _new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object (json.dumps of what was parsed)
    id: str = field(default_factory=_new_call_id)


# One unit of a call region: its length in characters and what it is.
Unit = tuple[int, ToolCall | str]

_DECODER = json.JSONDecoder()


def _make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A call if `name` is a string and `arguments` an object (or JSON text of one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _call_from_object(value: Any) -> ToolCall | None:
    """A call from {"name": ..., "arguments" or "parameters": ...}; no arguments means {}."""
    if not isinstance(value, dict):
        return None
    arguments = value["arguments"] if "arguments" in value else value.get("parameters", {})
    return _make_call(value.get("name"), arguments)


def _object_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON object at text[start:] and where it ends; None while incomplete (or not JSON)."""
    # Only an object: a bare number at the end of the text could still grow.
    if start >= len(text) or text[start] != "{":
        return None
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def _object_unit(text: str, start: int) -> Unit | None:
    """The call object at text[start:] as a unit (the call, or its raw text if invalid)."""
    if (found := _object_at(text, start)) is None:
        return None
    value, end = found
    return end, _call_from_object(value) or text[:end]


def _content_end(text: str, marker: str) -> tuple[int, bool]:
    """For formats whose calls start at `marker` anywhere in the output."""
    start = text.find(marker)
    if start >= 0:
        return start, True
    return len(text) - held_back(text, [marker]), False


def _decoded_arguments(arguments: Any) -> Any:
    """An OpenAI call's arguments (JSON text) as a value to embed; kept as is if not JSON."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _call_objects(calls: list[dict[str, Any]], arguments_key: str) -> list[dict[str, Any]]:
    return [
        {
            "name": call["function"]["name"],
            arguments_key: _decoded_arguments(call["function"]["arguments"]),
        }
        for call in calls
    ]


def _tool_lines(tools: list[dict[str, Any]]) -> str:
    return "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)


# OpenAI: a function without `parameters` takes none.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    """A call object of `tool`: its name, and arguments matching its parameters schema."""
    function = tool["function"]
    return {
        "type": "object",
        "properties": {
            "name": {"const": function["name"]},
            arguments_key: function.get("parameters") or NO_PARAMETERS,
        },
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _lark(opening: str, rule: str, closing: str) -> str:
    """A Lark sequence: `rule` between the literals `opening` and `closing` (if any)."""
    return " ".join(
        part for part in (json.dumps(opening), rule, json.dumps(closing)) if part != '""'
    )


class ToolParser(ABC):
    name: ClassVar[str]
    # Every unit ends with one of these characters: reading is only retried after one arrives.
    unit_ends: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"
    # How calls are written: each call object inside call_open/call_close, several apart
    # by call_separator, all inside list_open/list_close.
    call_open: ClassVar[str] = ""
    call_close: ClassVar[str] = ""
    call_separator: ClassVar[str]
    list_open: ClassVar[str] = ""
    list_close: ClassVar[str] = ""

    @abstractmethod
    def render_tools(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text listing OpenAI `tools` and how to call them in this format."""

    @abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """An assistant message's OpenAI `tool_calls` written as text in this format."""

    def call_grammar(
        self, tools: list[dict[str, Any]], name: str | None, parallel: bool
    ) -> Grammar:
        """What `tool_choice` forces, as a Lark grammar: a call of the function `name` (of
        any of `tools` when None) in this format, each call's arguments matching its tool's
        parameters schema; nothing else. With `parallel`, up to one call per tool offered:
        a bound, since small models would otherwise go on calling to the length limit."""
        chosen = [t for t in tools if name in (None, t["function"]["name"])]
        schema = {"anyOf": [_call_schema(t, self.arguments_key) for t in chosen]}
        schema["x-guidance"] = JSON_LAYOUT
        call = _lark(self.call_open, f"%json {json.dumps(schema)}", self.call_close)
        more = len(chosen) - 1 if parallel else 0
        calls = "call" + f" ({json.dumps(self.call_separator)} call" * more + ")?" * more
        start = _lark(self.list_open, calls, self.list_close)
        return Grammar("lark", f"start: {start}\ncall: {call}\n")

    @abstractmethod
    def _content_end(self, text: str, at_start: bool) -> tuple[int, bool]:
        """(end of the content that is safe to emit, whether the call region starts there).

        `text` is what has not been emitted yet; `at_start`: nothing has been emitted.
        """

    @abstractmethod
    def _next_unit(self, text: str) -> Unit | None:
        """The first unit of call-region `text`, or None while it is not complete."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A complete output -> (content outside the calls, the calls)."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more_calls = stream.finish()
        return content + rest, calls + more_calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


class ToolCallStream:
    """Parses an output incrementally; the results add up to what parse() gives."""

    def __init__(self, parser: ToolParser) -> None:
        self._parser = parser
        self._pending = ""  # text neither emitted as content nor read as units yet
        self._at_start = True
        self._in_calls = False  # a call marker was seen: content stops
        self._leftover: list[str] = []  # region text that was no call, emitted at finish
        self._may_complete = True  # a unit end arrived since reading last stopped short

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Add output text; return the content now safe to emit and the calls it completed."""
        self._pending += text
        # Saves re-reading a long unfinished call (e.g. big arguments) on every chunk.
        self._may_complete = self._may_complete or any(c in text for c in self._parser.unit_ends)
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the output: whatever is left."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, list[ToolCall]]:
        content = ""
        if not self._in_calls:
            end, self._in_calls = self._parser._content_end(self._pending, self._at_start)
            if final and not self._in_calls:
                end = len(self._pending)
            content, self._pending = self._pending[:end], self._pending[end:]
            self._at_start = self._at_start and not content
        calls: list[ToolCall] = []
        while self._in_calls and self._pending and (self._may_complete or final):
            unit = self._parser._next_unit(self._pending)
            if unit is None:
                if not final:
                    self._may_complete = False
                    break
                unit = len(self._pending), self._pending  # never completed: raw text
            size, value = unit
            self._pending = self._pending[size:]
            if isinstance(value, ToolCall):
                calls.append(value)
            elif value.strip():  # whitespace between calls is layout, not content
                self._leftover.append(value)
        if final:
            content += "".join(self._leftover)
            self._leftover = []
        return content, calls


class HermesToolParser(ToolParser):
    """<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call."""

    name = "hermes"
    unit_ends = ">"
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    call_open = OPEN + "\n"
    call_close = "\n" + CLOSE
    call_separator = "\n"

    def render_tools(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call functions to help with the request. Their signatures, one per line:\n"
            f"<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
            "To call a function, write its name and arguments as a JSON object between "
            f"{self.OPEN} and {self.CLOSE} tags, one block per call:\n"
            f'{self.OPEN}\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n'
            f"{self.CLOSE}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(
            f"{self.OPEN}\n{json.dumps(call, ensure_ascii=False)}\n{self.CLOSE}"
            for call in _call_objects(calls, self.arguments_key)
        )

    def _content_end(self, text: str, at_start: bool) -> tuple[int, bool]:
        return _content_end(text, self.OPEN)

    def _next_unit(self, text: str) -> Unit | None:
        if not text.startswith(self.OPEN):  # text between blocks, up to the next block
            start = text.find(self.OPEN)
            return (start, text[:start]) if start > 0 else None
        end = text.find(self.CLOSE, len(self.OPEN))
        if end < 0:
            return None
        size = end + len(self.CLOSE)
        try:
            call = _call_from_object(json.loads(text[len(self.OPEN) : end]))
        except ValueError:
            call = None
        return size, call or text[:size]


class Llama3JsonToolParser(ToolParser):
    """The whole output is {"name": ..., "parameters": {...}}, optionally after <|python_tag|>;
    several calls are separated by ';'."""

    name = "llama3_json"
    unit_ends = "}"
    PYTHON_TAG = "<|python_tag|>"
    arguments_key = "parameters"
    call_separator = "; "
    # What may come before a call: separators, the tag, whitespace.
    _LEAD = re.compile(r"[\s;]*(?:<\|python_tag\|>)?\s*")

    def render_tools(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call the functions below to help with the request. To call one, reply "
            'with only a JSON object {"name": "function name", "parameters": {"argument": '
            '"value"}} and nothing else; separate several calls with "; ". Otherwise answer '
            f"normally.\n\nFunctions:\n{_tool_lines(tools)}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = _call_objects(calls, self.arguments_key)
        return "; ".join(json.dumps(call, ensure_ascii=False) for call in objects)

    def _content_end(self, text: str, at_start: bool) -> tuple[int, bool]:
        # Only an output that opens with a call is one; the decision is made once.
        if not at_start:
            return len(text), False
        body = text.lstrip()
        if body.startswith(("{", self.PYTHON_TAG)):
            return 0, True
        if self.PYTHON_TAG.startswith(body):  # blank so far, or part of the tag: undecided
            return 0, False
        return len(text), False

    def _next_unit(self, text: str) -> Unit | None:
        lead = self._LEAD.match(text)
        assert lead is not None  # the pattern matches the empty string
        return _object_unit(text, lead.end())


class MistralToolParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or [TOOL_CALLS]name[ARGS]{...}."""

    name = "mistral"
    unit_ends = "}]"
    MARKER = "[TOOL_CALLS]"
    list_open = MARKER + "["
    list_close = "]"
    call_separator = ", "
    # Units: an array's first element, a later element, the array's end, a name[ARGS] call.
    _FIRST_ITEM = re.compile(r"\s*\[TOOL_CALLS\]\s*\[\s*")
    _NEXT_ITEM = re.compile(r"\s*,\s*")
    _ARRAY_END = re.compile(r"\s*\]")
    _NAMED_CALL = re.compile(r"\s*\[TOOL_CALLS\]([^\[\]{}]+)\[ARGS\]\s*")

    def render_tools(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call the functions below to help with the request. To call them, reply "
            f"with {self.MARKER} followed by a JSON array of calls, each "
            '{"name": "function name", "arguments": {"argument": "value"}}, and nothing else.'
            f"\n\nFunctions:\n{_tool_lines(tools)}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        objects = _call_objects(calls, self.arguments_key)
        return self.MARKER + json.dumps(objects, ensure_ascii=False)

    def _content_end(self, text: str, at_start: bool) -> tuple[int, bool]:
        return _content_end(text, self.MARKER)

    def _next_unit(self, text: str) -> Unit | None:
        if item := self._FIRST_ITEM.match(text) or self._NEXT_ITEM.match(text):
            return _object_unit(text, item.end())
        if array_end := self._ARRAY_END.match(text):
            return array_end.end(), ""
        if named := self._NAMED_CALL.match(text):
            if (found := _object_at(text, named.end())) is None:
                return None
            arguments, end = found
            return end, _make_call(named[1].strip(), arguments) or text[:end]
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}


# What a chat template writes around tool calls, and the format that reads them.
_TEMPLATE_MARKERS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ("ipython", "llama3_json"),
)
DEFAULT_TOOL_PARSER = "hermes"  # the most common format, for templates that name none


def tool_parser_for_template(template: str | None) -> tuple[str, bool]:
    """The tool-call format a chat template writes; and whether the template named it
    (False: it did not, and the default applies)."""
    for marker, name in _TEMPLATE_MARKERS:
        if marker in (template or ""):
            return name, True
    return DEFAULT_TOOL_PARSER, False


def make_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        choices = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {choices}")
    return TOOL_PARSERS[name]()
