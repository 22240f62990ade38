"""What `up` made, kept on disk for the later subcommands: the hosts, their processes,
the secrets the servers were started with. Root-only: it holds passwords."""

from __future__ import annotations

import shutil
from pathlib import Path

import msgspec
from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.processes import Process
from specmesh.services.cluster_harness.topology import Host

STATE_DIR = Path("/run/specmesh-cluster")
_STATE_FILE = STATE_DIR / "state.json"


class HostState(msgspec.Struct):
    name: str
    role: str
    address: str
    process: Process | None = None  # None until it is started

    @property
    def host(self) -> Host:
        return Host(self.name, self.role, self.address)


class ClusterState(msgspec.Struct):
    hosts: list[HostState]
    redis_password: str
    kv_secret: str  # what readers of a prefill's direct block server present
    local_port: int | None = None  # --port: the gateway at 127.0.0.1:<port> too
    forwarder: Process | None = None  # what serves local_port

    def host(self, name: str) -> HostState:
        for host in self.hosts:
            if host.name == name:
                return host
        names = ", ".join(h.name for h in self.hosts)
        raise ClusterError(f"no host {name!r}; the hosts are {names}")

    def by_role(self, role: str) -> list[HostState]:
        return [h for h in self.hosts if h.role == role]

    def processes(self) -> list[Process]:
        found = [h.process for h in self.hosts if h.process is not None]
        return found + ([self.forwarder] if self.forwarder else [])

    def save(self) -> None:
        STATE_DIR.mkdir(mode=0o700, exist_ok=True)
        temporary = _STATE_FILE.with_suffix(".tmp")
        temporary.write_bytes(msgspec.json.format(msgspec.json.encode(self)))
        temporary.replace(_STATE_FILE)  # a crash mid-write leaves the previous state


def host_dir(name: str) -> Path:
    """Where a host's config files and log go."""
    STATE_DIR.mkdir(mode=0o700, exist_ok=True)
    path = STATE_DIR / name
    path.mkdir(exist_ok=True)
    return path


def is_up() -> bool:
    return _STATE_FILE.exists()


def load() -> ClusterState:
    try:
        return msgspec.json.decode(_STATE_FILE.read_bytes(), type=ClusterState)
    except FileNotFoundError:
        raise ClusterError("no cluster is up (scripts/cluster up starts one)") from None
    except msgspec.DecodeError as exc:
        raise ClusterError(f"{_STATE_FILE} is damaged ({exc}); scripts/cluster down") from None


def remove() -> None:
    shutil.rmtree(STATE_DIR, ignore_errors=True)
