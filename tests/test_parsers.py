"""shared/parsers: tool-call and reasoning formats, whole and streamed."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from specmesh.shared.parsers import held_back
from specmesh.shared.parsers.reasoning import REASONING_PARSERS, make_reasoning_parser
from specmesh.shared.parsers.tools import (
    TOOL_PARSERS,
    ToolCall,
    make_tool_parser,
    tool_parser_for_template,
)

pytestmark = pytest.mark.unit

# (name, arguments) of the calls a parser should find.
Calls = list[tuple[str, dict[str, Any]]]


def _hermes(name: str, arguments: Any) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER = _hermes("get_weather", {"city": "Paris"})
TIME = _hermes("get_time", {"zone": "UTC", "precise": True})

# (parser, output text, expected content, expected calls)
TOOL_CASES: list[tuple[str, str, str, Calls]] = [
    ("hermes", WEATHER, "", [("get_weather", {"city": "Paris"})]),
    (
        "hermes",
        f"Let me check.\n{WEATHER}\n{TIME}\n",
        "Let me check.\n",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC", "precise": True})],
    ),
    (
        "hermes",
        "No tools: a < b, <b>bold</b> and <tool",
        "No tools: a < b, <b>bold</b> and <tool",
        [],
    ),
    (
        "hermes",
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": broken}</tool_call>\n' + WEATHER,
        '<tool_call>{"name": broken}</tool_call>',
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        WEATHER + '\n<tool_call>\n{"name": "get_time", "argu',
        '<tool_call>\n{"name": "get_time", "argu',
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "hermes",
        _hermes("note", {"text": "Zürich ❄ 雪", "emoji": "🎉"}),
        "",
        [("note", {"text": "Zürich ❄ 雪", "emoji": "🎉"})],
    ),
    (
        "hermes",
        _hermes("encoded", json.dumps({"a": [1, 2]})),  # arguments as JSON text
        "",
        [("encoded", {"a": [1, 2]})],
    ),
    ("hermes", _hermes("listy", [1, 2]), _hermes("listy", [1, 2]), []),
    ("hermes", WEATHER + "\nDone.", "\nDone.", [("get_weather", {"city": "Paris"})]),
    (
        "hermes",
        '<tool_call>\n{"name": "no_args"}\n</tool_call>',
        "",
        [("no_args", {})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama3_json",
        ' \n<|python_tag|>{"name": "a", "arguments": {"x": 1}}; {"name": "b", "parameters": {}}',
        "",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "llama3_json",
        'The call would be {"name": "a", "parameters": {}}',
        'The call would be {"name": "a", "parameters": {}}',
        [],
    ),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"x": ',
        '{"name": "a", "parameters": {"x": ',
        [],
    ),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("llama3_json", "<|python", "<|python", []),
    ("llama3_json", "", "", []),
    (
        "llama3_json",
        '{"name": "a", "parameters": {"s": "naïve ü"}}; {"name": "b", "param',
        '; {"name": "b", "param',
        [("a", {"s": "naïve ü"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}},'
        ' {"name": "b", "arguments": {"y": "ü"}}]',
        "",
        [("a", {"x": 1}), ("b", {"y": "ü"})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [ {"name": "a", "arguments": {}} ]',
        "Sure. ",
        [("a", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "argu',
        '[TOOL_CALLS][{"name": "a", "argu',
        [],
    ),
    ("mistral", "Use [brackets] and [TOOL", "Use [brackets] and [TOOL", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b"',
        ', {"name": "b"',
        [("a", {})],
    ),
]


def _coder(name: str, *parameters: tuple[str, str]) -> str:
    """A qwen3_coder call block with each parameter's value written as given."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


# The request's tools: qwen3_coder types parameter values by them (the others ignore them).
TYPED_PARAMETERS: dict[str, Any] = {
    "text": {"type": "string"},
    "count": {"type": "integer"},
    "ratio": {"type": "number"},
    "flag": {"type": "boolean"},
    "options": {"type": "object"},
    "items": {"type": "array", "items": {"type": "string"}},
    "maybe": {"type": ["string", "null"]},
    "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "untyped": {"description": "no type given"},
}
REQUEST_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "typed",
            "parameters": {"type": "object", "properties": TYPED_PARAMETERS},
        },
    },
]
CODER_WEATHER = _coder("get_weather", ("city", "Paris"), ("days", "3"))

