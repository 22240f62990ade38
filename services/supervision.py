"""Keeping `specmesh up`'s processes alive: a service or server that dies is restarted.

Restarts back off (1 s, 2 s, 4 s ... 30 s) while a process keeps dying, and the
backoff starts over once it has stayed up for a minute. Every restart is logged and
counted in `specmesh_service_restarts_total`.
"""

from __future__ import annotations

import logging
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter
from specmesh.shared.infra import ServerProcess

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_S = 60.0  # up this long, a process's next death restarts it at the first backoff

RESTARTS = Counter(
    "specmesh_service_restarts_total",
    "processes `specmesh up` restarted after they died",
    ["service", "instance_id"],
)


@dataclass
class Supervised(ABC):
    """A process kept running: `start` it; `supervise` restarts it when dead."""

    name: str
    service: str
    started: float = 0.0
    in_a_row: int = 0  # deaths without STABLE_S of uptime between them
    due: float | None = None  # when a dead process starts again; None while it runs

    def start(self) -> None:
        self._launch()
        self.started, self.due = time.monotonic(), None

    @abstractmethod
    def _launch(self) -> None:
        """Start the process."""

    @abstractmethod
    def poll(self) -> int | None:
        """The exit code once dead, else None."""

    def supervise(self, now: float) -> None:
        """Restart when dead and due; schedule the restart when newly found dead."""
        if self.due is None:
            code = self.poll()
            if code is not None:
                self._schedule(now, f"exited with code {code}")
        elif now >= self.due:
            try:
                self.start()
            except (OSError, RuntimeError) as e:  # e.g. a server's port was taken meanwhile
                self._schedule(now, f"did not restart: {e}")
                return
            RESTARTS.labels(self.service, self.name).inc()
            log.warning("%s restarted", self.name)

    def _schedule(self, now: float, why: str) -> None:
        if now - self.started >= STABLE_S:
            self.in_a_row = 0
        delay = BACKOFF_S[min(self.in_a_row, len(BACKOFF_S) - 1)]
        self.in_a_row += 1
        self.due = now + delay
        log.warning("%s %s; restarting in %.0f s", self.name, why, delay)


@dataclass
class Child(Supervised):
    """A service process: its command line, environment and pre-exec setup."""

    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    preexec_fn: Callable[[], None] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def _launch(self) -> None:
        # Our process group is left so that Ctrl-C reaches only us (we stop them in
        # order), our session is not: a session is a scheduling group of its own
        # (autogroup), across which niceness means nothing.
        self.proc = subprocess.Popen(
            self.argv, env=self.env, process_group=0, preexec_fn=self.preexec_fn
        )

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


@dataclass
class Server(Supervised):
    """A server we started (nats-server, valkey); `launch` starts it on the same port."""

    launch: Callable[[], ServerProcess] | None = None
    server: ServerProcess | None = None

    def _launch(self) -> None:
        if self.server is not None:
            self.server.stop()  # gone already; this removes its temp dir
        self.server = self.launch()

    def poll(self) -> int | None:
        return None if self.server is None else self.server.proc.poll()
