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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster_faults import STREAMS, cluster, strike_each  # noqa: E402
from deployment import GREEDY, chat_text  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--speculative-algorithm", default="NGRAM")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    try:
        cluster(
            "up", "--port", str(args.port), "--speculative-algorithm", args.speculative_algorithm,
            "--kv-transport", "redis",  # one of the faults restarts valkey
        )  # fmt: skip
        reference = [chat_text(url, p, **GREEDY) for p in STREAMS]
        outcomes = strike_each(url, reference)
        for name, failed, seconds in outcomes:
            print(f"{name}: {len(failed)} of {len(STREAMS)} streams failed; last stream ended "
                  f"{seconds:.1f} s after the fault")  # fmt: skip
            for failure in failed:
                print(f"    {failure}")
        clean = sum(not failed for _, failed, _ in outcomes)
        print(f"{clean} of {len(outcomes)} faults without a failed or changed stream")
    finally:
        cluster("down")


if __name__ == "__main__":
    main()
