"""Hostile requests against a running `specmesh up`: each gets a short 4xx quickly, no
service exits, and a canary chat sent beside it keeps its text and its pace."""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from deployment import chat_text, listing, scrape, specmesh_up
from specmesh.shared.infra import start_nats

CANARY = "Name three colours."
CANARY_TOKENS = 12
HEADER_TIMEOUT_S = 2  # the deployment's, shorter than the default to keep the test short


def chain_grammar(rules: int) -> str:
    """GBNF whose rules nest `rules` deep: slow to convert, deep to compile."""
    body = "\n".join(f'r{k} ::= "x{k}" r{k + 1} | "y"' for k in range(rules))
    return f'root ::= r0\n{body}\nr{rules} ::= "z"\n'


class Deployment:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def pid(self, kind: str) -> int:
        return listing(self.log)[f"{kind}-0"][0]

    def restarts(self) -> float:
        samples = scrape(listing(self.log)["specmesh-up"][1])
        name = "specmesh_service_restarts_total"
        return sum(value for (sample, _), value in samples.items() if sample == name)

    def canary(self) -> tuple[str, float]:
        start = time.monotonic()
        text = chat_text(self.url, CANARY, temperature=0, max_tokens=CANARY_TOKENS)
        return text, time.monotonic() - start


@pytest.fixture(scope="module")
def deployment(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log = tmp_path_factory.mktemp("hostile") / "up.log"
    up = ["--header-timeout", str(HEADER_TIMEOUT_S)]
    with start_nats() as nats, specmesh_up(smollm_dir, "--nats-url", nats.url, *up, log=log) as url:
        yield Deployment(url, log)


@pytest.fixture(scope="module")
def canary_alone(deployment: Deployment) -> tuple[str, float]:
    """The canary's text and its time with nothing else running (the faster of two)."""
    runs = [deployment.canary() for _ in range(2)]
    assert runs[0][0] == runs[1][0]
    return runs[0][0], min(seconds for _, seconds in runs)


def beside_canary(
    deployment: Deployment, canary_alone: tuple[str, float], probe: Callable[[], httpx.Response]
) -> httpx.Response:
    """`probe()` with the canary sent at the same time; checks the probe's answer (a 4xx in
    OpenAI's error shape, short, within 2 s) and the canary's (same text, within 2x its
    time alone + 1 s)."""
    canary: list[tuple[str, float]] = []
    thread = threading.Thread(target=lambda: canary.append(deployment.canary()))
    thread.start()
    start = time.monotonic()
    response = probe()
    seconds = time.monotonic() - start
    thread.join()
    assert 400 <= response.status_code < 500, response.text[:500]
    assert seconds < 2, f"answered in {seconds:.1f} s"
    error = response.json()["error"]
    assert len(error["message"]) < 500, error["message"][:500]
    text, canary_seconds = canary[0]
    assert text == canary_alone[0]
    assert canary_seconds < 2 * canary_alone[1] + 1
    return response


def post_chat(url: str, **body: object) -> httpx.Response:
    messages = [{"role": "user", "content": "Say yes."}]
    body = {"messages": messages, "max_tokens": 8, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


GRAMMARS = {
    "ebnf_10000_nested_rules": {"ebnf": chain_grammar(10_000)},
    "ebnf_2000_nested_rules": {"ebnf": chain_grammar(2_000)},
    "regex_nested_repeats": {"regex": "(a{1000}){1000}"},
    # Its parser outgrows llguidance's row limit at the first token, not at compile time.
    "ebnf_10000_alternatives": {"ebnf": "root ::= " + " | ".join(f'"w{k}"' for k in range(10_000))},
}


@pytest.mark.parametrize("grammar", GRAMMARS.values(), ids=GRAMMARS.keys())
def test_hostile_grammars_are_refused_quickly(
    deployment: Deployment, canary_alone: tuple[str, float], grammar: dict[str, str]
) -> None:
    response = beside_canary(deployment, canary_alone, lambda: post_chat(deployment.url, **grammar))
    assert response.status_code == 400
    assert "grammar" in response.json()["error"]["message"]


def test_inputs_too_large_for_the_bus_or_the_context_are_refused(
    deployment: Deployment, canary_alone: tuple[str, float]
) -> None:
    tokenizer = deployment.pid("tokenizer")
    rss_before = _rss_mb(tokenizer)
    ids = {"input_ids": [1] * 10**6, "sampling_params": {"max_new_tokens": 4}}
    beside_canary(
        deployment, canary_alone, lambda: httpx.post(f"{deployment.url}/generate", json=ids)
    )
    for size in (3_900_000, 900_000):  # over the bus's 1 MB; under it, over the context
        items = [
            {"type": "function_call", "call_id": "c1", "name": "read", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "log line\n" * (size // 9)},
        ]
        body = {"input": [{"role": "user", "content": "Summarize."}, *items]}
        send = functools.partial(httpx.post, f"{deployment.url}/v1/responses", json=body)
        beside_canary(deployment, canary_alone, send)
    assert _rss_mb(tokenizer) < rss_before + 50


def test_out_of_range_integers_get_validation_messages(
    deployment: Deployment, canary_alone: tuple[str, float]
) -> None:
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 10**30}}
    url = f"{deployment.url}/generate"
    response = beside_canary(deployment, canary_alone, lambda: httpx.post(url, json=body))
    assert "max_new_tokens" in json.dumps(response.json())
    response = post_chat(deployment.url, max_tokens=10**30)
    assert response.status_code == 400 and "max_tokens" in response.text


def test_a_chunked_body_over_the_limit_is_413(
    deployment: Deployment, canary_alone: tuple[str, float]
) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(12):
            yield b"x" * (1 << 20)
        yield b'"}]}'

    url = f"{deployment.url}/v1/chat/completions"
    response = beside_canary(
        deployment, canary_alone, lambda: httpx.post(url, content=chunks(), timeout=60)
    )
    assert response.status_code == 413


def test_slow_headers_are_cut_off(deployment: Deployment, canary_alone: tuple[str, float]) -> None:
    """200 connections that never finish their headers are closed after the header
    timeout; the canary is served meanwhile."""
    address = urlsplit(deployment.url)
    socks = []
    for _ in range(200):
        sock = socket.create_connection((address.hostname, address.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)
    text, seconds = deployment.canary()
    assert text == canary_alone[0] and seconds < 2 * canary_alone[1] + 1
    deadline = time.monotonic() + HEADER_TIMEOUT_S + 5
    for sock in socks:
        sock.settimeout(max(deadline - time.monotonic(), 0.1))
        assert sock.recv(1) == b""  # closed by the server
        sock.close()


def test_no_service_restarted(deployment: Deployment, canary_alone: tuple[str, float]) -> None:
    """Last (the module runs in order): every probe above left every process running."""
    assert deployment.restarts() == 0
    assert deployment.canary()[0] == canary_alone[0]


def _rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
