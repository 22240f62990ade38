"""When a host serves: each kind of server's own answer, as its clients would see it."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable

from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.state import STATE_DIR, ClusterState, HostState
from specmesh.services.cluster_harness.topology import (
    GATEWAY_PORT,
    METRICS_PORT,
    NATS_NODES,
    nats_url,
    valkey_url,
)
from specmesh.shared.infra import nats_routed, valkey_pid

_POLL_S = 0.5
_HTTP_TIMEOUT_S = 10  # a host starting beside others on few cores answers late


def http_ok(url: str) -> bool:
    """Whether url answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as response:
            return response.status == 200
    except OSError:  # refused, timed out, an error status
        return False


def http_json(url: str) -> object | None:
    """The JSON a 200 answer carries; None for any other answer or none."""
    try:
        with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT_S) as response:
            return json.loads(response.read())
    except (OSError, ValueError):  # refused, timed out, an error status, not JSON
        return None


def gateway_url(host: HostState) -> str:
    return f"http://{host.address}:{GATEWAY_PORT}"


def serves(host: HostState, state: ClusterState) -> bool:
    if host.role == "nats":  # and routed to every other node
        return nats_routed(nats_url(host.host), NATS_NODES)
    if host.role == "valkey":  # the pid tells our server from another on the address
        pid = valkey_pid(valkey_url(host.host), state.redis_password)
        return host.process is not None and pid == host.process.pid
    if host.role == "gateway":  # 200 once a decode worker heartbeats
        return http_ok(f"{gateway_url(host)}/health")
    # 200 once connected to NATS and serving
    return http_ok(f"http://{host.address}:{METRICS_PORT}/health")


def wait_serving(hosts: list[HostState], state: ClusterState, timeout_s: float) -> None:
    """Until every host in `hosts` serves; a ClusterError with its log if one exits."""
    pending = list(hosts)
    deadline = time.monotonic() + timeout_s
    while pending:
        for host in pending:
            if host.process is None or not host.process.alive():
                raise _exited(host)
        pending = [h for h in pending if not serves(h, state)]
        if pending and time.monotonic() > deadline:
            names = ", ".join(h.name for h in pending)
            logs = STATE_DIR / "<host>" / "output.log"
            raise ClusterError(f"not serving after {timeout_s:.0f} s: {names} (logs: {logs})")
        if pending:
            time.sleep(_POLL_S)


def wait_until(what: str, probe: Callable[[], object], want: object, timeout_s: float) -> None:
    """Until probe() returns `want`; a ClusterError with the last answer after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (seen := probe()) != want:
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: {seen!r} after {timeout_s:.0f} s, not {want!r}")
        time.sleep(_POLL_S)


def _exited(host: HostState) -> ClusterError:
    process = host.process
    if process is None:
        return ClusterError(f"{host.name} was never started")
    return ClusterError(
        f"{host.name} exited before it served; the end of its log ({process.log}):\n"
        f"{process.log_tail()}"
    )
