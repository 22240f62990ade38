"""The hosts: their names, addresses, and what runs on each.

Every name the harness gives the kernel starts with PREFIX, so `down` finds what it made
even when its state is lost. A host's namespace and the root-side end of its link (a veth
on the bridge) share the host's name after the prefix; Linux caps link names at 15 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "smc-"
BRIDGE = f"{PREFIX}bridge"
NETWORK = "10.77.0"  # a /24; the root namespace is .1 on the bridge, hosts from .10
ROOT_ADDRESS = f"{NETWORK}.1"
PREFIX_LEN = 24

NATS_NODES = 3
NATS_PORT = 4222
NATS_CLUSTER_PORT = 6222
NATS_MONITOR_PORT = 8222  # /connz: which node each service is connected to
VALKEY_PORT = 6379
GATEWAY_PORT = 8000
METRICS_PORT = 9100  # every other service's /metrics and /health, as in docker-compose.yml

# (host, the service kind it runs), one instance per host
SERVICE_HOSTS = (
    ("gateway", "gateway"),
    ("tokenizer", "tokenizer"),
    ("prefill", "prefill"),
    ("decode-0", "decode"),
    ("decode-1", "decode"),
    ("drafter-0", "drafter"),
    ("drafter-1", "drafter"),
)


@dataclass(frozen=True)
class Host:
    name: str
    role: str  # "nats", "valkey", or the service kind it runs
    address: str

    @property
    def namespace(self) -> str:
        return f"{PREFIX}{self.name}"

    @property
    def link(self) -> str:
        """The root namespace's end of the host's veth pair (a port of the bridge)."""
        return f"{PREFIX}{self.name}"


def all_hosts() -> list[Host]:
    roles = [(f"nats-{i}", "nats") for i in range(NATS_NODES)]
    roles += [("valkey", "valkey"), *SERVICE_HOSTS]
    return [Host(name, role, f"{NETWORK}.{10 + i}") for i, (name, role) in enumerate(roles)]


def nats_url(host: Host) -> str:
    return f"nats://{host.address}:{NATS_PORT}"


def valkey_url(host: Host) -> str:
    return f"redis://{host.address}:{VALKEY_PORT}/0"


def nats_urls_for(index: int, nodes: list[Host]) -> str:
    """The --nats-url of the index-th service host: every node (for fail-over), listed from
    a different one for consecutive hosts, as a deployment's hosts would list them. The
    client shuffles the list before it connects, so the node a service reaches first is
    random; `scripts/cluster hosts` shows it."""
    start = index % len(nodes)
    return ",".join(nats_url(node) for node in nodes[start:] + nodes[:start])
