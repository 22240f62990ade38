"""Faults injected into a running `specmesh up`: real processes, real NATS, loopback.

A killed service is restarted by the launcher; what it had in flight costs at most
its own requests (a drafter's cost nothing: decode goes on without drafts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import msgspec
import pytest
import redis
from deployment import (
    GREEDY,
    PROMPTS,
    Deployment,
    chat,
    chat_text,
    fault_mid_stream,
    heartbeats,
    nats_accepts,
    sample,
    scrape,
    specmesh_up,
    stream_until_done,
)
from specmesh.services.gateway.cluster import Cluster, Generation
from specmesh.services.gateway.config import GatewayConfig
from specmesh.shared.bus import Bus
from specmesh.shared.infra import free_port, start_nats, start_valkey
from specmesh.shared.protocol import (
    ABORT,
    HEARTBEAT,
    PREFILL,
    PROTOCOL_VERSION,
    Abort,
    AdmitRequest,
    Admitted,
    Heartbeat,
    PrefillReply,
    PrefillRequest,
    RemoteError,
    TextDelta,
    TokenBatches,
    decode_subject,
    detok_subject,
    unpack,
)
from specmesh.shared.sampling.params import SamplingParams

CAPACITY = 8  # sequences in flight at the gateway before it answers 429


@pytest.fixture(scope="module")
def deployment(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    log = tmp_path_factory.mktemp("faults") / "up.log"
    with (
        start_nats() as nats,
        specmesh_up(
            smollm_dir,
            "--speculative-algorithm",
            "NGRAM",
            "--nats-url",
            nats.url,
            "--max-pending-requests",
            str(CAPACITY),
            "--decoders",
            "2",
            log=log,
        ) as url,
    ):
        yield Deployment(url, log, nats)


def kill_mid_stream(
    d: Deployment, instance: str, prompts: list[str], sig: signal.Signals = signal.SIGKILL
) -> tuple[list[tuple[str, dict]], float]:
    return fault_mid_stream(d.url, prompts, lambda: os.kill(d.pid(instance), sig), GREEDY)


def freeze(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def _leak_gauges(d: Deployment) -> dict[str, float]:
    """Every live service's requests in flight and KV blocks in use, by instance."""
    urls = {i: b.metrics_url for i, b in heartbeats(d.nats_url).items() if b.metrics_url}
    urls["gateway"] = f"{d.url}/metrics"
    gauges = {}
    for instance, url in urls.items():
        samples = scrape(url)
        service = "gateway" if instance == "gateway" else instance.rsplit("-", 1)[0]
        gauges[f"{instance} requests"] = sample(
            samples, "specmesh_active_requests", service=service
        )
        if service in ("prefill", "decode"):
            gauges[f"{instance} kv blocks"] = sample(
                samples, "specmesh_kv_blocks_used", service=service
            )
    return gauges


def assert_nothing_held(d: Deployment, seconds: float = 60) -> None:
    """Within `seconds`, every service of the deployment holds no request and no KV block."""
    deadline = time.monotonic() + seconds
    while any((gauges := _leak_gauges(d)).values()):
        assert time.monotonic() < deadline, f"still held after {seconds} s: {gauges}"
        time.sleep(1)
    assert len(gauges) >= 9, gauges  # every service reported


def test_a_killed_drafter_costs_no_request_anything(deployment: Deployment) -> None:
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["drafter-0"].incarnation
    results, seconds = kill_mid_stream(d, "drafter-0", PROMPTS * 2)
    assert seconds < 60  # a hang, not a slow machine, is what fails here
    assert results == [(text, {}) for text in reference * 2]  # decode went on without drafts
    d.wait_restarted("drafter-0", incarnation)
    assert d.restarts("drafter-0") == 1
    assert chat_text(d.url, PROMPTS[0], **GREEDY) == reference[0]
    assert_nothing_held(d)