TOOL_CASES += [
    ("qwen3_coder", CODER_WEATHER, "", [("get_weather", {"city": "Paris", "days": 3})]),
    (
        "qwen3_coder",
        f"Let me check.\n\n{CODER_WEATHER}\n{_coder('get_weather', ('city', 'Zürich ❄'))}\n",
        "Let me check.\n\n",
        [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Zürich ❄"})],
    ),
    (
        "qwen3_coder",
        _coder(
            "typed",
            ("text", "42"),
            ("count", "7"),
            ("ratio", "7"),
            ("flag", "True"),
            ("options", '{"a": [1, null]}'),
            ("items", '["x", "y"]'),
            ("maybe", "null"),
            ("either", "5"),
            ("untyped", "[1]"),
        ),
        "",
        [
            (
                "typed",
                {
                    "text": "42",
                    "count": 7,
                    "ratio": 7,
                    "flag": True,
                    "options": {"a": [1, None]},
                    "items": ["x", "y"],
                    "maybe": None,
                    "either": 5,
                    "untyped": "[1]",
                },
            )
        ],
    ),
    (  # values that are not of their type stay text; text keeps all but the layout newlines
        "qwen3_coder",
        _coder(
            "typed",
            ("text", '\n"quoted"\n  two lines\n'),
            ("count", "three"),
            ("ratio", "NaN"),
            ("flag", "yes"),
            ("options", "{not json}"),
            ("maybe", "7"),
            ("either", "2.5"),
        ),
        "",
        [
            (
                "typed",
                {
                    "text": '\n"quoted"\n  two lines\n',
                    "count": "three",
                    "ratio": "NaN",
                    "flag": "yes",
                    "options": "{not json}",
                    "maybe": "7",
                    "either": "2.5",
                },
            )
        ],
    ),
    (  # a function the request does not offer: its values stay text
        "qwen3_coder",
        _coder("unknown", ("n", "1")),
        "",
        [("unknown", {"n": "1"})],
    ),
    (  # as vLLM and SGLang read it: a parameter without its closing tag ends at the next
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
        "</function>\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    ("qwen3_coder", _coder("no_args"), "", [("no_args", {})]),
    (
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>"
        + CODER_WEATHER,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "qwen3_coder",
        "Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        "Sure.<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [],
    ),
    (
        "qwen3_coder",
        CODER_WEATHER + "\n<tool_call>\n<function=get_weather>\n</function>\n",
        "<tool_call>\n<function=get_weather>\n</function>\n",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    (
        "qwen3_coder",
        "Write <function=f> and <parameter=x> as text, or <tool",
        "Write <function=f> and <parameter=x> as text, or <tool",
        [],
    ),
    (  # no name: no call
        "qwen3_coder",
        "<tool_call>\n<function= >\n</function>\n</tool_call>",
        "<tool_call>\n<function= >\n</function>\n</tool_call>",
        [],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]a[CALL_ID]Ab3dE6gH9[ARGS]{"s": "ü {x}"}[TOOL_CALLS]b[ARGS]{"n": [1]}',
        "Sure.",
        [("a", {"s": "ü {x}"}), ("b", {"n": [1]})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]a[ARGS]{"x": }',
        '[TOOL_CALLS]a[ARGS]{"x": }',
        [],
    ),
    ("mistral", "[TOOL_CALLS]a[ARGS][1, 2]", "[TOOL_CALLS]a[ARGS][1, 2]", []),
    (
        "mistral",
        '[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{"y": ',
        '[TOOL_CALLS]b[ARGS]{"y": ',
        [("a", {})],
    ),
]
# (parser, output text, expected reasoning, expected content)
REASONING_CASES: list[tuple[str, str, str | None, str]] = [
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer.", "Let me think.\n", "The answer."),
    ("deepseek_r1", "<think>hmm</think>ok", "hmm", "ok"),
    ("deepseek_r1", "thinking that never ends </thi", "thinking that never ends </thi", ""),
    ("deepseek_r1", "</think>\n\nJust the answer", None, "Just the answer"),
    ("deepseek_r1", "", None, ""),
    ("qwen3", "<think>\nabc\n</think>\n\nAnswer ü", "\nabc\n", "Answer ü"),
    ("qwen3", "  <think>x</think>y", "x", "y"),
    ("qwen3", "An answer without thinking", None, "An answer without thinking"),
    ("qwen3", "<think>unfinished", "unfinished", ""),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "a </think> b", None, "a </think> b"),
    ("qwen3", "<think></think>\n\n", None, ""),
    ("mistral", "[THINK]plan [/THINK]\nresult", "plan ", "result"),
    ("mistral", "result [THINK]", None, "result [THINK]"),
]


QWEN3_ASSISTANT = "<|im_start|>assistant\n"
# (parser, prompt text, output text, expected reasoning, expected content): where the
# prompt leaves the output, in or out of a thinking section.
PROMPTED_REASONING_CASES: list[tuple[str, str, str, str | None, str]] = [
    # Qwen3 "thinking" templates open the section in the prompt.
    ("qwen3", QWEN3_ASSISTANT + "<think>\n", "plan\n</think>\n\nAnswer", "plan\n", "Answer"),
    ("qwen3", QWEN3_ASSISTANT + "<think>\n", "still thinking", "still thinking", ""),
    ("qwen3", QWEN3_ASSISTANT + "<think>\n", "<think>again</think>ok", "again", "ok"),
    # enable_thinking=false: an empty section in the prompt, so only the answer is left.
    ("qwen3", QWEN3_ASSISTANT + "<think>\n\n</think>\n\n", "Answer", None, "Answer"),
    (
        "qwen3",
        QWEN3_ASSISTANT + "<think>\n\n</think>\n\n",
        "<think>x</think>y",
        None,
        "<think>x</think>y",
    ),
    (
        "deepseek_r1",
        "<｜Assistant｜></think>",
        "Not reasoning</think>",
        None,
        "Not reasoning</think>",
    ),
    # Thinking on, the model opens the section: history does not matter, only the end.
    ("qwen3", "<think>a</think>b<|im_end|>\n" + QWEN3_ASSISTANT, "<think>c</think>d", "c", "d"),
    ("qwen3", "<think>a" + QWEN3_ASSISTANT, "plain", None, "plain"),
    ("deepseek_r1", QWEN3_ASSISTANT, "hmm</think>ok", "hmm", "ok"),
    # Mistral: reasoning is asked for in the system prompt, which shows the tags.
    (
        "mistral",
        "[SYSTEM_PROMPT]Think in [THINK]...[/THINK].[/SYSTEM_PROMPT][INST]Hi[/INST]",
        "[THINK]plan[/THINK]answer",
        "plan",
        "answer",
    ),
    ("mistral", "[INST]Hi[/INST]", "answer", None, "answer"),
    ("mistral", "[INST]Hi[/INST][THINK]", "plan[/THINK]answer", "plan", "answer"),
]
ALL_REASONING_CASES = [
    (p, "", t, r, c) for p, t, r, c in REASONING_CASES
] + PROMPTED_REASONING_CASES


def _calls(calls: list[ToolCall]) -> Calls:
    return [(call.name, json.loads(call.arguments)) for call in calls]


def _splits(text: str) -> list[list[str]]:
    """The text cut into chunks: at every position, char by char, and at random."""
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    cuts.append(list(text))
    rng = random.Random(text)
    for _ in range(20):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        cuts.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    return cuts


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), TOOL_CASES)
def test_tool_parse(parser_name: str, text: str, content: str, calls: Calls) -> None:
    got_content, got_calls = make_tool_parser(parser_name, REQUEST_TOOLS).parse(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    for call in got_calls:  # arguments are re-serialized, unicode kept as is
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)


