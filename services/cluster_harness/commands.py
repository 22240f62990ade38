"""The subcommands of `scripts/cluster`: up, hosts, kill, start, partition, heal, down."""

from __future__ import annotations

import secrets
import signal
import socket
import sys
import time

from specmesh.services.cluster_harness import netns, state
from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.launch import (
    Settings,
    nats_process,
    service_processes,
    valkey_process,
)
from specmesh.services.cluster_harness.processes import Process, stop_all
from specmesh.services.cluster_harness.readiness import (
    gateway_url,
    http_json,
    http_ok,
    wait_serving,
    wait_until,
)
from specmesh.services.cluster_harness.state import STATE_DIR, ClusterState, HostState
from specmesh.services.cluster_harness.topology import (
    BRIDGE,
    GATEWAY_PORT,
    NATS_MONITOR_PORT,
    all_hosts,
)
from specmesh.shared.protocol import SERVICE_USERS

SERVICES_TIMEOUT_S = 600  # model loads on a machine the hosts share, after a first fetch
SERVERS_TIMEOUT_S = 30
STOP_GRACE_S = 10.0


def up(port: int | None, shape: netns.LinkShape, settings: Settings) -> None:
    netns.check_namespaces()
    if state.is_up() or netns.bridge_exists() or netns.our_namespaces():
        raise ClusterError(
            "a cluster is already up (scripts/cluster hosts lists it; scripts/cluster down "
            "removes it)"
        )
    if port is not None:
        _check_free(port)
    started = time.monotonic()
    hosts = [HostState(h.name, h.role, h.address) for h in all_hosts()]
    cluster = ClusterState(
        hosts, secrets.token_hex(24), kv_secret=secrets.token_hex(24), local_port=port
    )
    cluster.save()  # from here on, a failure takes everything down again
    try:
        _build(cluster, settings, shape)
    except BaseException:
        try:
            down(quiet=True)
        except ClusterError as exc:  # the reason up failed matters more; say both
            print(f"scripts/cluster up: cleaning up failed too: {exc}", file=sys.stderr)
        raise
    url = gateway_url(cluster.host("gateway"))
    print(f"specmesh cluster is up in {time.monotonic() - started:.0f} s: {url}/v1")
    if port is not None:
        print(f"  and at http://127.0.0.1:{port}/v1")


def settings(model: str | None, algorithm: str, kv_transport: str) -> Settings:
    """What every service host is started with; a bad option fails here."""
    from specmesh.shared.model.fetch import resolve_model
    from specmesh.shared.speculative.config import SpeculativeConfig
    from specmesh.shared.speculative.factory import drafter_target_features

    path = str(resolve_model(model))  # fetched once here, not per host
    # a bad algorithm or draft head fails here, before any host starts
    spec = SpeculativeConfig(speculative_algorithm=algorithm).resolved(path)
    drafter_target_features(spec, path)
    passwords = {user: secrets.token_hex(24) for user in SERVICE_USERS}
    return Settings(path, algorithm, kv_transport, passwords)


def _check_free(port: int) -> None:
    with socket.socket() as probe:
        # as the forwarder binds: a connection of the last run in TIME_WAIT is no owner
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise ClusterError(f"--port {port}: 127.0.0.1:{port} is taken ({exc})") from None


def _build(cluster: ClusterState, settings: Settings, shape: netns.LinkShape) -> None:
    netns.create_bridge()
    for host in cluster.hosts:
        netns.add_host(host.host, shape)
    print(f"{len(cluster.hosts)} hosts on {BRIDGE}; starting NATS and valkey", flush=True)
    servers = [h for h in cluster.hosts if h.role in ("nats", "valkey")]
    for host in servers:
        if host.role == "nats":
            _start(cluster, host, nats_process(host, cluster, settings))
        else:
            _start(cluster, host, valkey_process(host, cluster))
    wait_serving(servers, cluster, SERVERS_TIMEOUT_S)
    print("NATS cluster formed, valkey serving; starting the services", flush=True)
    services = [h for h in cluster.hosts if h not in servers]
    for name, process in service_processes(cluster, settings).items():
        _start(cluster, cluster.host(name), process)
    wait_serving(services, cluster, SERVICES_TIMEOUT_S)
    pools = {kind: len(cluster.by_role(kind)) for kind in ("decode", "drafter")}
    wait_until(
        "the instances the gateway sees", lambda: _instances(cluster), pools, SERVERS_TIMEOUT_S
    )
    if cluster.local_port is not None:
        _start_forwarder(cluster)


def _start(cluster: ClusterState, host: HostState, process: Process) -> None:
    host.process = process
    process.start()
    cluster.save()


