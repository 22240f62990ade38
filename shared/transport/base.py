"""The interface every KV transport backend implements."""

from __future__ import annotations

import abc
import threading
from typing import Protocol


class BlockReader(Protocol):
    def get_many(self, keys: list[str]) -> list[bytes | None]: ...


class KVTransport(abc.ABC):
    """Store of immutable blobs by key. Values for one key are always identical
    (content-addressed), so concurrent writers of the same key are harmless."""

    # Where other processes read this store's blocks directly ("host:port"); None when they
    # share the store itself (a store server, or this host's /dev/shm).
    address: str | None = None

    def __init__(self, peer_secret: str = "") -> None:
        """`peer_secret`: what direct stores (this one and its peers) require of readers."""
        # Bytes actually moved by put_many / get_many, for metrics.
        self.bytes_written = 0
        self.bytes_read = 0
        self._lock = threading.Lock()  # the byte counters and the peers
        self.peer_secret = peer_secret
        self._peers: dict[str, BlockReader] = {}

    def source(self, address: str | None) -> BlockReader:
        """What reads the blocks a writer at `address` handed over: this store itself when
        the writer shares it, else a connection to the writer's direct store."""
        if address is None or address == self.address:
            return self
        from specmesh.shared.transport.peer import PeerReader  # only deployments that use it

        with self._lock:
            if address not in self._peers:
                self._peers[address] = PeerReader(address, self.peer_secret)
            return self._peers[address]

    def _count(self, written: int = 0, read: int = 0) -> None:
        with self._lock:
            self.bytes_written += written
            self.bytes_read += read

    @abc.abstractmethod
    def put_many(self, items: dict[str, bytes], ttl_s: float) -> None:
        """Store every item; each key expires `ttl_s` seconds from now."""

    @abc.abstractmethod
    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The value of each key, None where it is missing or expired."""

    @abc.abstractmethod
    def count_present(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, are present: the longest stored prefix of a
        prompt's block chain, which is what a reader can reuse."""

    @abc.abstractmethod
    def touch(self, keys: list[str], ttl_s: float) -> None:
        """Push the expiry of the present keys to now + `ttl_s`; missing keys are ignored."""

    @abc.abstractmethod
    def delete_many(self, keys: list[str]) -> None:
        """Remove the keys; missing keys are ignored."""

    @abc.abstractmethod
    def clear(self) -> None:
        """Remove every block of this namespace (a prefix-cache flush)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections; stored blobs stay for other processes."""
