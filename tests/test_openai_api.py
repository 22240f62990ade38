"""The gateway through the official `openai` client, against `specmesh up` (real
services, real NATS): every request field, streaming and not, tools, reasoning,
errors, API keys, limits and cancellation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema_rs
import openai
import pytest
from deployment import openai_client, sample, scrape, specmesh_up
from specmesh.shared.infra import free_port, start_nats

QUESTION = "What is the capital of France?"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def deployment(smollm_dir: Path) -> Iterator[tuple[str, Path]]:
    log = Path(tempfile.mkdtemp()) / "up.log"
    args = ["--speculative-algorithm", "NGRAM", "--tool-call-parser", "hermes"]
    with specmesh_up(smollm_dir, *args, log=log) as url:
        yield url, log


@pytest.fixture(scope="module")
def url(deployment: tuple[str, Path]) -> str:
    return deployment[0]


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai_client(url, max_retries=0, timeout=300)


def metrics_urls(log: Path, kind: str) -> list[str]:
    """The /metrics URLs `specmesh up` listed for the instances of one kind."""
    return [
        line.split()[-1]
        for line in log.read_text().splitlines()
        if line.strip().startswith(f"{kind}-") and line.strip().endswith("/metrics")
    ]


def sse_events(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# --- models, chat and streaming -------------------------------------------------


def test_models(client: openai.OpenAI) -> None:
    [card] = client.models.list().data
    assert card.id == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(card.id).id == card.id
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["type"] == "not_found_error"


def test_chat_streaming_equals_non_streaming_for_every_choice(client: openai.OpenAI) -> None:
    args = {"model": "SmolLM2-135M-Instruct", "messages": user(QUESTION), "max_tokens": 24}
    args |= {"n": 2, "temperature": 0}
    full = client.chat.completions.create(**args)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content == full.choices[1].message.content  # greedy
    assert "Paris" in full.choices[0].message.content
    chunks = list(
        client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    texts, finishes, roles = ["", ""], [[], []], [[], []]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index].append(choice.delta.role)
        finishes[choice.index].append(choice.finish_reason)
    for i in range(2):
        assert texts[i] == full.choices[i].message.content
        assert roles[i][0] == "assistant" and set(roles[i][1:]) <= {None}
        assert sum(f is not None for f in finishes[i]) == 1
        assert finishes[i][-1] == full.choices[i].finish_reason
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_stream_framing(url: str) -> None:
    """No role-only chunk ahead of the first token, one [DONE], usage only when asked."""
    body = {"messages": user(QUESTION), "max_tokens": 8, "temperature": 0, "stream": True}
    events = sse_events(url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant" and first["content"]
    assert all(c["choices"] for c in chunks) and "usage" not in chunks[-1]


def test_message_roles_and_content_parts(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "developer", "content": [{"type": "text", "text": "Be polite."}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello! "}, {"type": "text", "text": QUESTION}],
        },
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    out = client.chat.completions.create(messages=messages, max_tokens=12, temperature=0, model="")
    assert out.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not fetched"):
        image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
        client.chat.completions.create(messages=[{"role": "user", "content": [image]}], model="")
    with pytest.raises(openai.BadRequestError, match="no vision encoder"):  # a text-only model
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        client.chat.completions.create(messages=[{"role": "user", "content": [image]}], model="")
    with pytest.raises(openai.BadRequestError, match="content parts"):
        audio = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}
        client.chat.completions.create(messages=[{"role": "user", "content": [audio]}], model="")


def test_sampling_fields(client: openai.OpenAI) -> None:
    def text(**extra: object) -> str:
        out = client.chat.completions.create(
            model="", messages=user("Tell me a story."), max_tokens=16, **extra
        )
        return out.choices[0].message.content

    seeded = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
    assert text(**seeded) == text(**seeded)
    extra = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True}
    text(presence_penalty=0.5, frequency_penalty=0.5, user="u-1", extra_body=extra)
    text(stop=None)
    text(response_format={"type": "json_object"}, reasoning_effort="low")
    text(extra_body={"chat_template_kwargs": {"enable_thinking": False}, "not_a_field": 1})
    seeded_n = client.chat.completions.create(
        model="", messages=user("Tell me a story."), max_tokens=16, n=2, **seeded
    )
    assert seeded_n.choices[0].message.content != seeded_n.choices[1].message.content


def test_token_limits_and_stop(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="", messages=user(QUESTION), max_completion_tokens=5, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    full = client.chat.completions.create(model="", messages=user(QUESTION), temperature=0)
    assert full.choices[0].finish_reason == "stop"  # no max_tokens: up to the context's end
    text = full.choices[0].message.content
    for stop in ("Paris", ["Paris", "zzz"]):
        cut = client.chat.completions.create(
            model="", messages=user(QUESTION), temperature=0, stop=stop
        )
        assert cut.choices[0].message.content == text[: text.index("Paris")]
        assert cut.choices[0].finish_reason == "stop"


def test_chat_logprobs(client: openai.OpenAI) -> None:
    args = {"model": "", "messages": user(QUESTION), "max_tokens": 6, "temperature": 0}
    out = client.chat.completions.create(**args, logprobs=True, top_logprobs=3)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens == 6
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    streamed = client.chat.completions.create(**args, logprobs=True, stream=True)
    tokens = [e.token for c in streamed for e in (c.choices[0].logprobs.content or [])]
    assert tokens == [e.token for e in entries]


# --- completions ----------------------------------------------------------------


def test_completions_prompt_forms(client: openai.OpenAI, smollm_dir: Path) -> None:
    from specmesh.shared.tokenizer import Tokenizer

    prompt = "The capital of France is"
    args = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0}
    one = client.completions.create(prompt=prompt, **args)
    assert one.object == "text_completion" and one.choices[0].text
    ids = Tokenizer(smollm_dir).encode(prompt)
    assert client.completions.create(prompt=ids, **args).choices[0].text == one.choices[0].text
    many = client.completions.create(prompt=[prompt, "One, two, three,"], n=2, **args)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.choices[0].text == many.choices[1].text == one.choices[0].text
    assert many.usage.prompt_tokens == len(ids) + len(
        Tokenizer(smollm_dir).encode("One, two, three,")
    )
    by_ids = client.completions.create(prompt=[ids, ids], **args)
    assert [c.text for c in by_ids.choices] == [one.choices[0].text] * 2
    echoed = client.completions.create(prompt=prompt, echo=True, best_of=1, **args)
    assert echoed.choices[0].text == prompt + one.choices[0].text


def test_completions_streaming_and_logprobs(client: openai.OpenAI) -> None:
    args = {"model": "", "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    full = client.completions.create(**args, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    # Leniently: the package types a streamed chunk's finish_reason as set, which OpenAI's
    # own stream (and ours) leaves null until the last chunk.
    lenient = openai.OpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
    chunks = list(
        lenient.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10


# --- tools ----------------------------------------------------------------------


def weather_history() -> list[dict]:
    """A worked example first: a 135M model follows the call format it has seen."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "London"}'},
    }
    return [
        *user("What is the weather like in London?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "rainy", "celsius": 12}'},
        {"role": "assistant", "content": "It is rainy in London, 12 degrees."},
        *user("What is the weather like in Paris?"),
    ]


def tool_calls(chunks: Iterator) -> tuple[list[tuple[str, str]], str]:
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [(t.function.name, t.function.arguments) for d in deltas for t in d.tool_calls or []]
    return calls, "".join(d.content or "" for d in deltas)


def test_tool_choice(client: openai.OpenAI) -> None:
    args = {"model": "", "messages": weather_history(), "tools": [WEATHER_TOOL, TIME_TOOL]}
    args |= {"temperature": 0, "max_tokens": 60}
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(**args, tool_choice=named).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None
    [call] = out.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    streamed = client.chat.completions.create(**args, tool_choice=named, stream=True)
    assert tool_calls(streamed) == ([("get_weather", call.function.arguments)], "")
    for choice in ("required", "auto"):  # a grammar forces a call; auto may or may not call
        out = client.chat.completions.create(**args, tool_choice=choice).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in out.message.tool_calls or []]
        for _, arguments in calls:
            assert isinstance(json.loads(arguments), dict)
        assert (out.finish_reason == "tool_calls") == bool(calls)
        assert bool(calls) or choice == "auto"
        streamed = client.chat.completions.create(**args, tool_choice=choice, stream=True)
        assert tool_calls(streamed) == (calls, out.message.content or "")


