"""The network: a bridge in the root namespace, and per host a namespace joined to it by
a veth pair, through iproute2's `ip` and `tc`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass

from specmesh.services.cluster_harness.errors import ClusterError
from specmesh.services.cluster_harness.topology import (
    BRIDGE,
    PREFIX,
    PREFIX_LEN,
    ROOT_ADDRESS,
    Host,
)


def _run(argv: list[str]) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ClusterError(f"{argv[0]} not found: apt-get install -y iproute2") from None
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed: {done.stderr.strip()}")
    return done.stdout


def ip(*args: str) -> str:
    return _run(["ip", *args])


def check_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError("needs root: it creates network namespaces and links (try sudo)")
    if shutil.which("ip") is None:
        raise ClusterError("`ip` not found: apt-get install -y iproute2")


def check_namespaces() -> None:
    """Raise unless this process may create network namespaces (root, CAP_NET_ADMIN)."""
    check_root()
    probe = f"{PREFIX}probe-{os.getpid()}"  # ours by its prefix: `down` removes a leftover
    try:
        ip("netns", "add", probe)
    except ClusterError as exc:
        raise ClusterError(f"the kernel refuses network namespaces here: {exc}") from None
    ip("netns", "delete", probe)


def create_bridge() -> None:
    ip("link", "add", BRIDGE, "type", "bridge")
    ip("addr", "add", f"{ROOT_ADDRESS}/{PREFIX_LEN}", "dev", BRIDGE)
    ip("link", "set", BRIDGE, "up")
    if _bridges_are_filtered():
        _run(["iptables", "-I", *_FORWARD_OUR_BRIDGE])


# With br_netfilter loaded (Docker loads it), frames between two ports of a bridge pass
# iptables' FORWARD chain, whose policy Docker sets to DROP: the hosts could not talk.
_FORWARD_OUR_BRIDGE = ["FORWARD", "-i", BRIDGE, "-o", BRIDGE, "-j", "ACCEPT"]


def _bridges_are_filtered() -> bool:
    nf = "/proc/sys/net/bridge/bridge-nf-call-iptables"
    return os.path.exists(nf) and shutil.which("iptables") is not None


def _remove_forward_rules() -> None:
    if not _bridges_are_filtered():
        return
    check = ["iptables", "-C", *_FORWARD_OUR_BRIDGE]
    while subprocess.run(check, capture_output=True).returncode == 0:
        _run(["iptables", "-D", *_FORWARD_OUR_BRIDGE])


def bridge_exists() -> bool:
    return subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0


@dataclass(frozen=True)
class LinkShape:
    """What each host's link does to the packets it sends (None: nothing)."""

    delay_ms: float | None = None
    rate_mbit: float | None = None  # megabits/s at most


def add_host(host: Host, shape: LinkShape) -> None:
    """The host's namespace, its eth0 on the bridge at its address, shaped as `shape`."""
    ns = host.namespace
    ip("netns", "add", ns)
    ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", ns)
    ip("link", "set", host.link, "master", BRIDGE, "up")
    ip("-n", ns, "addr", "add", f"{host.address}/{PREFIX_LEN}", "dev", "eth0")
    ip("-n", ns, "link", "set", "eth0", "up")
    ip("-n", ns, "link", "set", "lo", "up")
    if shape.delay_ms:
        _delay(ns, shape.delay_ms)
    if shape.rate_mbit:
        limit_rate(host, shape.rate_mbit)


def _qdisc(namespace: str, option: str) -> list[str]:
    if shutil.which("tc") is None:
        raise ClusterError(f"{option} needs `tc`: apt-get install -y iproute2")
    return ["ip", "netns", "exec", namespace, "tc", "qdisc", "replace", "dev", "eth0", "root"]


def limit_rate(host: Host, rate_mbit: float | None) -> None:
    """A token bucket on what the host sends (bursts of 1 ms at the rate, queued up to
    50 ms), replacing any; None: none."""
    if rate_mbit is None:  # deleting the default qdisc fails: nothing to remove then
        argv = ["ip", "netns", "exec", host.namespace, "tc", "qdisc", "del", "dev", "eth0", "root"]
        subprocess.run(argv, capture_output=True, check=False)
        return
    burst = max(16_000, round(rate_mbit * 1e6 / 8 / 1000))
    argv = [*_qdisc(host.namespace, "--rate-mbit"), "tbf", "rate", f"{rate_mbit}mbit"]
    _run([*argv, "burst", str(burst), "latency", "50ms"])


def _delay(namespace: str, delay_ms: float) -> None:
    argv = _qdisc(namespace, "--delay-ms")
    try:
        _run([*argv, "netem", "delay", f"{delay_ms}ms"])
    except ClusterError as exc:
        raise ClusterError(
            f"--delay-ms needs the kernel's netem queueing discipline (sch_netem), which "
            f"this kernel does not offer; start without --delay-ms ({exc})"
        ) from None


def set_link(host: Host, up: bool) -> None:
    """Connect (up) or cut (down) the host's link to the bridge: a partition, both ways."""
    ip("link", "set", host.link, "up" if up else "down")


def link_is_up(host: Host) -> bool:
    shown = json.loads(ip("-j", "link", "show", host.link))
    return "UP" in shown[0]["flags"]


def our_namespaces() -> list[str]:
    listed = json.loads(ip("-j", "netns", "list") or "[]")
    return [entry["name"] for entry in listed if entry["name"].startswith(PREFIX)]


def namespace_pids(namespace: str) -> list[int]:
    return [int(pid) for pid in ip("netns", "pids", namespace).split()]


def remove_network() -> int:
    """Delete our links, namespaces and bridge (processes in them must be gone first);
    returns how many namespaces there were."""
    # Deleting a veth's root end deletes its other end at once; a namespace's deletion
    # would take its veth along only once the kernel gets round to it.
    for link in json.loads(ip("-j", "link", "show")):
        if link["ifname"].startswith(PREFIX) and link["ifname"] != BRIDGE:
            ip("link", "delete", link["ifname"])
    namespaces = our_namespaces()
    for ns in namespaces:
        ip("netns", "delete", ns)
    if bridge_exists():
        ip("link", "delete", BRIDGE)
    _remove_forward_rules()
    return len(namespaces)
