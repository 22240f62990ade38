"""Cross-host KV transport over the Redis protocol (valkey or redis).

Each call is one round trip: a pipeline or a multi-key command. Expiry is the server's own
(SET PX / PEXPIRE), so every reader sees the same deadline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
from specmesh.shared.transport.base import KVTransport

# Fail fast when the server is down instead of waiting on the OS connect timeout.
_CONNECT_TIMEOUT_S = 5.0
# Generous: a pipeline may carry tens of MiB of blocks.
_SOCKET_TIMEOUT_S = 60.0


def _redact(url: str) -> str:
    """The url without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _px(ttl_s: float) -> int:
    # PX must be a positive integer; a ttl under a millisecond still means "expire at once".
    return max(1, round(ttl_s * 1000))


class RedisTransport(KVTransport):
    """Blocks stored as `<namespace>:<key>` strings on a valkey/redis server.

    redis-py's client is thread-safe (each call takes a connection from its pool), so one
    instance serves the engine thread and the asyncio thread at once.
    """

    def __init__(self, url: str, namespace: str, **options: Any) -> None:
        """`options` go to the client: username, password, ssl_ca_certs, ssl_certfile..."""
        super().__init__()
        self.url = url
        self.namespace = namespace
        self._client = redis.Redis.from_url(
            url,
            socket_connect_timeout=_CONNECT_TIMEOUT_S,
            socket_timeout=_SOCKET_TIMEOUT_S,
            **options,
        )
        # Reach the server now: a wrong url should fail at startup, not on the first request.
        with self._errors():
            self._client.ping()

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        """Turn redis-py's connection errors (not builtin ones) into a ConnectionError
        that names the server."""
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise ConnectionError(f"kv store at {_redact(self.url)} unreachable: {e}") from e

    def _name(self, key: str) -> str:
        return f"{self.namespace}:{key}"

    def put_many(self, items: dict[str, bytes], ttl_s: float) -> None:
        if not items:
            return
        px = _px(ttl_s)
        pipe = self._client.pipeline(transaction=False)
        for key, value in items.items():
            pipe.set(self._name(key), value, px=px)
        with self._errors():
            pipe.execute()
        self._count(written=sum(len(v) for v in items.values()))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._errors():
            values: list[bytes | None] = self._client.mget([self._name(k) for k in keys])
        self._count(read=sum(len(v) for v in values if v is not None))
        return values

    def count_present(self, keys: list[str]) -> int:
        if not keys:
            return 0
        # One EXISTS per key (a multi-key EXISTS only returns a total, not which ones).
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        with self._errors():
            found = pipe.execute()
        n = 0
        for present in found:
            if not present:
                break
            n += 1
        return n

    def touch(self, keys: list[str], ttl_s: float) -> None:
        if not keys:
            return
        px = _px(ttl_s)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.pexpire(self._name(key), px)
        with self._errors():
            pipe.execute()

    def delete_many(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._errors():
            self._client.delete(*(self._name(k) for k in keys))

    def clear(self) -> None:
        with self._errors():
            names = list(self._client.scan_iter(match=f"{self.namespace}:*", count=1000))
            for start in range(0, len(names), 1000):
                self._client.unlink(*names[start : start + 1000])

    def close(self) -> None:
        self._client.close()
