"""Direct KV transport: the writer keeps its blocks in memory and readers pull them over TCP.

A prefill instance stores the blocks it computed in its own bounded store and serves them on
a TCP port; its hand-off names that address, and the decode worker reads the blocks straight
from it: one copy across the network instead of two through a store server. Blocks die with
their writer (a reader then computes them), and one prefill's blocks are not another's prefix.

Wire format, per request on a kept-open connection: the reader sends a length-prefixed
msgpack `BlockRequest`; the writer answers with one length-prefixed blob per key, the
length `MISSING` for a key it does not hold.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import socket
import socketserver
import struct
import threading
import time

import msgspec

from shared.transport.base import KVTransport

_FRAME = struct.Struct("!Q")
MISSING = 2**64 - 1
_MAX_REQUEST_BYTES = 64 << 20  # a request names keys; tens of thousands fit
_CONNECT_TIMEOUT_S = 5.0
_SOCKET_TIMEOUT_S = 60.0


class BlockRequest(msgspec.Struct, kw_only=True):
    keys: list[str]
    secret: str = ""


class BlockStore:
    """Blobs with an expiry, at most `capacity` bytes: the least recently used go first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._items: collections.OrderedDict[str, tuple[bytes, float]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, key: str, value: bytes, ttl_s: float) -> None:
        with self._lock:
            self._drop(key)
            self._items[key] = (value, time.monotonic() + ttl_s)
            self.size += len(value)
            while self.size > self.capacity:
                self._drop(next(iter(self._items)))

    def get(self, key: str) -> bytes | None:
        with self._lock:
            item = self._live(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def touch(self, key: str, ttl_s: float) -> None:
        with self._lock:
            if (item := self._live(key)) is not None:
                self._items[key] = (item[0], time.monotonic() + ttl_s)
                self._items.move_to_end(key)

    def delete(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.size = 0

    def _live(self, key: str) -> tuple[bytes, float] | None:
        item = self._items.get(key)
        if item is not None and item[1] < time.monotonic():
            self._drop(key)
            return None
        return item

    def _drop(self, key: str) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.size -= len(item[0])


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(data)


def _read_frame_length(sock: socket.socket) -> int:
    return _FRAME.unpack(_read_exact(sock, _FRAME.size))[0]


class _BlockHandler(socketserver.BaseRequestHandler):
    server: _BlockServer

    def setup(self) -> None:
        self.server.connections.add(self.request)

    def finish(self) -> None:
        self.server.connections.discard(self.request)

    def handle(self) -> None:
        """Answer requests until the reader hangs up or sends something malformed."""
        try:
            while True:
                length = _read_frame_length(self.request)
                if length > _MAX_REQUEST_BYTES:
                    return
                req = msgspec.msgpack.decode(_read_exact(self.request, length), type=BlockRequest)
                if not hmac.compare_digest(req.secret, self.server.secret):
                    return
                self._answer(req.keys)
        except (ConnectionError, OSError, msgspec.DecodeError):
            return

    def _answer(self, keys: list[str]) -> None:
        for key in keys:
            blob = self.server.store.get(key)
            if blob is None:
                self.request.sendall(_FRAME.pack(MISSING))
            else:
                self.request.sendall(_FRAME.pack(len(blob)))
                self.request.sendall(blob)


class _BlockServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, host: str, port: int, store: BlockStore, secret: str) -> None:
        super().__init__((host, port), _BlockHandler)
        self.store, self.secret = store, secret
        self.connections: set[socket.socket] = set()

    def close(self) -> None:
        """Stop serving and hang up on every reader (as the writer's exit would)."""
        self.shutdown()
        self.server_close()
        for conn in list(self.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class DirectTransport(KVTransport):
    """Blocks kept in this process and served at `address` ("host:port") to readers."""

    def __init__(self, host: str, port: int, capacity: int, secret: str = "") -> None:
        """Serves on `host` (the address other hosts reach this one by), `port` 0: any."""
        super().__init__(peer_secret=secret)
        self.store = BlockStore(capacity)
        self._server = _BlockServer(host, port, self.store, secret)
        bound_host, bound_port = self._server.server_address[:2]
        self.address = f"{bound_host}:{bound_port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def put_many(self, items: dict[str, bytes], ttl_s: float) -> None:
        for key, value in items.items():
            self.store.put(key, value, ttl_s)
        self._count(written=sum(map(len, items.values())))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        values = [self.store.get(key) for key in keys]
        self._count(read=sum(len(v) for v in values if v is not None))
        return values

    def count_present(self, keys: list[str]) -> int:
        n = 0
        while n < len(keys) and self.store.get(keys[n]) is not None:
            n += 1
        return n

    def touch(self, keys: list[str], ttl_s: float) -> None:
        for key in keys:
            self.store.touch(key, ttl_s)

    def delete_many(self, keys: list[str]) -> None:
        for key in keys:
            self.store.delete(key)

    def clear(self) -> None:
        self.store.clear()

    def close(self) -> None:
        self._server.close()


class PeerReader:
    """Reads blocks from another process's DirectTransport, over one kept-open connection
    (reconnected once when it broke since the last call)."""

    def __init__(self, address: str, secret: str = "") -> None:
        host, _, port = address.rpartition(":")
        self.address, self._host_port = address, (host, int(port))
        self._secret = secret
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The value of each key, None where the writer lacks it; ConnectionError when the
        writer cannot be reached."""
        with self._lock:
            try:
                return self._request(keys)
            except OSError:  # a connection the writer closed while idle: once more
                self._close()
            try:
                return self._request(keys)
            except OSError as e:
                self._close()
                raise ConnectionError(f"KV blocks at {self.address} unreachable: {e}") from e

    def _request(self, keys: list[str]) -> list[bytes | None]:
        sock = self._connect()
        body = msgspec.msgpack.encode(BlockRequest(keys=keys, secret=self._secret))
        sock.sendall(_FRAME.pack(len(body)) + body)
        out: list[bytes | None] = []
        for _ in keys:
            length = _read_frame_length(sock)
            out.append(None if length == MISSING else _read_exact(sock, length))
        return out

    def _connect(self) -> socket.socket:
        if self._sock is None:
            self._sock = socket.create_connection(self._host_port, timeout=_CONNECT_TIMEOUT_S)
            self._sock.settimeout(_SOCKET_TIMEOUT_S)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self._sock

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._close()
