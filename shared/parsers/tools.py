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
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from specmesh.shared.parsers import held_back
from specmesh.shared.sampling.params import JSON_LAYOUT, Grammar


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


def _make_call(name: Any, arguments: Any, call_id: str | None = None) -> ToolCall | None:
    """A call if `name` is a string and `arguments` an object (or JSON text of one);
    `call_id`: the id the format gave it (None: a new one)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    call = ToolCall(name, json.dumps(arguments, ensure_ascii=False))
    if call_id is not None:
        call.id = call_id
    return call


def _call_from_object(value: Any, call_id: str | None = None) -> ToolCall | None:
    """A call from {"name": ..., "arguments" or "parameters": ...}; no arguments means {}."""
    if not isinstance(value, dict):
        return None
    arguments = value["arguments"] if "arguments" in value else value.get("parameters", {})
    return _make_call(value.get("name"), arguments, call_id)


def _object_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON object at text[start:] and where it ends; None while incomplete (or not JSON)."""
    # Only an object: a bare number at the end of the text could still grow.
    if start >= len(text) or text[start] != "{":
        return None
    try:
        return _DECODER.raw_decode(text, start)
    except ValueError:
        return None


def _object_unit(text: str, start: int, call_id: str | None = None) -> Unit | None:
    """The call object at text[start:] as a unit (the call, or its raw text if invalid)."""
    if (found := _object_at(text, start)) is None:
        return None
    value, end = found
    return end, _call_from_object(value, call_id) or text[:end]


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


def _lark_calls(count: int, separator: str) -> str:
    """A Lark sequence of one to `count` calls (rule `call`), apart by `separator`."""
    more = count - 1
    return "call" + f" ({json.dumps(separator)} call" * more + ")?" * more


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
    # The format's markers: where the tokenizer has them as special tokens, the output's
    # text keeps them for this parser (others are dropped when detokenizing).
    markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        # The request's OpenAI tools: formats that write arguments as untyped text read
        # them by the tool's parameters schema.
        self.tools = tools or []

    def for_request(self, tools: list[dict[str, Any]]) -> ToolParser:
        """This format, reading the calls of a request that offers `tools`."""
        return type(self)(tools)

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
        calls = _lark_calls(len(chosen) if parallel else 1, self.call_separator)
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
    markers = (OPEN, CLOSE)
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
        return size, self._block_call(text[len(self.OPEN) : end]) or text[:size]

    def _block_call(self, body: str) -> ToolCall | None:
        """The call written between the tags (None: not a valid call)."""
        try:
            return _call_from_object(json.loads(body))
        except ValueError:
            return None


# JSON Schema types other than string: a parameter of one of these is written as JSON.
_JSON_TYPES = frozenset({"null", "boolean", "integer", "number", "array", "object"})
# Lark: a parameter's text value, which cannot hold the line that closes the parameter.
_LARK_TEXT = r"(/(.|\n)*/ & ~/(.|\n)*\n<\/parameter>(.|\n)*/)"


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows (its `type`, also inside anyOf/oneOf); empty: unknown."""
    if not isinstance(schema, dict):
        return set()
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared or [])
    for option in [*schema.get("anyOf", []), *schema.get("oneOf", [])]:
        types |= _schema_types(option)
    return types


def _json_type(value: Any) -> str:
    """The JSON type of a value json.loads made."""
    for kind, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string")):
        if isinstance(value, kind):
            return name
    return "null" if value is None else "array" if isinstance(value, list) else "object"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json.loads takes NaN and Infinity otherwise


def _typed_value(text: str, schema: Any) -> Any:
    """A parameter's value as written (one newline either side is layout), typed by its
    schema: JSON where the schema allows that JSON type, else the text itself."""
    value = text.removeprefix("\n").removesuffix("\n")
    types = _schema_types(schema)
    if "boolean" in types and value.lower() in ("true", "false"):  # Python's True, False too
        return value.lower() == "true"
    try:
        parsed = json.loads(value, parse_constant=_no_constant)
    except ValueError:
        return value
    kind = _json_type(parsed)
    if kind in types - {"string"} or (kind == "integer" and "number" in types):
        return parsed
    return value  # strings are written bare: text that parses as JSON is still text


def _written_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class Qwen3CoderToolParser(HermesToolParser):
    """Qwen3-Coder's XML-style calls, one <tool_call> block each:
    <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>.
    Values are bare text, typed by the request's tool schemas."""

    name = "qwen3_coder"
    _FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
    # As vLLM and SGLang read it: a parameter missing its closing tag ends at the next one.
    _PARAMETER = re.compile(
        r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL
    )

    def render_tools(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call functions to help with the request. Their signatures, one per line:\n"
            f"<tools>\n{_tool_lines(tools)}\n</tools>\n\n"
            "To call a function, write its name and each argument in this form, one block "
            f"per call:\n{self.OPEN}\n<function=function name>\n<parameter=argument name>\n"
            f"value\n</parameter>\n</function>\n{self.CLOSE}"
        )

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        return "\n".join(self._written_call(call) for call in _call_objects(calls, "arguments"))

    def _written_call(self, call: dict[str, Any]) -> str:
        arguments = call["arguments"] if isinstance(call["arguments"], dict) else {}
        parameters = "".join(
            f"<parameter={key}>\n{_written_value(value)}\n</parameter>\n"
            for key, value in arguments.items()
        )
        return f"{self.OPEN}\n<function={call['name']}>\n{parameters}</function>\n{self.CLOSE}"

    def call_grammar(
        self, tools: list[dict[str, Any]], name: str | None, parallel: bool
    ) -> Grammar:
        """As ToolParser's, in this format: the parameters of a call in their schema's
        order, the required ones always; text values are any text, JSON ones match their
        schema."""
        chosen = [t for t in tools if name in (None, t["function"]["name"])]
        calls = _lark_calls(len(chosen) if parallel else 1, self.call_separator)
        rules = [f"start: {calls}"]
        rules.append("call: " + " | ".join(f"call{i}" for i in range(len(chosen))))
        for i, tool in enumerate(chosen):
            rules += self._call_rules(f"call{i}", tool["function"])
        return Grammar("lark", "\n".join(rules) + "\n")

    def _call_rules(self, rule: str, function: dict[str, Any]) -> list[str]:
        """Lark rules for a call of `function`, named `rule`."""
        schema = function.get("parameters") or NO_PARAMETERS
        required = set(schema.get("required", []))
        parts, rules = [], []
        for j, (key, value_schema) in enumerate(schema.get("properties", {}).items()):
            opening, closing = f"<parameter={key}>\n", "\n</parameter>\n"
            types = _schema_types(value_schema)
            if "string" in types or not types & _JSON_TYPES:  # read back as text
                part = f"{rule}_P{j}".upper()  # a terminal: the value ends at its closing tag
                rules.append(f"{part}: {_lark(opening, _LARK_TEXT, closing)}")
            else:
                part = f"{rule}_p{j}"
                value = json.dumps({**value_schema, "x-guidance": JSON_LAYOUT})
                rules.append(f"{part}: {_lark(opening, f'%json {value}', closing)}")
            parts.append(part if key in required else f"{part}?")
        opening = f"{self.OPEN}\n<function={function['name']}>\n"
        closing = f"</function>\n{self.CLOSE}"
        return [f"{rule}: {_lark(opening, ' '.join(parts), closing)}", *rules]

    def _block_call(self, body: str) -> ToolCall | None:
        function = self._FUNCTION.fullmatch(body)
        if function is None:
            return None
        name = function[1].strip()
        schemas = self._parameter_schemas(name)
        parameters = ((key.strip(), value) for key, value in self._PARAMETER.findall(function[2]))
        arguments = {key: _typed_value(value, schemas.get(key)) for key, value in parameters}
        return _make_call(name, arguments)

    def _parameter_schemas(self, name: str) -> dict[str, Any]:
        """The parameter schemas of the request's tool `name` (none if it offers no such tool)."""
        for tool in self.tools:
            if tool.get("function", {}).get("name") == name:
                return (tool["function"].get("parameters") or {}).get("properties") or {}
        return {}