def test_a_killed_decode_workers_requests_move_and_complete_unchanged(
    deployment: Deployment,
) -> None:
    """SIGKILL of decode-0 under 8 greedy streams: the gateway resumes each of its requests
    on the other worker (prefilling the prompt and the tokens so far), and every stream
    ends with the text it would have had; decode-0 is restarted and serves again."""
    d = deployment
    prompts = PROMPTS * 2
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["decode-0"].incarnation
    moved = sample(scrape(f"{d.url}/metrics"), "specmesh_migrated_requests_total", outcome="moved")
    results, seconds = kill_mid_stream(d, "decode-0", prompts)
    assert seconds < 45
    assert results == [(reference[i % len(PROMPTS)], {}) for i in range(len(prompts))]
    after = sample(scrape(f"{d.url}/metrics"), "specmesh_migrated_requests_total", outcome="moved")
    assert after > moved  # some of them were on decode-0
    d.wait_restarted("decode-0", incarnation)
    assert d.restarts("decode-0") == 1
    assert chat_text(d.url, PROMPTS[1], **GREEDY) == reference[1]
    assert_nothing_held(d)


def test_requests_arriving_as_a_decode_worker_dies_are_admitted_elsewhere(
    deployment: Deployment,
) -> None:
    """New requests sent right after decode-1's SIGKILL, while the gateway still lists it
    (its heartbeats have not stopped yet), half of them routed there: the admission finds
    nobody (or no answer), the worker is dropped and each request goes to decode-0; no 503,
    every output what it would have been."""
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["decode-1"].incarnation
    late: list[httpx.Response] = []

    def kill_then_send() -> None:
        os.kill(d.pid("decode-1"), signal.SIGKILL)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            late.extend(pool.map(lambda p: chat(d.url, p, **GREEDY), PROMPTS))

    results, _ = fault_mid_stream(d.url, PROMPTS, kill_then_send, GREEDY)
    assert results == [(text, {}) for text in reference]
    assert [r.status_code for r in late] == [200] * len(PROMPTS), [r.text for r in late]
    assert [r.json()["choices"][0]["message"]["content"] for r in late] == reference
    d.wait_restarted("decode-1", incarnation)
    assert_nothing_held(d)


def test_a_killed_prefill_workers_calls_are_sent_again_and_complete_unchanged(
    deployment: Deployment,
) -> None:
    """SIGKILL of the only prefill worker with 4 streams running and 4 more arriving: the
    gateway sends the calls that were in flight again and waits for the restarted
    worker, so all 8 streams end with their own text; then nothing is held."""
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["prefill-0"].incarnation
    restarts = d.restarts("prefill-0")
    started = [threading.Event() for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        first = [
            pool.submit(stream_until_done, d.url, p, e, GREEDY)
            for p, e in zip(PROMPTS, started[:4], strict=True)
        ]
        for event in started[:4]:
            assert event.wait(60)
        os.kill(d.pid("prefill-0"), signal.SIGKILL)
        later = [
            pool.submit(stream_until_done, d.url, p, e, GREEDY)
            for p, e in zip(PROMPTS, started[4:], strict=True)
        ]
        results = [f.result(timeout=90) for f in first + later]
    assert results == [(text, {}) for text in reference * 2]
    d.wait_restarted("prefill-0", incarnation)
    assert d.restarts("prefill-0") == restarts + 1
    assert_nothing_held(d)


def _long_stream(url: str, started: threading.Event) -> None:
    """A stream of 1000 tokens (about a minute here) that is cut off."""
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "stream": True}
    body |= {"temperature": 0, "max_tokens": 1000, "ignore_eos": True}
    with contextlib.suppress(httpx.HTTPError):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
    started.set()


def test_a_killed_gateways_requests_end_everywhere(deployment: Deployment) -> None:
    """SIGKILL of the gateway under 4 long streams: the gateway that comes back is a new
    incarnation, so decode and the tokenizer drop the old one's requests at once instead
    of computing them to their end (a minute); then it serves again."""
    d = deployment
    incarnation = heartbeats(d.nats_url)["gateway-0"].incarnation
    started = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        for event in started:
            pool.submit(_long_stream, d.url, event)
        for event in started:
            assert event.wait(60)
        os.kill(d.pid("gateway-0"), signal.SIGKILL)
        d.wait_restarted("gateway-0", incarnation)
        assert_nothing_held(d, seconds=10)
    assert chat_text(d.url, PROMPTS[0], **GREEDY)


