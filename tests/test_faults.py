"""Faults injected into a running `specmesh up`: real processes, real NATS, loopback.

A killed service is restarted by the launcher; what it had in flight costs at most
its own requests (a drafter's cost nothing: decode goes on without drafts)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from deployment import chat_text, heartbeats, nats_accepts, sample, scrape, specmesh_up

from services.gateway.cluster import Cluster, Generation
from shared.bus import Bus
from shared.infra import start_nats
from shared.protocol import TextDelta

PROMPTS = [
    "Count from one to twenty in words.",
    "List the days of the week.",
    "Name the planets of the solar system.",
    "Spell the word 'elephant' letter by letter.",
]
GREEDY = {"temperature": 0, "max_tokens": 40, "ignore_eos": True}


class Deployment:
    def __init__(self, url: str, log: Path, nats_url: str) -> None:
        self.url, self.log, self.nats_url = url, log, nats_url

    def pid(self, instance: str) -> int:
        """The pid `specmesh up` printed for `instance` when it came up."""
        match = re.search(rf"^\s+{instance}\s+pid (\d+)", self.log.read_text(), re.M)
        assert match, self.log.read_text()
        return int(match.group(1))

    def launcher_metrics(self) -> str:
        match = re.search(r"specmesh-up\s+pid \d+\s+(\S+)", self.log.read_text())
        assert match, self.log.read_text()
        return match.group(1)

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


@pytest.fixture(scope="module")
def deployment(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log = tmp_path_factory.mktemp("faults") / "up.log"
    with (
        start_nats() as bus,
        specmesh_up(
            smollm_dir, "--speculative-algorithm", "NGRAM", "--nats-url", bus.url, log=log
        ) as url,
    ):
        yield Deployment(url, log, bus.url)


def stream_until_done(url: str, prompt: str, first_chunk: threading.Event) -> tuple[str, dict]:
    """Streams a greedy chat; sets `first_chunk` on the first content. Returns the text and
    the error event, if the stream ended with one."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, **GREEDY}
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