@pytest.mark.parametrize(("parser_name", "text", "content", "calls"), TOOL_CASES)
def test_tool_stream_agrees_with_parse(
    parser_name: str, text: str, content: str, calls: Calls
) -> None:
    parser = make_tool_parser(parser_name, REQUEST_TOOLS)
    for chunks in _splits(text):
        stream = parser.stream()
        streamed_content, streamed_calls = "", []
        for chunk in chunks:
            delta, new_calls = stream.feed(chunk)
            streamed_content += delta
            streamed_calls += new_calls
        delta, new_calls = stream.finish()
        assert streamed_content + delta == content, chunks
        assert _calls(streamed_calls + new_calls) == calls, chunks


def test_hermes_stream_emits_early() -> None:
    stream = make_tool_parser("hermes").stream()
    assert stream.feed("Checking <tool") == ("Checking ", [])  # may be a marker: held back
    content, calls = stream.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "" and _calls(calls) == [("f", {"a": 1})]  # before finish()
    assert stream.feed("\n<tool_call>\n{") == ("", [])
    assert stream.finish() == ("<tool_call>\n{", [])


@pytest.mark.parametrize(
    ("parser_name", "first", "second"),
    [
        ("llama3_json", '{"name": "a", "parameters": {}}', '; {"name": "b", "parameters": {}}'),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "a", "arguments": {}}',
            ', {"name": "b", "arguments": {}}',
        ),
        ("mistral", "[TOOL_CALLS]a[ARGS]{}", "[TOOL_CALLS]b[ARGS]{}"),
    ],
)
def test_json_calls_stream_as_each_completes(parser_name: str, first: str, second: str) -> None:
    stream = make_tool_parser(parser_name).stream()
    assert [call.name for call in stream.feed(first)[1]] == ["a"]
    assert [call.name for call in stream.feed(second[:-1])[1]] == []
    assert [call.name for call in stream.feed(second[-1])[1]] == ["b"]
    assert stream.finish() == ("", [])