def test_a_decode_worker_that_only_seemed_lost_cannot_corrupt_moved_streams(
    deployment: Deployment,
) -> None:
    """decode-0 frozen (SIGSTOP) for 5 s: the gateway moves its requests, then decode-0
    runs again and finishes its copies; their tokens are ignored (the detokenizer takes
    the newer placement's only) and every text is unchanged."""
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    pid = d.pid("decode-0")
    results, _ = fault_mid_stream(d.url, PROMPTS, lambda: freeze(pid, 5), GREEDY)
    assert results == [(text, {}) for text in reference]
    assert d.pid("decode-0") == pid  # the same process, back in service
    assert chat_text(d.url, PROMPTS[2], **GREEDY) == reference[2]


def _drop(url: str, prompt: str, where: str, rng: random.Random) -> None:
    """A streaming chat whose client goes away `where`."""
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True}
    body |= {"temperature": 0, "max_tokens": 32, "ignore_eos": True}
    if where == "before the first byte":  # the whole request, then the connection closes
        payload = json.dumps(body).encode()
        host, port = urlsplit(url).hostname, urlsplit(url).port
        with socket.create_connection((host, port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
        return
    # during prefill: gone before the response starts; mid-stream: after a few events
    read = rng.uniform(0.01, 0.3) if where == "during prefill" else 60
    timeout = httpx.Timeout(60, read=read)
    with contextlib.suppress(httpx.TimeoutException):
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=timeout) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= rng.randint(1, 12):
                    break


def test_a_disconnect_storm_leaks_nothing(deployment: Deployment) -> None:
    """300 streams whose clients leave at random points: afterwards every service's
    requests-in-flight and KV-blocks-in-use gauges are back to zero and the next
    request is served as before."""
    d = deployment
    reference = chat_text(d.url, PROMPTS[1], **GREEDY)
    rng = random.Random(0)
    wheres = ["before the first byte", "during prefill", "mid-stream"]
    drops = [(PROMPTS[i % len(PROMPTS)], rng.choice(wheres), random.Random(i)) for i in range(300)]
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda drop: _drop(d.url, *drop), drops))
    assert_nothing_held(d)
    assert chat_text(d.url, PROMPTS[1], **GREEDY) == reference


def _load(url: str, clients: int, seconds: float, timeout: float) -> list[tuple[str, float]]:
    """`clients` threads sending short chats back to back for `seconds`: (outcome, when it
    came, in seconds from the start) per request; outcome is the HTTP status or "timeout"."""
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], **GREEDY, "max_tokens": 8}
    start = time.monotonic()

    def client() -> list[tuple[str, float]]:
        outcomes = []
        with httpx.Client(timeout=timeout) as http:
            while time.monotonic() - start < seconds:
                try:
                    status = str(http.post(f"{url}/v1/chat/completions", json=body).status_code)
                except httpx.TimeoutException:
                    status = "timeout"
                outcomes.append((status, time.monotonic() - start))
                if status == "429":
                    time.sleep(0.25)  # as clients back off (the OpenAI SDK: 0.5 s and up)
        return outcomes

    with ThreadPoolExecutor(clients) as pool:
        return [o for outcomes in pool.map(lambda _: client(), range(clients)) for o in outcomes]


