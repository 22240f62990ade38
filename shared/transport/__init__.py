"""KV-cache block transport: the store through which prefill and decode services hand over blocks.

A prefill service writes the KV-cache blocks of a prompt; a decode service (on the same host or
another) reads them back instead of recomputing them. Blocks are opaque `bytes` keyed by content
addresses chosen by the caller, so a key always names the same value and the store never needs
invalidation, only expiry. Two backends, picked by config through `make_transport`:

- "shm": files in /dev/shm, for services on one host (no copy through a server process);
- "redis": a valkey/redis server, for services on different hosts.

The calls block; an asyncio caller runs them in a worker thread (`asyncio.to_thread`). One
instance may be shared by an engine thread and an asyncio thread: the backends hold no state
between calls except the byte counters, which are guarded by a lock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from shared.config import option, secret_option
from shared.transport.base import KVTransport


def make_transport(
    kind: str,
    namespace: str,
    redis_url: str | None = None,
    redis_options: dict[str, Any] | None = None,
) -> KVTransport:
    """The backend named by config. `namespace` keeps deployments sharing a store apart;
    `redis_options` (credentials, TLS files) go to the redis client."""
    # Imported here so that a shm deployment never loads the redis client.
    if kind == "shm":
        from shared.transport.shm import ShmTransport

        return ShmTransport(namespace)
    if kind == "redis":
        if not redis_url:
            raise ValueError("kv transport 'redis' needs a redis url (redis://host:port/db)")
        from shared.transport.redis import RedisTransport

        return RedisTransport(redis_url, namespace, **(redis_options or {}))
    raise ValueError(f"kv transport must be 'shm' or 'redis', got {kind!r}")


DEFAULT_KV_NAMESPACE = "specmesh"


@dataclass
class TransportConfig:
    kv_transport: str = option(
        "shm", "KV transport: shm (one host) or redis (across hosts)", choices=("shm", "redis")
    )
    redis_url: str | None = option(
        None, "redis://host:port of the KV store (--kv-transport redis; rediss:// for TLS)"
    )
    redis_username: str | None = option(None, "KV store user (ACL), with --redis-password")
    redis_password: str | None = secret_option("KV store password")
    redis_tls_ca: str | None = option(None, "CA file to verify the KV store by (rediss://)")
    redis_tls_cert: str | None = option(None, "client certificate for KV store mutual TLS")
    redis_tls_key: str | None = option(None, "client certificate's key for KV store mutual TLS")
    kv_namespace: str = option(
        DEFAULT_KV_NAMESPACE, "namespace of this deployment's blocks in the store"
    )
    kv_ttl: float = option(60.0, "seconds a stored KV block lives after its last use")

    def redis_options(self) -> dict[str, Any]:
        """Credentials and TLS files as redis client arguments (only those that are set)."""
        tls = {
            "ssl_ca_certs": self.redis_tls_ca,
            "ssl_certfile": self.redis_tls_cert,
            "ssl_keyfile": self.redis_tls_key,
        }
        tls = {k: v for k, v in tls.items() if v}
        if tls and urlsplit(self.redis_url or "").scheme != "rediss":
            raise ValueError("--redis-tls-* options need a rediss:// --redis-url")
        auth = {"username": self.redis_username, "password": self.redis_password}
        return {**{k: v for k, v in auth.items() if v}, **tls}

    def open(self) -> KVTransport:
        redis_options = self.redis_options() if self.kv_transport == "redis" else None
        return make_transport(self.kv_transport, self.kv_namespace, self.redis_url, redis_options)
