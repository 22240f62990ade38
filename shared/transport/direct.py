"""Direct KV transport: the writer keeps its blocks in memory and readers pull them over TCP.

A prefill instance stores the blocks it computed in its own bounded store and serves them on
a TCP port; its hand-off names that address, and the decode worker reads the blocks straight
from it: one copy across the network instead of two through a store server. Blocks die with
their writer (a reader then computes them), and one prefill's blocks are not another's prefix.

Readers use `peer.PeerReader`; `peer` also holds the wire format.
"""

from __future__ import annotations

import collections
import contextlib
import hmac
import socket
import socketserver
import threading
import time

import msgspec
from specmesh.shared.transport.base import KVTransport
from specmesh.shared.transport.peer import (
    FRAME,
    MAX_REQUEST_BYTES,
    MISSING,
    BlockRequest,
    read_exact,
    read_frame_length,
)


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
                length = read_frame_length(self.request)
                if length > MAX_REQUEST_BYTES:
                    return
                req = msgspec.msgpack.decode(read_exact(self.request, length), type=BlockRequest)
                if not hmac.compare_digest(req.secret, self.server.secret):
                    return
                self._answer(req.keys)
        except (ConnectionError, OSError, msgspec.DecodeError):
            return

    def _answer(self, keys: list[str]) -> None:
        for key in keys:
            blob = self.server.store.get(key)
            if blob is None:
                self.request.sendall(FRAME.pack(MISSING))
            else:
                self.request.sendall(FRAME.pack(len(blob)))
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