def kill_mid_stream(d: Deployment, instance: str, prompts: list[str]) -> list[tuple[str, dict]]:
    """Streams `prompts` at once, SIGKILLs `instance` once all have output, returns them."""
    started = [threading.Event() for _ in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [
            pool.submit(stream_until_done, d.url, p, e)
            for p, e in zip(prompts, started, strict=True)
        ]
        for event in started:
            assert event.wait(60), "no stream produced output"
        os.kill(d.pid(instance), signal.SIGKILL)
        killed = time.monotonic()
        results = [f.result(timeout=60) for f in futures]
    assert time.monotonic() - killed < 30
    return results


def test_a_killed_drafter_costs_no_request_anything(deployment: Deployment) -> None:
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["drafter-0"].incarnation
    results = kill_mid_stream(d, "drafter-0", PROMPTS)
    assert [error for _, error in results] == [{}] * len(PROMPTS)
    assert [text for text, _ in results] == reference  # decode went on without drafts
    d.wait_restarted("drafter-0", incarnation)
    assert d.restarts("drafter-0") == 1
    assert chat_text(d.url, PROMPTS[0], **GREEDY) == reference[0]


def test_a_killed_decode_worker_fails_its_requests_clearly_then_serves_again(
    deployment: Deployment,
) -> None:
    d = deployment
    incarnation = heartbeats(d.nats_url)["decode-0"].incarnation
    start = time.monotonic()
    [(_, error)] = kill_mid_stream(d, "decode-0", PROMPTS[:1])
    assert error and "decode" in error["message"], error  # the only worker: a clear error
    assert time.monotonic() - start < 40
    d.wait_restarted("decode-0", incarnation)
    assert d.restarts("decode-0") == 1
    assert chat_text(d.url, PROMPTS[1], **GREEDY)


def test_the_launchers_servers_need_its_secret_and_come_back_when_killed(
    smollm_dir: Path, tmp_path: Path
) -> None:
    """Its own nats-server and valkey refuse other clients (a secret of this run), and a
    killed nats-server is restarted on its port, where every service reconnects."""
    log = tmp_path / "up.log"
    with specmesh_up(smollm_dir, "--kv-transport", "redis", log=log) as url:
        servers = dict(
            re.findall(r"^\s+(nats-server|valkey)\s+pid \d+\s+(\S+)", log.read_text(), re.M)
        )
        assert not asyncio.run(nats_accepts(servers["nats-server"]))
        with (
            redis.Redis.from_url(servers["valkey"]) as anonymous,
            pytest.raises(redis.AuthenticationError),
        ):
            anonymous.ping()
        match = re.search(r"^\s+nats-server\s+pid (\d+)", log.read_text(), re.M)
        os.kill(int(match.group(1)), signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert chat_text(url, PROMPTS[0], max_tokens=4, temperature=0)
                break
            except (AssertionError, httpx.HTTPError):
                assert time.monotonic() < deadline, "not serving 60 s after NATS was killed"
                time.sleep(1)
        assert not asyncio.run(nats_accepts(servers["nats-server"]))  # restarted with it


POISON = {
    "top_k past int64": {"top_k": 2**63 + 5},
    "top_k past the vocabulary": {"top_k": 10**6},
    "10^5 stop_token_ids": {"stop_token_ids": list(range(10**5))},
    "a stop token id past the vocabulary": {"stop_token_ids": [10**9]},
    "16 stop strings of 100 kB": {"stop": ["x" * 100_000] * 16},
    "n=64 with 16 long stops": {"n": 64, "stop": ["y" * 5000] * 16},
}
RAW_POISON = {
    "deep JSON": b'{"messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "invalid UTF-8": b'{"messages":[{"role":"user","content":"\xff\xfe"}]}',
}


def test_poison_input_gets_400_and_costs_a_concurrent_request_nothing(
    deployment: Deployment,
) -> None:
    d = deployment
    reference = chat_text(d.url, PROMPTS[2], **GREEDY)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        canary = pool.submit(stream_until_done, d.url, PROMPTS[2], started)
        assert started.wait(60)
        with httpx.Client(timeout=60) as client:
            for name, extra in POISON.items():
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
                r = client.post(f"{d.url}/v1/chat/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["message"], (name, r.text)
            for name, raw in RAW_POISON.items():
                headers = {"content-type": "application/json"}
                r = client.post(f"{d.url}/v1/chat/completions", content=raw, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["message"], (name, r.text)
        assert canary.result(60) == (reference, {})


def test_a_frozen_tokenizer_fails_its_streams_clearly_then_serves_again(
    deployment: Deployment,
) -> None:
    """The detokenizer is lost (SIGSTOP): its streams fail like a lost decode worker's."""
    d = deployment
    pid = d.pid("tokenizer-0")
    started, start = threading.Event(), time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stream = pool.submit(stream_until_done, d.url, PROMPTS[3], started)
        assert started.wait(60)
        os.kill(pid, signal.SIGSTOP)
        try:
            _, error = stream.result(30)
        finally:
            os.kill(pid, signal.SIGCONT)
    assert "tokenizer" in error.get("message", ""), error
    assert time.monotonic() - start < 20
    deadline = time.monotonic() + 30
    while "tokenizer-0" not in heartbeats(d.nats_url, 1.5):
        assert time.monotonic() < deadline
    assert chat_text(d.url, PROMPTS[3], **GREEDY)


def test_a_request_without_output_fails_after_its_idle_timeout() -> None:
    """A lost message (nothing ever arrives) ends the request instead of hanging it."""

    async def wait_for_nothing(url: str) -> list[TextDelta]:
        bus = await Bus.connect(url, "test")
        cluster = Cluster(bus, "gw", 3.0, 10.0, 8, idle_timeout=0.3)
        generation = Generation(cluster, ["lost-request"])
        cluster.outputs["lost-request"] = generation.queue
        deltas = [delta async for delta in generation.deltas()]
        generation.close()
        await bus.close()
        return deltas

    with start_nats() as nats_server:
        start = time.monotonic()
        [delta] = asyncio.run(wait_for_nothing(nats_server.url))
    assert delta.finish_reason == "error" and "no output for 0.3 s" in delta.error
    assert time.monotonic() - start < 5
