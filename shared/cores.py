"""Where a service process computes: its CPUs, its compute threads, its priority.

Every service takes `--cpus`, `--threads`, `--nice` and `--idle` (or SPECMESH_CPUS, ...);
`specmesh up` chooses them per service from the cores it sees and the pools it starts
(`plan_cores`), and compose/Nomad set the same variables. They are applied once, before a
model loads and before any compute thread starts, so every thread inherits them.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from specmesh.shared.config import option

log = logging.getLogger(__name__)

# Below this many cores per decode worker, pinning would leave decode too few cores
# and everything shares all of them.
MIN_DECODE_CORES = 2
COMPUTING = ("decode", "prefill", "drafter", "learner")
CGROUP = Path("/sys/fs/cgroup")  # this process's cgroup, where cgroup v2 is mounted


@dataclass(frozen=True)
class CoresConfig:
    cpus: str | None = option(
        None, "CPUs this process runs on, as a cpuset list (0-3,8); default: all it may use"
    )
    threads: int | None = option(
        None,
        "compute threads (torch's CPU ops and the CPU kernels' pool); default: one per CPU "
        "it may run on, capped by its cgroup's CPU quota (a container's --cpus)",
    )
    nice: int | None = option(
        None,
        "scheduling niceness of this process; lower than the current one needs "
        "CAP_SYS_NICE, and without it the current one is kept (logged)",
    )
    idle: bool = option(
        False,
        "run only on CPU time no other process wants (Linux SCHED_IDLE; any other task "
        "that wakes takes the core at once): for background work such as the learner",
    )

    def __post_init__(self) -> None:
        if self.cpus is not None:
            parse_cpus(self.cpus)  # a malformed list fails at start
        if self.threads is not None and self.threads < 1:
            raise ValueError("--threads must be at least 1")


def parse_cpus(spec: str) -> list[int]:
    """A cpuset list ("0-3,8") as sorted CPU numbers."""
    cpus: set[int] = set()
    try:
        for part in spec.split(","):
            first, dash, last = part.strip().partition("-")
            cpus.update(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        raise ValueError(f"--cpus {spec!r} is not a CPU list such as 0-3,8") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"--cpus {spec!r} names no CPU")
    return sorted(cpus)


def format_cpus(cpus: list[int]) -> str:
    """The inverse of parse_cpus, in ranges."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def place_process(cfg: CoresConfig) -> int:
    """Pin this process, set its niceness and policy, and return its compute threads.
    Threads that torch and tokenizers start later inherit them and read the environment
    set here."""
    if cfg.cpus is not None:
        wanted = set(parse_cpus(cfg.cpus))
        try:
            os.sched_setaffinity(0, wanted)
        except OSError as exc:
            raise ValueError(f"--cpus {cfg.cpus}: {exc.strerror}") from None
    if cfg.nice is not None:
        _renice(cfg.nice)
    if cfg.idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    threads = cfg.threads or usable_cpus()
    for variable in ("OMP_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ[variable] = str(threads)
    return threads


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """CPUs this process may run on, capped by its cgroup v2 quota (`cpu.max`, e.g. a
    container started with --cpus 2): more threads than the quota only get throttled."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return cpus
    if quota == "max":
        return cpus
    return max(1, min(cpus, math.ceil(int(quota) / int(period))))


def _renice(nice: int) -> None:
    current = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        log.warning("keeping niceness %d: %d needs CAP_SYS_NICE", current, nice)


def plan_cores(cpus: list[int], counts: dict[str, int]) -> dict[str, CoresConfig]:
    """Placement of each instance `specmesh up` starts on `cpus` ("decode-0", "prefill-0",
    ...), for `counts` instances of each kind.

    With at least MIN_DECODE_CORES per decode worker besides a quarter of the machine (at
    least 2 cores), each decode worker gets cores of its own and everything else shares the
    rest, so nothing computes beside decode's threads. With fewer, everything shares all
    cores. Decode, prefill and drafters use a thread per core they have (the CPU kernels'
    pool never waits for a thread that is not running, so sharing costs little);
    tokenizer and gateway compute little.
    """
    decoders = counts.get("decode", 0)
    per_decoder = (len(cpus) - max(2, len(cpus) // 4)) // max(decoders, 1)
    dedicated = decoders > 0 and per_decoder >= MIN_DECODE_CORES
    shared = cpus[decoders * per_decoder :] if dedicated else cpus
    where = format_cpus(shared) if dedicated else None
    plan: dict[str, CoresConfig] = {}
    for kind, count in counts.items():
        for i in range(count):
            if kind == "decode" and dedicated:
                own = cpus[i * per_decoder : (i + 1) * per_decoder]
                plan[f"{kind}-{i}"] = CoresConfig(format_cpus(own), len(own))
            else:
                threads = len(shared) if kind in COMPUTING else 1
                plan[f"{kind}-{i}"] = CoresConfig(where, threads)
    return plan