def test_overload_is_refused_fast_and_goodput_recovers(deployment: Deployment) -> None:
    """3x the gateway's capacity, clients that give up after 5 s, for 20 s, between two
    windows of half of it: while overloaded only 200/429/503 (or the client's own
    timeout); afterwards every request succeeds and at least half as many complete as in
    the window before (abandoned requests leave no backlog). Compared within the test
    because the machine's speed varies: on a busy CI run one short chat took 5 s."""
    d = deployment
    before = _load(d.url, CAPACITY // 2, 10, 30.0)
    overload = _load(d.url, 3 * CAPACITY, 20, 5.0)
    statuses = {status for status, _ in overload}
    assert statuses <= {"200", "429", "503", "timeout"}, statuses
    assert "429" in statuses, statuses  # refused fast, not queued
    after = _load(d.url, CAPACITY // 2, 10, 30.0)
    assert {status for status, _ in before + after} == {"200"}, (before, after)
    assert 2 * len(after) >= len(before), (before, after)
    assert_nothing_held(d)


@pytest.mark.parametrize("seconds", [5, 30])
def test_a_nats_outage_under_load_stops_no_service(deployment: Deployment, seconds: int) -> None:
    """nats-server frozen (SIGSTOP) under 4 streams: each stream completes or fails
    clearly well before its deadline, no service exits, and once NATS is back the
    deployment serves as before."""
    d = deployment
    reference = chat_text(d.url, PROMPTS[0], **GREEDY)
    pids = {instance: d.pid(instance) for instance in heartbeats(d.nats_url)}
    results, _ = fault_mid_stream(d.url, PROMPTS, lambda: freeze(d.nats.proc.pid, seconds), GREEDY)
    for text, error in results:  # an error ("... went away") or the whole text, in time
        assert error or text, (text, error)
    deadline = time.monotonic() + 60
    while set(heartbeats(d.nats_url)) != set(pids):
        assert time.monotonic() < deadline, "the services did not come back"
    assert {instance: d.pid(instance) for instance in pids} == pids  # nobody exited
    assert chat_text(d.url, PROMPTS[0], **GREEDY) == reference
    assert_nothing_held(d)


def test_a_decode_worker_stopped_with_sigterm_finishes_its_streams_first(
    deployment: Deployment,
) -> None:
    """SIGTERM (a rolling update, `docker stop`): the worker says it is draining, takes no
    new requests, finishes those in flight, then exits; the launcher starts it again."""
    d = deployment
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: chat_text(d.url, p, **GREEDY), PROMPTS))
    incarnation = heartbeats(d.nats_url)["decode-0"].incarnation
    results, _ = kill_mid_stream(d, "decode-0", PROMPTS, signal.SIGTERM)
    assert results == [(text, {}) for text in reference]
    d.wait_restarted("decode-0", incarnation)
    assert chat_text(d.url, PROMPTS[0], **GREEDY) == reference[0]
    assert_nothing_held(d)


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
    """The canary's text is unchanged and it takes no more than twice as long (plus a
    second of noise) as the same stream alone."""
    d = deployment
    reference = chat_text(d.url, PROMPTS[2], **GREEDY)
    start = time.monotonic()
    assert stream_until_done(d.url, PROMPTS[2], threading.Event(), GREEDY) == (reference, {})
    alone = time.monotonic() - start
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        canary = pool.submit(stream_until_done, d.url, PROMPTS[2], started, GREEDY)
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
    assert time.monotonic() - start < 2 * alone + 1, (time.monotonic() - start, alone)