def _instances(cluster: ClusterState) -> object:
    """How many decode workers and drafters the gateway sees (SGLang's server info)."""
    info = http_json(f"{gateway_url(cluster.host('gateway'))}/get_server_info")
    if isinstance(info, dict) and info.get("internal_states"):
        return info["internal_states"][0].get("instances")
    return info  # no answer yet


def _start_forwarder(cluster: ClusterState) -> None:
    gateway = cluster.host("gateway")
    forward = [sys.executable, "-m", "specmesh.services.cluster_harness.forward"]
    argv = [*forward, str(cluster.local_port), gateway.address, str(GATEWAY_PORT)]
    log = state.host_dir("forwarder") / "output.log"
    cluster.forwarder = Process(argv, {}, log=str(log), cwd=str(STATE_DIR))
    cluster.forwarder.start()
    cluster.save()
    local = f"http://127.0.0.1:{cluster.local_port}/health"
    forwarder = cluster.forwarder

    def forwarding() -> bool:
        if not forwarder.alive():
            raise ClusterError(f"the forwarder exited:\n{forwarder.log_tail()}")
        return http_ok(local)

    wait_until(f"the gateway answering at {local}", forwarding, True, SERVERS_TIMEOUT_S)


def hosts() -> None:
    cluster = state.load()
    connected_to = _nats_connections(cluster)
    rows = [("host", "address", "runs", "state", "connected to")]
    for host in cluster.hosts:
        runs = {"nats": "nats-server", "valkey": "valkey-server"}.get(host.role, host.role)
        status = "running" if host.process and host.process.alive() else "not running"
        if not netns.link_is_up(host.host):
            status += ", partitioned"
        rows.append((host.name, host.address, runs, status, connected_to.get(host.name, "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        print("  ".join(cells).rstrip())
    url = gateway_url(cluster.host("gateway"))
    local = f" and http://127.0.0.1:{cluster.local_port}/v1" if cluster.local_port else ""
    print(f"gateway: {url}/v1{local}; logs: {STATE_DIR}/<host>/output.log")


def _nats_connections(cluster: ClusterState) -> dict[str, str]:
    """Which NATS node each service is connected to now (the clients' names are their
    instance ids, which are their hosts' names)."""
    where: dict[str, str] = {}
    for node in cluster.by_role("nats"):
        connz = http_json(f"http://{node.address}:{NATS_MONITOR_PORT}/connz?limit=1024")
        for connection in connz.get("connections", []) if isinstance(connz, dict) else []:
            if connection.get("name"):
                where[connection["name"]] = node.name
    return where


def kill(name: str) -> None:
    """SIGKILL to the host's processes: a crash, with no chance to drain."""
    cluster = state.load()
    host = cluster.host(name)
    if host.process is None or not host.process.alive():
        raise ClusterError(f"{name} is not running (scripts/cluster start {name} starts it)")
    host.process.signal(signal.SIGKILL)
    print(f"{name}: killed")


def start(name: str) -> None:
    """Start a killed host's process again, as `up` started it; wait until it serves."""
    cluster = state.load()
    host = cluster.host(name)
    if host.process is None:
        raise ClusterError(f"{name} was never started (scripts/cluster down, then up)")
    if host.process.alive():
        raise ClusterError(f"{name} is running")
    _start(cluster, host, host.process)
    if not netns.link_is_up(host.host):  # nothing here can reach it to see it serve
        print(f"{name}: started, partitioned")
        return
    wait_serving([host], cluster, SERVICES_TIMEOUT_S)
    print(f"{name}: serving")


def partition(name: str) -> None:
    _set_link(name, up=False, verb="partitioned")


def heal(name: str) -> None:
    _set_link(name, up=True, verb="healed")


def _set_link(name: str, up: bool, verb: str) -> None:
    host = state.load().host(name).host
    netns.set_link(host, up)
    print(f"{name}: {verb}")


def down(quiet: bool = False) -> None:
    """Stop every process, delete every namespace, link and the state; also after a crash
    or a lost state (what is ours is found by its prefix), and when nothing is up."""
    had_state = state.is_up()
    try:
        cluster: ClusterState | None = state.load()
    except ClusterError:  # none, or damaged: the namespaces still tell what is ours
        cluster = None
    if cluster is not None:  # services first: they drain while NATS still carries it
        servers = [h.process for h in cluster.hosts if h.role in ("nats", "valkey")]
        stop_all([p for p in cluster.processes() if p not in servers], [], STOP_GRACE_S)
    strays = [pid for ns in netns.our_namespaces() for pid in netns.namespace_pids(ns)]
    stop_all(cluster.processes() if cluster else [], strays, STOP_GRACE_S)
    removed = netns.remove_network()
    state.remove()
    if not quiet:
        print(f"removed {removed} hosts" if removed or had_state else "nothing was up")
