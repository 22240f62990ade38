"""Helpers for tests that run the system as users do: `specmesh up`, real HTTP, real NATS."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families
from specmesh.shared.infra import ServerProcess, free_port
from specmesh.shared.protocol import (
    ABORT,
    HEARTBEAT,
    SERVICE_USERS,
    TOKENIZE,
    Heartbeat,
    decode_subject,
    gateway_subject,
    inbox_prefix,
    unpack,
)


def openai_client(url: str, api_key: str = "unused", **options: Any) -> openai.OpenAI:
    """The official client on the gateway at `url`, validating every response, streamed
    chunks too, against the package's pydantic types: a missing or mistyped field fails the
    call (APIResponseValidationError) where the lenient default would read it as None."""
    return openai.OpenAI(
        base_url=f"{url}/v1", api_key=api_key, _strict_response_validation=True, **options
    )


@contextmanager
def specmesh_up(
    model: Path, *args: str, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[str]:
    """`specmesh up` in a subprocess on a free port until the block ends; yields its URL
    once it says it is up. Its output and every process's logs go to `log` (to check what
    they wrote)."""
    port = free_port()
    log = log or Path(tempfile.mkdtemp()) / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specmesh.services.cli", "up", "--model", str(model)]
            + ["--port", str(port), "--kv-cache-gb", "0.25", *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 180
        while "specmesh is up" not in log.read_text():
            assert proc.poll() is None, f"specmesh up exited during start-up:\n{log.read_text()}"
            assert time.monotonic() < deadline, "specmesh up did not come up in 180 s"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def listing(log: Path) -> dict[str, tuple[int, str]]:
    """What `specmesh up` listed once up: instance (and `specmesh-up`) -> (pid, metrics URL)."""
    found = re.findall(r"^\s+(\S+)\s+pid (\d+)\s*(\S*)$", log.read_text(), re.M)
    assert found, log.read_text()
    return {name: (int(pid), url) for name, pid, url in found}


def chat(url: str, content: str, **extra: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)


def chat_text(url: str, content: str, **extra: object) -> str:
    response = chat(url, content, **extra)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def stream_chat(url: str, content: str, **extra: object) -> list[dict]:
    """The parsed SSE chunks of a streamed chat request (without the final [DONE])."""
    body = {"messages": [{"role": "user", "content": content}], "stream": True, **extra}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [json.loads(e) for e in events[:-1]]


def streamed_text(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def heartbeats(nats_url: str, seconds: float = 2.5) -> dict[str, Heartbeat]:
    """The instances heartbeating on `nats_url`, by id (listens for `seconds`)."""

    async def listen() -> dict[str, Heartbeat]:
        seen: dict[str, Heartbeat] = {}
        nc = await nats.connect(nats_url)

        async def on_message(msg: nats.aio.msg.Msg) -> None:
            beat = unpack(msg.data, Heartbeat)
            seen[beat.instance_id] = beat

        await nc.subscribe(HEARTBEAT.format(kind="*"), cb=on_message)
        await asyncio.sleep(seconds)
        await nc.close()
        return seen

    return asyncio.run(listen())


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus samples at `url`: (sample name, sorted labels) -> value."""
    text = httpx.get(url, timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def nats_accepts(url: str, **auth: str) -> bool:
    """Whether NATS at `url` lets a client in with `auth` (none: anonymously)."""
    try:
        nc = await nats.connect(url, allow_reconnect=False, connect_timeout=5, **auth)
    except Exception:
        return False
    await nc.close()
    return True


SERVICE_PASSWORDS = {user: f"pw-{user}" for user in SERVICE_USERS}
# Chats whose greedy answers fault tests compare with the no-fault ones (short and steady).
PROMPTS = [
    "Count from one to twenty in words.",
    "List the days of the week.",
    "Name the planets of the solar system.",
    "Spell the word 'elephant' letter by letter.",
]
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}
# Chats whose greedy answers deployments must give as the in-process engine does.
CHATS = [
    "Repeat exactly: red green blue, red green blue, red green blue.",
    "What is the capital of France?",
    "Rewrite with snake_case names:\ndef getValue(myInput):\n    myResult = myInput * 2\n",
    "Write a haiku about autumn leaves.",
    "List the days of the week.",
    "Give two reasons to learn Rust.",
    "Spell the word 'banana' letter by letter.",
    "Count from one to ten in words.",
]
CHAT_TOKENS = 40
CHAT_GREEDY = {"temperature": 0, "max_tokens": CHAT_TOKENS}


async def _as_user(url: str, user: str, errors: list[str]) -> nats.NATS:
    """A client with `user`'s credentials (SERVICE_PASSWORDS) that keeps its errors."""

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        url,
        user=user,
        password=SERVICE_PASSWORDS[user],
        inbox_prefix=inbox_prefix(user),
        error_cb=on_error,
        allow_reconnect=False,
    )