async def _crafted_messages(nats_url: str) -> list[str]:
    """Messages a buggy or hostile peer could send each service; returns what came back
    from those that answer."""
    bus = await Bus.connect(nats_url, "crafted")
    params = SamplingParams(temperature=0, max_tokens=4)
    outcomes = []
    try:
        for msg in (
            PrefillRequest(request_id="c1", prompt_ids=[1, 10**9], params=params),  # vocab
            PrefillRequest(request_id="c2", prompt_ids=[], params=params),
        ):
            with pytest.raises(RemoteError) as info:
                await bus.request(PREFILL, msg, PrefillReply, 30)
            outcomes.append(f"{info.value.status} {info.value}")
        raw = msgspec.msgpack.encode(
            [PROTOCOL_VERSION, "PrefillRequest", {"request_id": "c3", "prompt_ids": "abc"}]
        )
        reply = await bus.nc.request(PREFILL, raw, timeout=30)
        with pytest.raises(RemoteError) as info:
            unpack(reply.data, PrefillReply)
        outcomes.append(f"{info.value.status} {info.value}")
        # Admitted with K/V keys that name nothing: decode recomputes the prompt itself.
        real = PrefillRequest(request_id="c4", prompt_ids=[1, 2], params=params)
        prefill = msgspec.structs.replace(
            await bus.request(PREFILL, real, PrefillReply, 30), first_token=42, kv_keys=["nope"]
        )
        admit = AdmitRequest(
            request_id="c4",
            prompt_ids=[1, 2],
            params=params,
            prefill=prefill,
            drafter_id=None,
            detok_subject="crafted.detok",
            output_subject="crafted.out",
        )
        # The same, but K/V of another model, dtype or block size: decode refuses it.
        other = msgspec.structs.replace(prefill, kv_fingerprint="0" * 16)
        foreign = msgspec.structs.replace(admit, prefill=other)
        with pytest.raises(RemoteError) as info:
            await bus.request(decode_subject("decode-0"), foreign, Admitted, 30)
        outcomes.append(f"{info.value.status} {info.value}")
        got: asyncio.Queue[TokenBatches] = asyncio.Queue()
        await bus.serve("crafted.detok", got.put)
        await bus.request(decode_subject("decode-0"), admit, Admitted, 30)
        tokens: list[int] = []
        while not (batch := (await asyncio.wait_for(got.get(), 60)).batches[-1]).finish_reason:
            tokens += batch.token_ids
        outcomes.append(f"{batch.finish_reason} {len(tokens + batch.token_ids)} tokens")
        for garbage in (b"\x00", b"\xc1" * 64):  # no reply expected; must not harm anyone
            for subject in (PREFILL, decode_subject("decode-0"), detok_subject("tokenizer-0")):
                await bus.nc.publish(subject, garbage)
    finally:
        await bus.close()
    return outcomes


def test_crafted_internal_messages_fail_only_themselves(deployment: Deployment) -> None:
    """Wrong types, out-of-vocabulary tokens, K/V keys that name nothing or K/V of another
    model, and bytes that are no message at all, sent straight to the services while a
    canary streams."""
    d = deployment
    reference = chat_text(d.url, PROMPTS[2], **GREEDY)
    started = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        canary = pool.submit(stream_until_done, d.url, PROMPTS[2], started, GREEDY)
        assert started.wait(60)
        outcomes = asyncio.run(_crafted_messages(d.nats_url))
        assert canary.result(60) == (reference, {})
    assert outcomes[0].startswith("400 prompt token ids must be in"), outcomes
    assert outcomes[1] == "400 the prompt is empty", outcomes
    assert outcomes[2].startswith("400 bad PrefillRequest"), outcomes
    assert outcomes[3].startswith("500 prefill's K/V is for "), outcomes
    assert outcomes[4] == "length 4 tokens", outcomes
    assert chat_text(d.url, PROMPTS[2], **GREEDY) == reference


def test_a_killed_tokenizer_fails_its_streams_clearly_then_serves_again(
    deployment: Deployment,
) -> None:
    """SIGKILL of the only tokenizer (the detokenizer of 8 streams): each stream ends with
    a clear error within 10 s, the tokenizer is restarted and serves, nothing is held."""
    d = deployment
    incarnation = heartbeats(d.nats_url)["tokenizer-0"].incarnation
    results, seconds = kill_mid_stream(d, "tokenizer-0", PROMPTS * 2)
    for _, error in results:
        assert "tokenizer" in error.get("message", ""), error
    assert seconds < 10
    d.wait_restarted("tokenizer-0", incarnation)
    assert chat_text(d.url, PROMPTS[3], **GREEDY)
    assert_nothing_held(d)


