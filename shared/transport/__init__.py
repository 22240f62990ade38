"""KV-cache block transport: the store through which prefill and decode services hand over blocks.

A prefill service writes the KV-cache blocks of a prompt; a decode service (on the same host or
another) reads them back instead of recomputing them. Blocks are opaque `bytes` keyed by content
addresses chosen by the caller, so a key always names the same value and the store never needs
invalidation, only expiry. Two backends, picked by config through `make_transport`:

- "shm": files in /dev/shm, for services on one host (no copy through a server process);
- "redis": a valkey/redis server, for services on different hosts;
- "direct": each writer keeps its blocks and serves them over TCP; readers pull them from
  the writer named in the hand-off (services on different hosts, no store in between).

The calls block; an asyncio caller runs them in a worker thread (`asyncio.to_thread`). One
instance may be shared by an engine thread and an asyncio thread: the backends hold no state
between calls except the byte counters, which are guarded by a lock.
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from specmesh.shared.config import nats_servers, option, secret_option
from specmesh.shared.transport.base import KVTransport

KINDS = ("shm", "redis", "direct")


@dataclass(frozen=True)
class DirectOptions:
    host: str = "127.0.0.1"  # the address readers reach this process by
    port: int = 0  # 0: any free port
    capacity: int = 2 << 30  # bytes of blocks kept
    secret: str = ""


def make_transport(
    kind: str,
    namespace: str,
    redis_url: str | None = None,
    redis_options: dict[str, Any] | None = None,
    direct: DirectOptions | None = None,
) -> KVTransport:
    """The backend named by config. `namespace` keeps deployments sharing a store apart;
    `redis_options` (credentials, TLS files) go to the redis client; `direct`: where a
    direct store serves its blocks and how many bytes it keeps."""
    # Imported here so that a shm deployment never loads the redis client.
    if kind == "shm":
        from specmesh.shared.transport.shm import ShmTransport

        return ShmTransport(namespace)
    if kind == "redis":
        if not redis_url:
            raise ValueError("kv transport 'redis' needs a redis url (redis://host:port/db)")
        from specmesh.shared.transport.redis import RedisTransport

        return RedisTransport(redis_url, namespace, **(redis_options or {}))
    if kind == "direct":
        from specmesh.shared.transport.direct import DirectTransport

        d = direct or DirectOptions()
        return DirectTransport(d.host, d.port, d.capacity, d.secret)
    raise ValueError(f"kv transport must be one of {', '.join(KINDS)}, got {kind!r}")


DEFAULT_KV_NAMESPACE = "specmesh"


@dataclass(frozen=True)
class TransportConfig:
    kv_transport: str = option(
        "shm",
        "KV transport: shm (one host), redis (a store across hosts) or direct (decode pulls "
        "a prompt's blocks over TCP from the prefill that computed them)",
        choices=KINDS,
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
    kv_direct_host: str | None = option(
        None,
        "address a prefill serves its blocks on, as other hosts reach it (--kv-transport "
        "direct; default: the local address its connection to NATS comes from)",
    )
    kv_direct_port: int = option(0, "TCP port of a prefill's direct block server (0: any)")
    kv_direct_capacity: int = option(
        2048, "MiB of blocks a prefill keeps for decode to pull (the least recently used go)"
    )
    kv_direct_secret: str | None = secret_option("what readers of direct KV blocks present")

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

    def open(self, nats_url: str = "nats://127.0.0.1:4222") -> KVTransport:
        """`nats_url`: the route towards its first server gives a direct store's default
        address, the one other hosts reach this one by."""
        redis_options = self.redis_options() if self.kv_transport == "redis" else None
        direct = None
        if self.kv_transport == "direct":
            direct = DirectOptions(
                host=self.kv_direct_host or local_address_towards(nats_url),
                port=self.kv_direct_port,
                capacity=self.kv_direct_capacity << 20,
                secret=self.kv_direct_secret or "",
            )
        return make_transport(
            self.kv_transport, self.kv_namespace, self.redis_url, redis_options, direct
        )


def local_address_towards(url: str) -> str:
    """This host's address on the route to the first server of `url` whose name resolves (a
    node that is down may have none: compose's DNS drops a stopped container's name). No
    packet is sent: a UDP socket's connect only picks the route."""
    servers = [urlsplit(server) for server in nats_servers(url)]
    for server in servers[:-1]:
        with contextlib.suppress(socket.gaierror):
            return _address_towards(server.hostname, server.port)
    return _address_towards(servers[-1].hostname, servers[-1].port)


def _address_towards(host: str | None, port: int | None) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host or "127.0.0.1", port or 4222))
        return s.getsockname()[0]