def test_qwen3_coder_calls_stream_as_each_block_closes() -> None:
    stream = make_tool_parser("qwen3_coder", REQUEST_TOOLS).stream()
    assert stream.feed("Checking.\n<tool_") == ("Checking.\n", [])
    content, calls = stream.feed(CODER_WEATHER.removeprefix("<tool_")[:-1])
    assert (content, calls) == ("", [])  # the block is not closed yet
    content, calls = stream.feed(">\n<tool_call>\n<function=typed>\n<parameter=count>\n1")
    assert content == "" and _calls(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    content, calls = stream.feed("\n</parameter>\n</function>\n</tool_call>")
    assert content == "" and _calls(calls) == [("typed", {"count": 1})]
    assert stream.finish() == ("", [])


def test_qwen3_coder_types_values_only_by_the_request_tools() -> None:
    _, [call] = make_tool_parser("qwen3_coder").parse(CODER_WEATHER)
    assert json.loads(call.arguments) == {"city": "Paris", "days": "3"}  # no schema: text
    parser = make_tool_parser("hermes").for_request(REQUEST_TOOLS)
    assert parser.name == "hermes" and parser.tools == REQUEST_TOOLS
    _, [call] = make_tool_parser("qwen3_coder").for_request(REQUEST_TOOLS).parse(CODER_WEATHER)
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}


def test_mistral_call_ids() -> None:
    # Mistral's templates take only 9-character alphanumeric ids; the model's own are kept.
    text = "[TOOL_CALLS]a[CALL_ID]Ab3dE6gH9[ARGS]{}[TOOL_CALLS]b[ARGS]{}"
    _, calls = make_tool_parser("mistral").parse(text)
    assert calls[0].id == "Ab3dE6gH9" and re.fullmatch(r"[A-Za-z0-9]{9}", calls[1].id)
    _, calls = make_tool_parser("mistral").parse('[TOOL_CALLS][{"name": "a"}, {"name": "b"}]')
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", call.id) for call in calls)
    assert calls[0].id != calls[1].id


@pytest.mark.parametrize(
    ("template", "parser_name", "named"),
    [
        # Qwen3-Coder's template: XML calls inside <tool_call>, so not hermes.
        (
            "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
            "{{- '<parameter=' + args_name + '>\\n' }}",
            "qwen3_coder",
            True,
        ),
        ("<tool_call>\n{{ tool_call | tojson }}\n</tool_call>", "hermes", True),
        ("<function=name>{...}</function>", "hermes", False),  # no <parameter=: not Qwen3-Coder
        ("[TOOL_CALLS]", "mistral", True),
        (None, "hermes", False),
    ],
)
def test_tool_parser_for_template(template: str | None, parser_name: str, named: bool) -> None:
    assert tool_parser_for_template(template) == (parser_name, named)


def test_stream_content_before_marker_is_not_held_longer_than_needed() -> None:
    stream = make_tool_parser("mistral").stream()
    assert stream.feed("Hello [") == ("Hello ", [])
    assert stream.feed("x] more") == ("[x] more", [])


def test_llama3_holds_leading_blank_and_tag_prefix() -> None:
    stream = make_tool_parser("llama3_json").stream()
    assert stream.feed(" \n<|py") == ("", [])
    assert stream.feed("x") == (" \n<|pyx", [])
    assert stream.feed(' {"name": "a", "parameters": {}}') == (
        ' {"name": "a", "parameters": {}}',
        [],
    )


