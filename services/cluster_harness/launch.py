"""What each host runs: nats-server and valkey-server as shared/infra.py starts them, and
the services with the flags and SPECMESH_* variables of docker-compose.yml (per-service
NATS users, KV blocks through valkey, /metrics and /health on port 9100)."""

from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass

from specmesh.services.cluster_harness.processes import Process
from specmesh.services.cluster_harness.state import ClusterState, HostState, host_dir
from specmesh.services.cluster_harness.topology import (
    GATEWAY_PORT,
    METRICS_PORT,
    NATS_CLUSTER_PORT,
    NATS_MONITOR_PORT,
    NATS_PORT,
    VALKEY_PORT,
    nats_urls_for,
    valkey_url,
)
from specmesh.shared.config import dataclass_argv
from specmesh.shared.cores import plan_cores
from specmesh.shared.infra import nats_server_argv, valkey_server_argv
from specmesh.shared.protocol import nats_users

# kinds that hold K/V or draft for it: they take the speculation and KV transport options
_SPECULATING = ("prefill", "decode", "drafter")


@dataclass
class Settings:
    model: str  # an HF directory every host reads (hosts share this machine's disk)
    speculative_algorithm: str
    kv_transport: str  # redis (through the valkey host) or direct (decode pulls from prefill)
    nats_passwords: dict[str, str]  # one NATS user per kind of service


def _process(host: HostState, argv: list[str], env: dict[str, str]) -> Process:
    """argv run in the host's namespace, its output in the host's log."""
    workdir = host_dir(host.name)
    wrapped = ["ip", "netns", "exec", host.host.namespace, *argv]
    return Process(wrapped, env, log=str(workdir / "output.log"), cwd=str(workdir))


def nats_process(host: HostState, state: ClusterState, settings: Settings) -> Process:
    """A node of the NATS cluster, named after its host, routed to every other node."""
    nodes = state.by_role("nats")
    routes = [f"nats-route://{node.address}:{NATS_CLUSTER_PORT}" for node in nodes]
    argv = nats_server_argv(
        host_dir(host.name),
        NATS_PORT,
        host.name,
        host=host.address,
        monitor_port=NATS_MONITOR_PORT,
        users=nats_users(settings.nats_passwords),
        cluster_port=NATS_CLUSTER_PORT,
        routes=routes,
    )
    return _process(host, argv, {})


def valkey_process(host: HostState, state: ClusterState) -> Process:
    workdir = host_dir(host.name)
    argv = valkey_server_argv(
        workdir, VALKEY_PORT, host=host.address, password=state.redis_password
    )
    return _process(host, argv, {})


def service_processes(state: ClusterState, settings: Settings) -> dict[str, Process]:
    """Each service host's process, by host name."""
    services = [h for h in state.hosts if h.role not in ("nats", "valkey")]
    # Cores as `specmesh up` shares them: the hosts share this machine's CPUs.
    counts = Counter(h.role for h in services)
    placements = plan_cores(sorted(os.sched_getaffinity(0)), dict(counts))
    nodes = [h.host for h in state.by_role("nats")]
    valkey = state.host("valkey").host
    # Options the caller set as SPECMESH_* variables reach every service, as in compose.
    passed = {k: v for k, v in os.environ.items() if k.startswith("SPECMESH_")}
    seen: Counter[str] = Counter()
    processes = {}
    for index, host in enumerate(services):
        kind = host.role
        argv = [sys.executable, "-m", f"specmesh.services.{kind}", "--instance-id", host.name]
        argv += ["--nats-url", nats_urls_for(index, nodes), "--nats-user", kind]
        argv += ["--model", settings.model]
        env = {**passed, "PYTHONUNBUFFERED": "1"}
        env["SPECMESH_NATS_PASSWORD"] = settings.nats_passwords[kind]  # secrets: not on `ps`
        if kind == "gateway":
            argv += ["--host", "0.0.0.0", "--port", str(GATEWAY_PORT)]
        else:  # the gateway serves /metrics and /health on its own port
            argv += ["--metrics-host", host.address, "--metrics-port", str(METRICS_PORT)]
        if kind in _SPECULATING:
            argv += ["--speculative-algorithm", settings.speculative_algorithm]
            argv += ["--kv-transport", settings.kv_transport]
            if settings.kv_transport == "redis":
                argv += ["--redis-url", valkey_url(valkey)]
                env["SPECMESH_REDIS_PASSWORD"] = state.redis_password
            else:
                env["SPECMESH_KV_DIRECT_SECRET"] = state.kv_secret
        argv += dataclass_argv(placements[f"{kind}-{seen[kind]}"])
        seen[kind] += 1
        processes[host.name] = _process(host, argv, env)
    return processes
