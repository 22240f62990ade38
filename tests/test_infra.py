"""specmesh.shared.infra's servers and the test OTLP receiver, as real processes and real HTTP."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx
import nats
import pytest
import redis
from deployment import SERVICE_PASSWORDS, assert_least_privilege, nats_accepts
from nats.aio.msg import Msg
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from otlp_receiver import OtlpReceiver
from specmesh.shared.infra import ServerProcess, start_nats, start_valkey
from specmesh.shared.protocol import nats_users

Starter = Callable[..., ServerProcess]


def port_of(server: ServerProcess) -> int:
    port = urlsplit(server.url).port
    assert port is not None
    return port


def test_nats_carries_a_4_mib_request_and_reply() -> None:
    payload = bytes(range(256)) * (4 * 1024 * 4)  # 4 MiB, over NATS's 1 MiB default

    async def round_trip(url: str) -> bytes:
        nc = await nats.connect(url)
        try:
            assert nc.max_payload == 8 * 1024 * 1024

            async def echo(msg: Msg) -> None:
                await msg.respond(msg.data[::-1])

            await nc.subscribe("echo", cb=echo)
            reply = await nc.request("echo", payload, timeout=5)
            return reply.data
        finally:
            await nc.close()

    with start_nats() as server:
        assert server.url.startswith("nats://127.0.0.1:")
        assert asyncio.run(round_trip(server.url)) == payload[::-1]


def test_valkey_set_get() -> None:
    with start_valkey(maxmemory_mb=64) as server:
        assert server.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(server.url)
        try:
            assert client.set("k", b"v" * 1000, ex=60)
            assert client.get("k") == b"v" * 1000
            assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
            assert client.config_get("save") == {"save": ""}
        finally:
            client.close()


def test_servers_with_a_secret_refuse_clients_without_it() -> None:
    with start_nats(token="s3cret-token") as server:
        assert not asyncio.run(nats_accepts(server.url))
        assert asyncio.run(nats_accepts(server.url, token="s3cret-token"))
        assert "s3cret-token" not in " ".join(server.proc.args)  # not on `ps`
    with start_valkey(password="s3cret-pass") as server:
        with redis.Redis.from_url(server.url) as anonymous:
            with pytest.raises(redis.AuthenticationError):
                anonymous.ping()
        with redis.Redis.from_url(server.url, password="s3cret-pass") as client:
            assert client.ping()
        assert "s3cret-pass" not in " ".join(server.proc.args)


def test_each_service_reaches_only_its_own_nats_subjects() -> None:
    with start_nats(users=nats_users(SERVICE_PASSWORDS)) as server:
        assert not asyncio.run(nats_accepts(server.url))
        assert not asyncio.run(nats_accepts(server.url, user="drafter", password="pw-gateway"))
        assert_least_privilege(server.url)


@pytest.mark.parametrize("start", [start_nats, start_valkey])
def test_stop_frees_the_port_and_is_idempotent(start: Starter) -> None:
    server = start()
    port = port_of(server)
    server.stop()
    assert server.proc.returncode is not None
    assert not server.log_path.parent.exists()
    server.stop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    start(port).stop()


@pytest.mark.parametrize("start", [start_nats, start_valkey])
def test_busy_port_fails_with_the_servers_reason(start: Starter) -> None:
    # The port's holder answers like our server would: only the identity check can tell.
    with start() as holder:
        port = port_of(holder)
        with pytest.raises(RuntimeError, match=rf"(?i){port}.*address already in use"):
            start(port)
        holder_client_host = urlsplit(holder.url).hostname
        with socket.create_connection((holder_client_host, port), timeout=1):
            pass  # the holder still serves


def test_nats_on_a_port_held_by_a_bare_listener_fails() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=r"(?s)exited with code 1.*address already in use"):
            start_nats(port)


@pytest.mark.parametrize("compression", [Compression.NoCompression, Compression.Gzip])
def test_otlp_receiver_gets_an_sdk_exported_trace(compression: Compression) -> None:
    with OtlpReceiver() as receiver:
        provider = TracerProvider(resource=Resource.create({"service.name": "t"}))
        exporter = OTLPSpanExporter(
            endpoint=receiver.endpoint + "/v1/traces", compression=compression
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
        tracer = provider.get_tracer("test")
        try:
            with tracer.start_as_current_span("parent") as parent:
                parent.set_attribute("request.id", "r1")
                with tracer.start_as_current_span("child") as child:
                    child.set_attribute("tokens", 7)
                    child.set_attribute("ok", True)
            assert provider.force_flush(10_000)
        finally:
            provider.shutdown()

        spans = receiver.wait_for(lambda spans: len(spans) >= 2, timeout=10)
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"parent", "child"}
    root, leaf = by_name["parent"], by_name["child"]
    assert root.service == leaf.service == "t"
    assert root.trace_id == leaf.trace_id == format(parent.get_span_context().trace_id, "032x")
    assert leaf.parent_span_id == root.span_id == format(parent.get_span_context().span_id, "016x")
    assert root.parent_span_id == ""
    assert root.attributes == {"request.id": "r1"}
    assert leaf.attributes == {"tokens": 7, "ok": True}


def test_otlp_receiver_ignores_other_signals_and_rejects_json() -> None:
    with OtlpReceiver() as receiver:
        metrics = httpx.post(
            receiver.endpoint + "/v1/metrics",
            content=b"\x00\x01",
            headers={"Content-Type": "application/x-protobuf"},
        )
        assert metrics.status_code == 200
        json_traces = httpx.post(receiver.endpoint + "/v1/traces", json={"resourceSpans": []})
        assert json_traces.status_code == 415
        with pytest.raises(AssertionError, match="got 0: none"):
            receiver.wait_for(lambda spans: bool(spans), timeout=0.1)
    assert receiver.spans() == []