class Llama3JsonToolParser(ToolParser):
    """The whole output is {"name": ..., "parameters": {...}}, optionally after <|python_tag|>;
    several calls are separated by ';'."""

    name = "llama3_json"
    unit_ends = "}"
    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)
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


def _mistral_call_id() -> str:
    # Mistral's chat templates refuse tool call ids that are not 9 letters or digits.
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


class MistralToolParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (before v11 tokenizers), or
    [TOOL_CALLS]name[ARGS]{...} per call (v11 on; [TOOL_CALLS]name[CALL_ID]id[ARGS]{...}
    in some versions)."""

    name = "mistral"
    unit_ends = "}]"
    MARKER = "[TOOL_CALLS]"
    markers = (MARKER, "[ARGS]", "[CALL_ID]")
    list_open = MARKER + "["
    list_close = "]"
    call_separator = ", "
    # Units: an array's first element, a later element, the array's end, a name[ARGS] call.
    _FIRST_ITEM = re.compile(r"\s*\[TOOL_CALLS\]\s*\[\s*")
    _NEXT_ITEM = re.compile(r"\s*,\s*")
    _ARRAY_END = re.compile(r"\s*\]")
    _NAMED_CALL = re.compile(
        r"\s*\[TOOL_CALLS\]([^\[\]{}]+)(?:\[CALL_ID\]([^\[\]{}]+))?\[ARGS\]\s*"
    )

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
            return _object_unit(text, item.end(), _mistral_call_id())
        if array_end := self._ARRAY_END.match(text):
            return array_end.end(), ""
        if named := self._NAMED_CALL.match(text):
            if (found := _object_at(text, named.end())) is None:
                return None
            arguments, end = found
            call_id = named[2].strip() if named[2] else _mistral_call_id()
            return end, _make_call(named[1].strip(), arguments, call_id) or text[:end]
        return None


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen25": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama3": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
}


# What a chat template writes around tool calls (all of it), and the format that reads
# them; the first match wins.
_TEMPLATE_MARKERS = (
    (("<function=", "<parameter="), "qwen3_coder"),  # inside <tool_call>: before hermes
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3_json"),
    (("ipython",), "llama3_json"),
)
DEFAULT_TOOL_PARSER = "hermes"  # the most common format, for templates that name none


def tool_parser_for_template(template: str | None) -> tuple[str, bool]:
    """The tool-call format a chat template writes; and whether the template named it
    (False: it did not, and the default applies)."""
    for markers, name in _TEMPLATE_MARKERS:
        if all(marker in (template or "") for marker in markers):
            return name, True
    return DEFAULT_TOOL_PARSER, False


def make_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolParser:
    """The format `name`; `tools`: the request's, for formats that type arguments by them."""
    if name not in TOOL_PARSERS:
        choices = ", ".join(sorted(TOOL_PARSERS))
        raise ValueError(f"unknown tool parser {name!r}; choose one of: {choices}")
    return TOOL_PARSERS[name](tools)
