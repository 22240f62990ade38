"""Faults between hosts on `scripts/cluster`'s topology, one at a time under 8 streams:
what tests/test_cluster.py and benchmarks/bench_cluster_faults.py strike."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from deployment import GREEDY, PROMPTS, fault_mid_stream

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "cluster"
STREAMS = PROMPTS * 2  # concurrency 8


def cluster(*args: str) -> str:
    done = subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"scripts/cluster {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


def all_workers_seen(url: str, timeout: float = 120) -> None:
    """Until the gateway lists 2 decode workers and 2 drafters again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        seen = {
            kind: f'specmesh_instances{{kind="{kind}"}} 2.0' in metrics
            for kind in ("decode", "drafter")
        }
        if all(seen.values()):
            return
        time.sleep(1)
    raise RuntimeError(f"the gateway did not see every worker again in {timeout} s")


def faults() -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    """(name, strike, undo)."""
    return [
        ("decode-0 partitioned", lambda: cluster("partition", "decode-0"),
         lambda: cluster("heal", "decode-0")),
        ("NATS node 1 killed", lambda: cluster("kill", "nats-1"),
         lambda: cluster("start", "nats-1")),
        ("valkey restarted", lambda: (cluster("kill", "valkey"), cluster("start", "valkey")),
         lambda: None),
        ("drafter-1 partitioned", lambda: cluster("partition", "drafter-1"),
         lambda: cluster("heal", "drafter-1")),
    ]  # fmt: skip


def strike_each(url: str, reference: list[str]) -> list[tuple[str, list[str], float]]:
    """Every fault in turn, undone after: (name, failed or changed streams, seconds from
    the fault until the last stream ended). `reference`: the streams' no-fault texts."""
    outcomes = []
    for name, strike, undo in faults():
        results, seconds = fault_mid_stream(url, STREAMS, strike, GREEDY)
        failed = [
            f"stream {i}: {error or 'changed text'}"
            for i, (text, error) in enumerate(results)
            if (text, error) != (reference[i], {})
        ]
        outcomes.append((name, failed, seconds))
        undo()
        all_workers_seen(url)
    return outcomes
