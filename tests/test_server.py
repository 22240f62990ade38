"""`specmesh up` as a user runs it: a real process, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from deployment import chat, specmesh_up
from specmesh.shared.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Give two reasons to learn Rust.",
]


@pytest.fixture(scope="module")
def server(smollm_dir: Path) -> Iterator[str]:
    with specmesh_up(smollm_dir) as url:
        yield url


@pytest.fixture(scope="module")
def ngram_server(smollm_dir: Path) -> Iterator[str]:
    with specmesh_up(smollm_dir, "--speculative-algorithm", "NGRAM") as url:
        yield url


def test_models_and_health(server: str) -> None:
    data = httpx.get(f"{server}/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["SmolLM2-135M-Instruct"]
    assert data[0]["max_model_len"] > 0  # what the decode workers advertise
    info = httpx.get(f"{server}/get_model_info").json()
    assert info["is_generation"] and info["max_model_len"] == data[0]["max_model_len"]


def test_greedy_chat_equals_transformers(server: str, smollm_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()
    tok = Tokenizer(smollm_dir)
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
        expected = tok.decode(out[0, len(ids) :].tolist())
        body = chat(server, prompt, temperature=0, max_tokens=64).json()
        assert body["choices"][0]["message"]["content"] == expected
        assert body["usage"]["prompt_tokens"] == len(ids)


def test_streaming_equals_non_streaming(server: str) -> None:
    args = {"temperature": 0, "max_tokens": 40}
    full = chat(server, PROMPTS[1], **args).json()["choices"][0]["message"]["content"]
    body = {
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **args,
    }
    with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=300) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and deltas[0]["content"]
    assert "".join(d.get("content", "") for d in deltas) == full
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert sum(f is not None for f in finishes) == 1 and finishes[-1] is not None
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_stop_string_cuts_the_text(server: str) -> None:
    full = chat(server, PROMPTS[0], temperature=0, max_tokens=30).json()
    text = full["choices"][0]["message"]["content"]
    assert "Paris" in text
    cut = chat(server, PROMPTS[0], temperature=0, max_tokens=30, stop=["Paris"]).json()
    assert cut["choices"][0]["message"]["content"] == text[: text.index("Paris")]
    assert cut["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"temperature": 3}, 400, "temperature"),
        ({"max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "no-such-model"}, 404, "model"),
        ({"max_tokens": 10**7}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors(
    server: str, extra: dict[str, object], status: int, param: str | None
) -> None:
    r = chat(server, "hi", **extra)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
    assert httpx.get(f"{server}/health").status_code == 200


def test_server_info_reports_engine_state(server: str) -> None:
    state = httpx.get(f"{server}/get_server_info").json()["internal_states"][0]
    assert state["kv_blocks_total"] >= state["kv_blocks_free"] > 0
    assert state["generated_tokens"] > 0


def test_ngram_speculation_over_http_is_lossless(server: str, ngram_server: str) -> None:
    prompt = "Repeat exactly: red green blue, red green blue, red green blue."
    for stream in (False, True):
        args = {"temperature": 0, "max_tokens": 48}
        plain = chat(server, prompt, **args).json()["choices"][0]["message"]["content"]
        if stream:
            body = {"messages": [{"role": "user", "content": prompt}], "stream": True, **args}
            with httpx.stream(
                "POST", f"{ngram_server}/v1/chat/completions", json=body, timeout=300
            ) as r:
                events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: {")]
            deltas = [json.loads(e)["choices"][0]["delta"] for e in events]
            spec = "".join(d.get("content", "") for d in deltas)
        else:
            body = chat(ngram_server, prompt, **args).json()
            spec = body["choices"][0]["message"]["content"]
            per_request = body["metrics"]["speculative_decoding"]
            assert per_request["num_spec_steps"] > 0
            assert per_request["mean_acceptance_length"] >= 1.0
        assert spec == plain
    state = httpx.get(f"{ngram_server}/get_server_info").json()["internal_states"][0]
    assert state["speculative_algorithm"] == "NGRAM"
    assert state["avg_spec_accept_length"] > 1.0
