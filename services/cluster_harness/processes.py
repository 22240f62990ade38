"""The processes the harness starts: detached (they outlive `scripts/cluster up`), each
the leader of its own process group, known by pid and start time."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec

_LOG_TAIL_CHARS = 3000


class Process(msgspec.Struct):
    """A process: what it runs (to start it again) and which one it is now. A pid is
    ours only while its start time matches: a pid the kernel reuses is someone else's."""

    argv: list[str]
    env: dict[str, str]  # SPECMESH_* and secrets, over the rest of the caller's environment
    log: str
    cwd: str
    pid: int = 0
    started: int = 0  # in clock ticks since boot (/proc/<pid>/stat)

    def start(self) -> None:
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")}
        with open(self.log, "ab") as out:
            proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.cwd,
                env={**inherited, **self.env},
                start_new_session=True,  # its own group: a kill takes its children too
            )
        self.pid, self.started = proc.pid, _start_time(proc.pid) or 0

    def alive(self) -> bool:
        """Running, and still the process we started."""
        return bool(self.pid) and _running(self.pid, self.started)

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:  # exited since
                pass

    def log_tail(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except OSError:
            return "(no log)"


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), None if no such pid."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return int(stat[19]) if stat else None


def _running(pid: int, started: int | None) -> bool:
    """pid runs (a zombie has exited) and started at `started`."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in "ZX" and int(stat[19]) == started


def stop_all(processes: list[Process], pids: list[int], grace_s: float) -> None:
    """SIGTERM to `processes` and to the other `pids` (what is left in our namespaces),
    SIGKILL to whatever still runs after grace_s."""
    for process in processes:
        process.signal(signal.SIGTERM)
    strays = {pid: _start_time(pid) for pid in pids}
    for pid in strays:
        _kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        running = [p for p in processes if p.alive()]
        if not running and not any(_running(pid, t) for pid, t in strays.items()):
            return
        time.sleep(0.1)
    for process in processes:
        process.signal(signal.SIGKILL)
    for pid, started in strays.items():
        if _running(pid, started):
            _kill(pid, signal.SIGKILL)


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
