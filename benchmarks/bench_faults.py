"""Kill one of two decode workers and one of two drafters mid-stream, many times in a row.

    python benchmarks/bench_faults.py [--runs 10] [--algorithm EAGLE3] [--model DIR]

`specmesh up --decoders 2 --drafters 2`; each run streams 8 greedy chats, SIGKILLs a random
decode worker and a random drafter once every stream has output, and at that moment sends
4 more chats (the gateway still lists the dead worker until its heartbeats stop). Every
output must equal the no-fault one and no request may fail; the launcher restarts both
victims before the next run. Prints each run's victims, failures and the seconds from the
kill until the last stream ended, then how many runs were clean.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import (  # noqa: E402
    GREEDY,
    PROMPTS,
    Deployment,
    chat,
    chat_text,
    fault_mid_stream,
    heartbeats,
    specmesh_up,
)
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402


def late_failures(responses: list[httpx.Response], reference: list[str]) -> list[str]:
    """What went wrong with the chats sent at the kill: an error status or other text."""
    failures = []
    for response, expected in zip(responses, reference, strict=True):
        if response.status_code != 200:
            failures.append(f"{response.status_code}: {response.text[:200]}")
        elif response.json()["choices"][0]["message"]["content"] != expected:
            failures.append("changed text")
    return failures


def one_run(
    d: Deployment, reference: list[str], rng: random.Random
) -> tuple[list[str], list[str], float]:
    """(victims, failures, seconds from the kill to the last stream's end)."""
    victims = [f"decode-{rng.randint(0, 1)}", f"drafter-{rng.randint(0, 1)}"]
    beats = heartbeats(d.nats_url)
    incarnations = {v: beats[v].incarnation for v in victims}
    late: list[httpx.Response] = []

    def kill_then_send() -> None:
        for victim in victims:
            os.kill(d.pid(victim), signal.SIGKILL)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            late.extend(pool.map(lambda p: chat(d.url, p, **GREEDY), PROMPTS))

    results, seconds = fault_mid_stream(d.url, PROMPTS * 2, kill_then_send, GREEDY)
    failures = [
        f"stream {i}: {error or 'changed text'}"
        for i, (text, error) in enumerate(results)
        if (text, error) != (reference[i % len(PROMPTS)], {})
    ] + late_failures(late, reference)
    for victim, incarnation in incarnations.items():
        d.wait_restarted(victim, incarnation, 120)
    return victims, failures, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--algorithm", default="EAGLE3")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    log = Path(f"/tmp/bench_faults-{os.getpid()}.log")
    up = ["--decoders", "2", "--drafters", "2", "--speculative-algorithm", args.algorithm]
    with start_nats() as nats, specmesh_up(model, "--nats-url", nats.url, *up, log=log) as url:
        d = Deployment(url, log, nats)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            reference = list(pool.map(lambda p: chat_text(url, p, **GREEDY), PROMPTS))
        rng, clean = random.Random(args.seed), 0
        for run in range(args.runs):
            start = time.monotonic()
            victims, failures, seconds = one_run(d, reference, rng)
            clean += not failures
            took = time.monotonic() - start
            print(
                f"run {run + 1}: killed {' and '.join(victims)}; {len(failures)} failed; "
                f"last stream ended {seconds:.1f} s after the kill; run {took:.0f} s",
                flush=True,
            )
            for failure in failures:
                print(f"    {failure}")
        print(f"{clean} of {args.runs} runs clean ({args.algorithm}; log {log})")


if __name__ == "__main__":
    main()
