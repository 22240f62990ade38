"""SGLang's native API against `specmesh up` (real services, real NATS): /generate
(batched, streamed, logprobs), /tokenize and /detokenize, /health_generate and
/flush_cache; and the SGLang flags --chat-template and --stream-interval."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema_rs
import pytest
from deployment import openai_client, specmesh_up
from helpers import WEATHER_PARAMETERS

QUESTION = "What is the capital of France?"
# A long prompt (several KV blocks) for the prefix cache.
LONG = "Read this list and say which fruit is red: " + ", ".join(
    f"item {i} is a {fruit}" for i, fruit in enumerate(["pear", "lime", "plum", "fig"] * 4)
)
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
STREAM_INTERVAL = 3


@pytest.fixture(scope="module")
def url(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    args = ["--chat-template", str(template), "--stream-interval", str(STREAM_INTERVAL)]
    with specmesh_up(smollm_dir, *args, "--random-seed", "7") as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=300)


def ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def greedy(max_new_tokens: int = 12, **extra: object) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


def test_tokenize_and_detokenize_round_trip(url: str) -> None:
    one = ok(post(url, "/tokenize", {"prompt": QUESTION}))
    assert one["count"] == len(one["tokens"]) > 3 and one["max_model_len"] > 0
    back = ok(post(url, "/detokenize", {"tokens": one["tokens"]}))
    assert back["text"] == QUESTION
    both = ok(post(url, "/v1/tokenize", {"prompt": [QUESTION, "hi"]}))
    assert both["tokens"][0] == one["tokens"] and both["count"] == [one["count"], 1]
    texts = ok(post(url, "/detokenize", {"tokens": both["tokens"]}))["text"]
    assert texts == [QUESTION, "hi"]


def test_tokenize_bad_input_is_400(url: str) -> None:
    response = post(url, "/detokenize", {"tokens": [10**8]})
    assert response.status_code == 400
    assert "token ids must be in" in response.json()["error"]["message"]
    assert post(url, "/tokenize", {"prompt": 3}).status_code == 400


def test_generate_matches_completions(url: str) -> None:
    out = ok(post(url, "/generate", {"text": QUESTION, "sampling_params": greedy()}))
    completion = ok(
        post(url, "/v1/completions", {"prompt": QUESTION, "max_tokens": 12, "temperature": 0})
    )
    assert out["text"] == completion["choices"][0]["text"]
    meta = out["meta_info"]
    assert meta["completion_tokens"] == len(out["output_ids"])
    assert meta["prompt_tokens"] == completion["usage"]["prompt_tokens"]
    assert meta["finish_reason"]["type"] in ("length", "stop") and meta["e2e_latency"] > 0
    assert ok(post(url, "/detokenize", {"tokens": out["output_ids"]}))["text"] == out["text"]


def test_generate_batch_ids_and_logprobs(url: str) -> None:
    ids = ok(post(url, "/tokenize", {"prompt": QUESTION}))["tokens"]
    single = ok(post(url, "/generate", {"input_ids": ids, "sampling_params": greedy(6)}))
    body = {
        "text": [QUESTION, "Say hi."],
        "sampling_params": greedy(6),
        "rid": ["a", "b"],
        "return_logprob": True,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    batch = ok(post(url, "/generate", body))
    assert [r["meta_info"]["id"] for r in batch] == ["a", "b"]
    assert batch[0]["output_ids"] == single["output_ids"]
    meta = batch[0]["meta_info"]
    assert [e[1] for e in meta["output_token_logprobs"]] == batch[0]["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])
    params = {"n": 2, "sampling_seed": 1, "max_new_tokens": 6}
    choices = ok(post(url, "/generate", {"text": QUESTION, "sampling_params": params}))
    assert len(choices) == 2 and all(c["meta_info"]["completion_tokens"] for c in choices)


def test_generate_stream_is_cumulative_and_gathered(url: str) -> None:
    body = {"text": QUESTION, "sampling_params": greedy(12, ignore_eos=True), "stream": True}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=300) as response:
        assert response.status_code == 200
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    whole = ok(post(url, "/generate", {**body, "stream": False}))
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    # --stream-interval 3: the decode worker sends a request's tokens three at a time.
    assert len(chunks) <= 12 // STREAM_INTERVAL + 1


@pytest.mark.parametrize(
    "sampling_params",
    [
        {"max_new_tokens": 0},
        {"unknown_knob": 1},
        {"json_schema": '{"type": "flower"}'},
        {"regex": "a", "ebnf": 'root ::= "a"'},
        {"min_new_tokens": 20, "max_new_tokens": 8},
    ],
)
def test_generate_bad_sampling_params_are_400(url: str, sampling_params: dict) -> None:
    response = post(url, "/generate", {"text": QUESTION, "sampling_params": sampling_params})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_generate_with_a_json_schema(url: str) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 20}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    params = greedy(24, json_schema=json.dumps(schema))
    out = ok(post(url, "/generate", {"text": QUESTION, "sampling_params": params}))
    assert jsonschema_rs.validator_for(schema).is_valid(json.loads(out["text"]))
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_generate_needs_one_prompt_form(url: str) -> None:
    assert post(url, "/generate", {"sampling_params": greedy()}).status_code == 400
    both = {"text": "a", "input_ids": [1], "sampling_params": greedy()}
    assert post(url, "/generate", both).status_code == 400


def test_health_generate(url: str) -> None:
    assert httpx.get(f"{url}/health_generate", timeout=60).status_code == 200


def test_flush_cache_drops_the_prefix_cache(url: str) -> None:
    body = {"text": LONG, "sampling_params": greedy(2)}
    ok(post(url, "/generate", body))
    assert ok(post(url, "/generate", body))["meta_info"]["cached_tokens"] >= 16
    flushed = httpx.post(f"{url}/flush_cache", timeout=60)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    assert ok(post(url, "/generate", body))["meta_info"]["cached_tokens"] == 0


def test_chat_template_flag(url: str) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    chat = ok(post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}))
    rendered = TEMPLATE.replace("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n", "")
    prompt = f"[user] {QUESTION}\n" + rendered.replace("{% endfor %}", "")
    count = ok(post(url, "/tokenize", {"prompt": prompt, "add_special_tokens": False}))["count"]
    assert chat["usage"]["prompt_tokens"] == count


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "the local time"}},
]
TOOL_PROMPTS = ["Weather in Lima?", "Is it cold in Oslo?", "What time is it in Rome?"]


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls_without_parser_flags(url: str, stream: bool) -> None:
    """No --tool-call-parser here: the format comes from the chat template (hermes by
    default), and a grammar makes every forced call parse and fit its schema."""
    client = openai_client(url, max_retries=0)
    validator = jsonschema_rs.validator_for(WEATHER_PARAMETERS)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for prompt in TOOL_PROMPTS:
        for choice in (named, "required"):
            args = {"model": "", "messages": [{"role": "user", "content": prompt}]}
            args |= {"tools": TOOLS, "tool_choice": choice, "temperature": 0, "max_tokens": 60}
            args |= {"parallel_tool_calls": False}  # this template's model would call on
            if stream:
                chunks = list(client.chat.completions.create(**args, stream=True))
                deltas = [c.choices[0].delta.tool_calls or [] for c in chunks if c.choices]
                calls = [(d.function.name, d.function.arguments) for ds in deltas for d in ds]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            else:
                out = client.chat.completions.create(**args).choices[0]
                calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
                finish = out.finish_reason
            assert finish == "tool_calls" and calls, (prompt, choice)
            for name, arguments in calls:
                assert name in ("get_weather", "get_time") and (
                    choice != named or name == "get_weather"
                )
                if name == "get_weather":
                    assert validator.is_valid(json.loads(arguments)), arguments