def test_tool_choice_none_and_history(client: openai.OpenAI) -> None:
    args = {"model": "", "tools": [WEATHER_TOOL], "temperature": 0, "max_tokens": 20}
    out = client.chat.completions.create(
        **args, messages=user("Weather in Paris?"), tool_choice="none"
    )
    assert out.choices[0].message.tool_calls is None and out.choices[0].message.content
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    history = [
        *user("Weather in Paris?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny", "celsius": 21}'},
    ]
    answer = client.chat.completions.create(**args, messages=history)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_must_name_a_tool(client: openai.OpenAI) -> None:
    bad = {"type": "function", "function": {"name": "nope"}}
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(
            model="", messages=user("hi"), tools=[WEATHER_TOOL], tool_choice=bad
        )


# --- structured outputs ---------------------------------------------------------

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"enum": ["France", "Japan", "Peru"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
    },
    "required": ["city", "country", "population"],
    "additionalProperties": False,
}


def city_format() -> dict:
    return {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    args = {"model": "", "messages": user("Describe Paris."), "temperature": 0, "max_tokens": 48}
    out = client.chat.completions.create(**args, response_format=city_format())
    text = out.choices[0].message.content
    assert jsonschema_rs.validator_for(CITY_SCHEMA).is_valid(json.loads(text))
    assert out.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(**args, response_format=city_format(), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    plain = client.chat.completions.create(**args, response_format={"type": "json_object"})
    assert isinstance(json.loads(plain.choices[0].message.content), dict)


def test_regex_and_ebnf_extras(client: openai.OpenAI) -> None:
    args = {"model": "", "temperature": 0, "max_tokens": 12}
    out = client.completions.create(
        **args, prompt="Is water wet?", extra_body={"regex": "(Yes|No)\\."}
    )
    assert out.choices[0].text in ("Yes.", "No.")
    ebnf = 'root ::= "The answer is " [0-9]+ "."'
    out = client.chat.completions.create(
        **args, messages=user("What is 6 times 7?"), extra_body={"ebnf": ebnf}
    )
    assert re.fullmatch(r"The answer is [0-9]+\.", out.choices[0].message.content)


def test_responses_text_format(client: openai.OpenAI) -> None:
    text_format = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    out = client.responses.create(
        model="",
        input="Describe Tokyo.",
        temperature=0,
        max_output_tokens=48,
        text={"format": text_format},
    )
    assert jsonschema_rs.validator_for(CITY_SCHEMA).is_valid(json.loads(out.output_text))
    assert out.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra, says",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "flower"}},
                }
            },
            "flower",
        ),
        ({"regex": "a(?=b)"}, "look-around"),
        ({"ebnf": 'root ::= "a" missing'}, "missing"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one"),
    ],
)
def test_bad_grammars_get_400(url: str, extra: dict, says: str) -> None:
    body = {"messages": user("hi"), "max_tokens": 4, **extra}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert says in response.json()["error"]["message"]
    assert (
        httpx.post(
            f"{url}/v1/chat/completions", json={**body, **{k: None for k in extra}}, timeout=60
        ).status_code
        == 200
    )