async def _fill_and_abort(nats_url: str) -> tuple[str, float, int]:
    """A long prompt holds prefill's only slot; a second is refused; the first is
    aborted. Returns (the refusal, seconds until prefill's engine is idle again, what
    a short prompt computed then)."""
    bus = await Bus.connect(nats_url, "test")
    params = SamplingParams(temperature=0, max_tokens=1)
    long_prompt = PrefillRequest(request_id="long", prompt_ids=[42] * 4000, params=params)
    short = PrefillRequest(request_id="short", prompt_ids=[1, 2, 3], params=params)
    try:
        held = asyncio.create_task(bus.request(PREFILL, long_prompt, PrefillReply, 120))
        await asyncio.sleep(1.0)
        with pytest.raises(RemoteError) as refused:
            await bus.request(PREFILL, short, PrefillReply, 30)
        assert refused.value.status == 503
        start = time.monotonic()
        await bus.publish(ABORT, Abort(request_id="long"))
        while (await _prefill_beat(bus)).active_requests:
            pass
        idle = time.monotonic() - start
        reply = await bus.request(PREFILL, short, PrefillReply, 30)
        assert not held.done()  # an aborted prompt gets no reply
        held.cancel()
        return str(refused.value), idle, reply.num_computed_tokens
    finally:
        await bus.close()


async def _prefill_beat(bus: Bus) -> Heartbeat:
    sub = await bus.nc.subscribe(HEARTBEAT.format(kind="prefill"))
    try:
        msg = await sub.next_msg(timeout=5)
        return unpack(msg.data, Heartbeat)
    finally:
        await sub.unsubscribe()


def test_prefill_refuses_past_its_queue_bound_and_drops_aborted_prompts(
    smollm_dir: Path,
) -> None:
    """4000 prompt tokens in 32-token chunks keep prefill busy for many seconds; an abort
    ends them within a step or two."""
    with start_nats() as nats_server:
        argv = [sys.executable, "-m", "specmesh.services.prefill", "--nats-url", nats_server.url]
        argv += ["--model", str(smollm_dir), "--kv-cache-gb", "0.25", "--max-queued-requests", "1"]
        argv += ["--kv-namespace", f"abort-test-{os.getpid()}", "--max-num-batched-tokens", "32"]
        proc = subprocess.Popen(argv)
        try:
            deadline = time.monotonic() + 120
            while "prefill" not in " ".join(heartbeats(nats_server.url, 1.0)):
                assert proc.poll() is None and time.monotonic() < deadline
            refused, idle, computed = asyncio.run(_fill_and_abort(nats_server.url))
        finally:
            proc.terminate()
            proc.wait(30)
    assert "prompts in flight; retry later" in refused
    assert idle < 5, idle
    assert computed == 3


def test_a_request_without_output_fails_after_its_idle_timeout() -> None:
    """A lost message (nothing ever arrives) ends the request instead of hanging it."""

    async def wait_for_nothing(url: str) -> list[TextDelta]:
        bus = await Bus.connect(url, "test")
        cluster = Cluster(
            bus, "gw", 3.0, 10.0, 8, idle_timeout=0.3, model_name="m", router=GatewayConfig()
        )
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


def test_requests_complete_while_the_kv_store_is_down(smollm_dir: Path) -> None:
    """valkey stopped, then started again empty: prefill computes whole prompts and hands
    over keys it could not store, decode computes what it cannot load; nothing fails and
    every answer is the one from before. (Load-only routing: each prompt takes prefill's
    path, not a decode worker's cache.)"""
    port = free_port()
    valkey = start_valkey(port)
    args = ["--kv-transport", "redis", "--redis-url", valkey.url, "--router-policy", "load"]
    try:
        with start_nats() as bus, specmesh_up(smollm_dir, "--nats-url", bus.url, *args) as url:
            before = [chat_text(url, p, **GREEDY) for p in PROMPTS]
            valkey.stop()
            down = [chat(url, p, **GREEDY) for p in PROMPTS]
            valkey = start_valkey(port)
            after = [chat_text(url, p, **GREEDY) for p in PROMPTS]
    finally:
        valkey.stop()
    assert [r.status_code for r in down] == [200] * len(PROMPTS), [r.text for r in down]
    assert [r.json()["choices"][0]["message"]["content"] for r in down] == before == after