async def _least_privilege(url: str) -> tuple[list[str], list[bytes], bytes]:
    """A drafter's credentials tried on other services' subjects, next to a gateway and a
    tokenizer doing their own work. Returns (the drafter's errors, what reached
    subscribers it should not reach, the gateway's tokenize reply)."""
    errors: list[str] = []
    leaked: list[bytes] = []
    drafter = await _as_user(url, "drafter", errors)
    gateway = await _as_user(url, "gateway", [])
    tokenizer = await _as_user(url, "tokenizer", [])

    async def leak(msg: Msg) -> None:
        leaked.append(msg.data)

    async def tokenize(msg: Msg) -> None:
        await msg.respond(b"tokens")

    await tokenizer.subscribe(TOKENIZE, cb=tokenize)
    await gateway.subscribe(gateway_subject("gateway-0"), cb=leak)
    for subject in (gateway_subject("gateway-0"), TOKENIZE, HEARTBEAT.format(kind="decode")):
        await drafter.subscribe(subject, cb=leak)
        await drafter.flush()
    await drafter.subscribe(f"{inbox_prefix('gateway')}.>", cb=leak)  # the gateway's replies
    for subject in (gateway_subject("gateway-0"), decode_subject("decode-0"), ABORT, TOKENIZE):
        await drafter.publish(subject, b"forged")
    await drafter.flush()
    reply = await gateway.request(TOKENIZE, b"hello", timeout=5)
    await asyncio.sleep(0.5)
    for client in (drafter, gateway, tokenizer):
        await client.close()
    return errors, leaked, reply.data


def assert_least_privilege(url: str) -> None:
    """NATS at `url` (users and passwords as SERVICE_PASSWORDS) lets services that talk
    talk, and keeps a drafter's credentials off every other service's subjects."""
    errors, leaked, reply = asyncio.run(_least_privilege(url))
    assert reply == b"tokens"
    assert leaked == []
    denied = " ".join(errors).lower()  # nats-py lowercases the server's errors
    for subject in (gateway_subject("gateway-0"), TOKENIZE, HEARTBEAT.format(kind="decode")):
        assert f'violation for subscription to "{subject}"' in denied, denied
    assert f'subscription to "{inbox_prefix("gateway").lower()}.>"' in denied, denied
    for subject in (gateway_subject("gateway-0"), decode_subject("decode-0"), ABORT):
        assert f'violation for publish to "{subject}"' in denied, denied


class Deployment:
    def __init__(self, url: str, log: Path, nats: ServerProcess) -> None:
        self.url, self.log, self.nats = url, log, nats
        self.nats_url = nats.url

    def pid(self, instance: str) -> int:
        """The pid of `instance`'s process now (it may have been restarted)."""
        for proc in Path("/proc").iterdir():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):
                continue
            if self.nats_url.encode() in argv and f"--instance-id\0{instance}\0".encode() in (
                b"\0".join(argv) + b"\0"
            ):
                return int(proc.name)
        raise AssertionError(f"no process for {instance}")

    def launcher_metrics(self) -> str:
        return listing(self.log)["specmesh-up"][1]

    def restarts(self, instance: str) -> float:
        samples = scrape(self.launcher_metrics())
        service = instance.rsplit("-", 1)[0]
        name = "specmesh_service_restarts_total"
        return sample(samples, name, service=service, instance_id=instance)

    def wait_restarted(self, instance: str, incarnation: str, seconds: float = 60) -> None:
        """Until `instance` heartbeats again under a new incarnation."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            beat = heartbeats(self.nats_url, 1.5).get(instance)
            if beat is not None and beat.incarnation != incarnation:
                return
        raise AssertionError(f"{instance} did not come back in {seconds} s")


def stream_until_done(
    url: str, prompt: str, first_chunk: threading.Event, params: dict[str, Any]
) -> tuple[str, dict]:
    """Streams a chat with `params`; sets `first_chunk` on the first content. Returns the text
    and the error event, if the stream ended with one."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, **params}
    text, error = "", {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                break
            if event["choices"] and event["choices"][0]["delta"].get("content"):
                text += event["choices"][0]["delta"]["content"]
                first_chunk.set()
    first_chunk.set()
    return text, error


def fault_mid_stream(
    url: str, prompts: list[str], fault: Callable[[], None], params: dict[str, Any]
) -> tuple[list[tuple[str, dict]], float]:
    """Streams `prompts` at once (chats with `params`) to the gateway at `url` and runs
    `fault()` once all have output: (the streams' results, seconds from the fault until
    the last stream ended)."""
    started = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_until_done, url, p, e, params)
            for p, e in zip(prompts, started, strict=True)
        ]
        for event in started:
            assert event.wait(60), "no stream produced output"
        start = time.monotonic()
        fault()
        results = [f.result(timeout=60) for f in futures]
    return results, time.monotonic() - start