def test_call_ids_are_unique() -> None:
    _, calls = make_tool_parser("hermes").parse(WEATHER + WEATHER + WEATHER)
    ids = [call.id for call in calls]
    assert len(set(ids)) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call_id) for call_id in ids)


ARGS = {"city": "Zürich", "days": 3}

OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
OPENAI_CALLS = [
    {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGS)},
    },
    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
]


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "qwen3_coder"])
def test_render_calls_parses_back(parser_name: str) -> None:
    parser = make_tool_parser(parser_name, REQUEST_TOOLS)
    content, calls = parser.parse(parser.render_calls(OPENAI_CALLS))
    assert content == ""
    assert _calls(calls) == [("get_weather", ARGS), ("get_time", {})]


CALL_MARKERS = {
    "hermes": "<tool_call>",
    "llama3_json": '{"name": ',
    "mistral": "[TOOL_CALLS]",
    "qwen3_coder": "<function=",
}


@pytest.mark.parametrize("parser_name", sorted(CALL_MARKERS))
def test_render_tools_lists_every_tool(parser_name: str) -> None:
    parser = make_tool_parser(parser_name)
    prompt = parser.render_tools(OPENAI_TOOLS)
    for tool in OPENAI_TOOLS:
        assert json.dumps(tool, ensure_ascii=False) in prompt
    assert CALL_MARKERS[parser_name] in prompt  # it shows how a call is written


def test_aliases() -> None:
    assert TOOL_PARSERS["qwen25"] is TOOL_PARSERS["qwen"] is TOOL_PARSERS["hermes"]
    assert TOOL_PARSERS["llama3"] is TOOL_PARSERS["llama3_json"]
    assert make_tool_parser("qwen").name == "hermes"


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError, match="hermes"):
        make_tool_parser("nope")
    with pytest.raises(ValueError, match="deepseek_r1"):
        make_reasoning_parser("nope")


@pytest.mark.parametrize(
    ("parser_name", "prompt", "text", "reasoning", "content"), ALL_REASONING_CASES
)
def test_reasoning_parse(
    parser_name: str, prompt: str, text: str, reasoning: str | None, content: str
) -> None:
    assert make_reasoning_parser(parser_name).parse(text, prompt) == (reasoning, content)


@pytest.mark.parametrize(
    ("parser_name", "prompt", "text", "reasoning", "content"), ALL_REASONING_CASES
)
def test_reasoning_stream_agrees_with_parse(
    parser_name: str, prompt: str, text: str, reasoning: str | None, content: str
) -> None:
    parser = make_reasoning_parser(parser_name)
    for chunks in _splits(text):
        stream = parser.stream(prompt)
        deltas = [stream.feed(chunk) for chunk in chunks] + [stream.finish()]
        streamed_reasoning = "".join(r for r, _ in deltas) or None
        streamed_content = "".join(c for _, c in deltas)
        assert (streamed_reasoning, streamed_content) == (reasoning, content), chunks


def test_reasoning_stream_emits_early() -> None:
    stream = make_reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>abc</th") == ("abc", "")
    assert stream.feed("ink>\n") == ("", "")
    assert stream.feed("\nX") == ("", "X")
    assert stream.finish() == ("", "")


def test_reasoning_registry() -> None:
    assert sorted(REASONING_PARSERS) == ["deepseek-r1", "deepseek_r1", "mistral", "qwen3"]


def test_held_back() -> None:
    assert held_back("abc<to", ["<tool_call>"]) == 3
    assert held_back("abc", ["<tool_call>"]) == 0
    assert held_back("x<tool_call>", ["<tool_call>"]) == 0  # a whole marker is not held
    assert held_back("ab", ["abc", "bx"]) == 2
    assert held_back("", ["abc"]) == 0
    assert held_back("abc", []) == 0
    assert held_back("abc", [""]) == 0


def test_held_back_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        text = "".join(rng.choice("ab<") for _ in range(rng.randint(0, 8)))
        markers = ["".join(rng.choice("ab<") for _ in range(rng.randint(0, 5))) for _ in range(3)]
        expected = max(
            (k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])), default=0
        )
        assert held_back(text, markers) == expected, (text, markers)
