"""Reading blocks from another process's direct KV store (shared/transport/direct.py), and
the wire format both sides speak: per request on a kept-open connection, the reader sends a
length-prefixed msgpack `BlockRequest`; the writer answers with one length-prefixed blob per
key, the length `MISSING` for a key it does not hold."""

from __future__ import annotations

import socket
import struct
import threading

import msgspec

FRAME = struct.Struct("!Q")
MISSING = 2**64 - 1
MAX_REQUEST_BYTES = 64 << 20  # a request names keys; tens of thousands fit
_CONNECT_TIMEOUT_S = 5.0
_SOCKET_TIMEOUT_S = 60.0


class BlockRequest(msgspec.Struct, kw_only=True):
    keys: list[str]
    secret: str = ""


def read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    view, got = memoryview(data), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(data)


def read_frame_length(sock: socket.socket) -> int:
    return FRAME.unpack(read_exact(sock, FRAME.size))[0]


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
        sock.sendall(FRAME.pack(len(body)) + body)
        out: list[bytes | None] = []
        for _ in keys:
            length = read_frame_length(sock)
            out.append(None if length == MISSING else read_exact(sock, length))
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
