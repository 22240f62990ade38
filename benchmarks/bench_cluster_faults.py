"""Faults between hosts under concurrency 8, on `scripts/cluster`'s topology.

    python benchmarks/bench_cluster_faults.py [--port 8123] [--speculative-algorithm NGRAM]

`scripts/cluster up` (11 hosts as network namespaces: 3 NATS nodes, valkey, gateway,
tokenizer, prefill, 2 decode, 2 drafters), the greedy output of 8 chats without faults,
then one fault at a time, each struck once 8 streams all have output: decode-0's host
partitioned, NATS node 1 killed, valkey restarted (killed and started: its blocks lost),
drafter-1's host partitioned. After each, the victim is healed or started again and the
next fault waits until the gateway sees every worker. Per fault: failed or changed
streams (must be none) and the recovery time, from the fault until the last stream ended.
`scripts/cluster down` at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import GREEDY, PROMPTS, chat_text, fault_mid_stream  # noqa: E402

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--speculative-algorithm", default="NGRAM")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    try:
        cluster(
            "up", "--port", str(args.port), "--speculative-algorithm", args.speculative_algorithm
        )
        reference = [chat_text(url, p, **GREEDY) for p in STREAMS]
        clean = 0
        for name, strike, undo in faults():
            results, seconds = fault_mid_stream(url, STREAMS, strike, GREEDY)
            failed = [
                f"stream {i}: {error or 'changed text'}"
                for i, (text, error) in enumerate(results)
                if (text, error) != (reference[i], {})
            ]
            clean += not failed
            print(f"{name}: {len(failed)} of {len(STREAMS)} streams failed; last stream ended "
                  f"{seconds:.1f} s after the fault", flush=True)  # fmt: skip
            for failure in failed:
                print(f"    {failure}")
            undo()
            all_workers_seen(url)
        print(f"{clean} of {len(faults())} faults without a failed or changed stream")
    finally:
        cluster("down")


if __name__ == "__main__":
    main()