# --- errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": user("hi"), "temperature": 5}, "temperature"),
        ({"messages": user("hi"), "n": 0}, "n"),
        ({"messages": user("hi"), "max_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": user("hi"), "top_logprobs": 2}, None),
        ({"messages": user("hi"), "stream_options": {"include_usage": True}}, None),
        ({"messages": user("hi"), "response_format": {"type": "yaml"}}, "response_format.type"),
        ({"messages": user("hi"), "max_tokens": 10**6}, None),
    ],
)
def test_bad_requests_get_400(url: str, body: dict, param: str | None) -> None:
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"] and error["code"] == 400
    if param is not None:
        assert error["param"] == param
    assert httpx.get(f"{url}/health").status_code == 200


def test_malformed_json_and_unknown_routes(url: str) -> None:
    response = httpx.post(
        f"{url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and response.json()["error"]["message"]
    missing = httpx.get(f"{url}/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    wrong = httpx.get(f"{url}/v1/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=user("hi"))
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hi")


def test_too_large_is_413(url: str) -> None:
    body = {"messages": user("x" * (5 << 20))}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 413 and response.json()["error"]["code"] == 413


# --- cancellation ---------------------------------------------------------------


def _decode_idle(log: Path) -> bool:
    samples = [scrape(u) for u in metrics_urls(log, "decode")]
    return all(sample(s, "specmesh_active_requests", service="decode") == 0 for s in samples)


def _wait_idle(log: Path, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not _decode_idle(log):
        assert time.monotonic() < deadline, "the decode worker still runs the request"
        time.sleep(0.2)


def test_client_disconnect_aborts_everywhere(deployment: tuple[str, Path]) -> None:
    url, log = deployment
    long = {"messages": user("Write a long story."), "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**long, "stream": True}, timeout=60
    ) as response:
        lines = response.iter_lines()
        deadline = time.monotonic() + 10
        while _decode_idle(log):  # the gauge follows heartbeats (every second)
            assert time.monotonic() < deadline, "the request never showed up on decode"
            next(lines)
    _wait_idle(log)
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up
        httpx.post(f"{url}/v1/chat/completions", json=long, timeout=2)
    _wait_idle(log)
    free = [
        sample(scrape(u), "specmesh_kv_blocks_used", service="decode")
        for u in metrics_urls(log, "decode")
    ]
    assert free == [0.0] * len(free)


# --- other deployments: API key, reasoning, load limits, no workers -------------


@pytest.fixture(scope="module")
def guarded(smollm_dir: Path) -> Iterator[str]:
    args = ["--reasoning-parser", "deepseek_r1", "--max-pending-requests", "2"]
    with specmesh_up(smollm_dir, *args, env={"SPECMESH_API_KEY": "sk-test"}) as url:
        yield url


def test_api_key(guarded: str) -> None:
    for key in ("wrong", None):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.get(f"{guarded}/v1/models", headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai_client(guarded, "nope").models.list()
    good = openai_client(guarded, "sk-test")
    assert good.models.list().data
    assert httpx.get(f"{guarded}/health").status_code == 200  # probes need no key
    assert httpx.get(f"{guarded}/metrics").status_code == 200
    assert httpx.get(f"{guarded}/get_server_info").status_code == 401  # paths stay private
    key = {"Authorization": "Bearer sk-test"}
    assert httpx.get(f"{guarded}/get_server_info", headers=key).status_code == 200


def test_an_empty_api_key_is_refused() -> None:
    up = [sys.executable, "-m", "specmesh.services.cli", "up", "--api-key", ""]
    result = subprocess.run(up, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "--api-key (or SPECMESH_API_KEY) is empty" in result.stderr


def test_reasoning_parser(guarded: str) -> None:
    client = openai_client(guarded, "sk-test")
    args = {"model": "", "messages": user(QUESTION), "temperature": 0, "max_tokens": 16}
    out = client.chat.completions.create(**args).choices[0].message
    # deepseek_r1: the template opened <think>, so text before </think> is reasoning.
    assert out.reasoning_content and not out.content
    streamed = client.chat.completions.create(**args, stream=True)
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in streamed
    )
    assert reasoning == out.reasoning_content


def test_overload_is_429(guarded: str) -> None:
    client = openai_client(guarded, "sk-test", max_retries=0)
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="", messages=user("hi"), n=3, max_tokens=4)
    assert client.chat.completions.create(model="", messages=user("hi"), n=2, max_tokens=4)


def test_no_workers_is_503(smollm_dir: Path) -> None:
    nats = start_nats()
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specmesh.services.gateway",
            "--nats-url",
            nats.url,
            "--port",
            str(port),
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                health = httpx.get(f"{url}/health")
                break
            except httpx.ConnectError:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        assert health.status_code == 503
        response = httpx.post(f"{url}/v1/chat/completions", json={"messages": user("hi")})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable_error"
    finally:
        gateway.terminate()
        gateway.wait(30)
        nats.stop()


# --- the Responses API ----------------------------------------------------------

RESPONSES_WEATHER_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # flat


def test_responses_text_with_instructions(client: openai.OpenAI) -> None:
    instructions = "You are a helpful assistant."
    out = client.responses.create(
        model="SmolLM2-135M-Instruct",
        instructions=instructions,
        input=QUESTION,
        max_output_tokens=24,
        temperature=0,
        metadata={"run": "1"},
        store=True,
    )
    assert out.object == "response" and out.id.startswith("resp_")
    assert out.status == "completed" and out.incomplete_details is None and out.error is None
    [message] = out.output
    assert message.type == "message" and message.status == "completed"
    assert [part.type for part in message.content] == ["output_text"]
    assert out.instructions == instructions and out.metadata == {"run": "1"}
    assert out.store is False and out.temperature == 0 and out.max_output_tokens == 24
    # the same prompt and text as chat with the instructions as its system message
    chat = client.chat.completions.create(
        model="",
        messages=[{"role": "system", "content": instructions}, *user(QUESTION)],
        max_tokens=24,
        temperature=0,
    )
    assert out.output_text == chat.choices[0].message.content and "Paris" in out.output_text
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_responses_max_output_tokens_is_incomplete(client: openai.OpenAI, url: str) -> None:
    body = {"input": "Write a long story.", "max_output_tokens": 4}
    out = client.responses.create(model="", **body)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 4 and out.output[0].status == "incomplete"
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert names == [event["type"] for event in events] and names[-1] == "response.incomplete"


def test_responses_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    args = {"model": "", "input": QUESTION, "max_output_tokens": 24, "temperature": 0}
    full = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    types = [event.type for event in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{full.status}",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events[4:-4])
    assert text == events[-4].text == events[-1].response.output_text == full.output_text
    assert events[2].item.id == events[4].item_id == events[-2].item.id
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens


def test_responses_function_calls(client: openai.OpenAI) -> None:
    ask = "And in Paris?"
    history = [  # a worked example first, as in weather_history, in input items
        {"role": "user", "content": "What is the weather like in London?"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "London"}',
        },
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": '{"sky": "rainy", "celsius": 12}',
        },
        {"role": "assistant", "content": "It is rainy in London, 12 degrees."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ask}]},
    ]
    args = {"model": "", "tools": [RESPONSES_WEATHER_TOOL], "temperature": 0}
    args |= {"max_output_tokens": 40, "tool_choice": "required"}  # the call's tags count
    out = client.responses.create(**args, input=history)
    [call] = out.output
    assert call.type == "function_call" and call.status == "completed" and out.status == "completed"
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    events = list(client.responses.create(**args, input=history, stream=True))
    assert [event.type for event in events[2:]] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-2].item.arguments == events[-3].arguments == call.arguments
    # the SDK's loop: the output back in the input, followed by the call's result
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    turn = [item.model_dump(exclude_none=True) for item in out.output]
    args |= {"tool_choice": "auto", "max_output_tokens": 8}
    assert client.responses.create(**args, input=[*history, *turn, result]).output


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "does not store responses"),
        ({"background": True}, "background", "does not store responses"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type", "only function tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
            "only text",
        ),
    ],
)
def test_responses_refuse_what_this_server_lacks(
    url: str, extra: dict, param: str, says: str
) -> None:
    response = httpx.post(f"{url}/v1/responses", json={"input": "hi", **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"]


def test_responses_reasoning_item(guarded: str) -> None:
    client = openai_client(guarded, "sk-test")
    args = {"model": "", "input": QUESTION, "temperature": 0, "max_output_tokens": 16}
    out = client.responses.create(**args, reasoning={"effort": "low"})
    [reasoning] = out.output  # deepseek_r1: all 16 tokens are still thinking
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert out.reasoning.effort == "low" and out.output_text == ""
    events = client.responses.create(**args, reasoning={"effort": "low"}, stream=True)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == reasoning.content[0].text
