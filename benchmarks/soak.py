"""Mixed traffic for a long while with faults on a schedule; report growth and lost output.

    python benchmarks/soak.py [--minutes 30] [--concurrency 8] [--fault-every 60]
        [--algorithm EAGLE3] [--model DIR]

A 3-node NATS cluster, valkey, and `specmesh up` with 2 prefill instances, 2 decode
workers and 2 drafters (KV blocks through valkey). The prompts' greedy answers are taken
once before any fault; then `--concurrency` clients send them in random order, streamed
or not, until `--minutes` have passed, each answer checked against its reference. Every
`--fault-every` seconds the next fault of the cycle strikes: SIGKILL a decode worker, a
drafter or a prefill instance (the launcher restarts it), restart valkey (its blocks
lost: prompts are computed again), kill a NATS node and start it again 20 s later.
Quiet samples (no traffic for 10 s) after the warm-up and at the end: each service's
RSS (by instance; a restarted one is compared from its restart), the decode and prefill
KV blocks in use, the gateway's open requests. Prints every fault, a minute-by-minute
count, and the verdict; exits 1 on a lost or changed answer or on growth.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import (  # noqa: E402
    GREEDY,
    PROMPTS,
    Deployment,
    heartbeats,
    scrape,
    specmesh_up,
    stream_until_done,
)
from specmesh.shared.infra import ServerProcess, free_port, start_nats, start_valkey  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402

CHAT = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())
SOAK_PROMPTS = PROMPTS + CHAT[:12]
QUIET_S = 10.0
RSS_SLACK_MB = 64.0  # allocator noise a steady process may show between two quiet samples
SERVICES = ("gateway-0", "tokenizer-0", "prefill-0", "prefill-1", "decode-0", "decode-1")


class NatsCluster:
    """Three routed nodes on fixed ports, so a killed node comes back where it was."""

    def __init__(self, stack: ExitStack) -> None:
        self.ports = [(free_port(), free_port()) for _ in range(3)]
        self.routes = [f"nats-route://127.0.0.1:{c}" for _, c in self.ports]
        self.stack = stack
        self.nodes = [self._start(i) for i in range(3)]

    def _start(self, i: int) -> ServerProcess:
        port, cluster = self.ports[i]
        node = start_nats(port, cluster_port=cluster, routes=self.routes)
        self.stack.callback(node.stop)
        return node

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def kill(self, i: int) -> None:
        self.nodes[i].proc.kill()

    def restart(self, i: int) -> None:
        self.nodes[i].stop()
        self.nodes[i] = self._start(i)


class Soak:
    def __init__(self, d: Deployment, reference: dict[str, str], seed: int) -> None:
        self.d, self.reference = d, reference
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.paused = threading.Event()
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []
        self.lock = threading.Lock()

    def client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            if self.paused.is_set():
                time.sleep(0.2)
                continue
            prompt = rng.choice(SOAK_PROMPTS)
            outcome = self.one(prompt, streamed=rng.random() < 0.5)
            with self.lock:
                self.counts[outcome] += 1
                if outcome != "ok":
                    self.failures.append(f"{time.strftime('%H:%M:%S')} {outcome}: {prompt!r}")

    def one(self, prompt: str, streamed: bool) -> str:
        if streamed:
            text, error = stream_until_done(self.d.url, prompt, threading.Event(), GREEDY)
            if error:
                return f"stream error {error.get('message', error)}"[:300]
        else:
            body = {"messages": [{"role": "user", "content": prompt}], **GREEDY}
            r = httpx.post(f"{self.d.url}/v1/chat/completions", json=body, timeout=300)
            if r.status_code != 200:
                return f"HTTP {r.status_code} {r.text[:200]}"
            text = r.json()["choices"][0]["message"]["content"]
        return "ok" if text == self.reference[prompt] else "changed text"


def quiet_sample(soak: Soak) -> dict[str, float]:
    """Traffic paused for QUIET_S: RSS per instance (MB), KV blocks in use, open requests."""
    soak.paused.set()
    time.sleep(QUIET_S)
    beats = heartbeats(soak.d.nats.url)  # node 0, which no fault kills
    sample: dict[str, float] = {}
    for instance in (*SERVICES, "drafter-0", "drafter-1"):
        try:
            status = Path(f"/proc/{soak.d.pid(instance)}/status").read_text()
        except (AssertionError, OSError):
            continue
        rss_kb = next(int(ln.split()[1]) for ln in status.splitlines() if ln.startswith("VmRSS"))
        incarnation = beats[instance].incarnation if instance in beats else "?"
        sample[f"rss {instance} ({incarnation})"] = rss_kb / 1024
    for beat in beats.values():
        if beat.kind in ("decode", "prefill"):
            sample[f"kv blocks {beat.instance_id}"] = beat.kv_blocks_total - beat.kv_blocks_free
    gateway = scrape(f"{soak.d.url}/metrics")
    sample["open requests"] = sum(
        v for (name, labels), v in gateway.items() if name == "specmesh_active_requests"
    )
    soak.paused.clear()
    return sample


def growth(before: dict[str, float], after: dict[str, float]) -> list[str]:
    grown = []
    for key, value in after.items():
        if key not in before:
            continue  # a restarted instance: nothing to compare with
        slack = RSS_SLACK_MB if key.startswith("rss") else 0.0
        if value > before[key] + slack:
            grown.append(f"{key}: {before[key]:.0f} -> {value:.0f}")
    return grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--fault-every", type=float, default=60.0)
    parser.add_argument("--algorithm", default="EAGLE3")
    parser.add_argument("--model", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    log = Path(f"/tmp/soak-{time.strftime('%H%M%S')}.log")
    with ExitStack() as stack:
        nats = NatsCluster(stack)
        valkey_port = free_port()
        valkey = [start_valkey(valkey_port)]
        stack.callback(lambda: valkey[0].stop())
        up = ["--nats-url", nats.url, "--kv-transport", "redis", "--redis-url", valkey[0].url]
        up += ["--prefills", "2", "--decoders", "2", "--drafters", "2"]
        up += ["--speculative-algorithm", args.algorithm]
        url = stack.enter_context(specmesh_up(model, *up, log=log))
        d = Deployment(url, log, nats.nodes[0])  # heartbeats from node 0, which stays up
        d.nats_url = nats.url  # what the services' --nats-url says: `pid` finds them by it
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = pool.map(
                lambda p: httpx.post(
                    f"{url}/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": p}], **GREEDY},
                    timeout=300,
                ).json()["choices"][0]["message"]["content"],
                SOAK_PROMPTS,
            )
            reference = dict(zip(SOAK_PROMPTS, answers, strict=True))
        soak = Soak(d, reference, args.seed)
        clients = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.concurrency)]
        for c in clients:
            c.start()
        time.sleep(30)  # warm-up: caches fill, allocators settle
        first = quiet_sample(soak)
        print(f"soak: {args.minutes:g} min, log {log}", flush=True)

        def kill(instance: str) -> None:
            os.kill(d.pid(instance), signal.SIGKILL)

        def restart_valkey() -> None:
            valkey[0].stop()
            valkey[0] = start_valkey(valkey_port)

        def nats_node() -> None:
            nats.kill(1)
            time.sleep(20)
            nats.restart(1)

        faults = itertools.cycle(
            [
                ("kill decode-0", lambda: kill("decode-0")),
                ("kill drafter-1", lambda: kill("drafter-1")),
                ("kill prefill-0", lambda: kill("prefill-0")),
                ("restart valkey", restart_valkey),
                ("kill NATS node 1 for 20 s", nats_node),
                ("kill decode-1", lambda: kill("decode-1")),
                ("kill drafter-0", lambda: kill("drafter-0")),
                ("kill prefill-1", lambda: kill("prefill-1")),
            ]
        )
        end = time.monotonic() + args.minutes * 60
        next_fault, minute = time.monotonic() + args.fault_every, 0
        while time.monotonic() < end:
            time.sleep(1)
            if time.monotonic() >= next_fault:
                name, fault = next(faults)
                with soak.lock:
                    done = dict(soak.counts)
                print(f"{time.strftime('%H:%M:%S')} {name} (answers so far {done})", flush=True)
                fault()
                next_fault = time.monotonic() + args.fault_every
            if (elapsed := int((args.minutes * 60 - (end - time.monotonic())) // 60)) > minute:
                minute = elapsed
                with soak.lock:
                    print(f"  minute {minute}: {dict(soak.counts)}", flush=True)
        time.sleep(30)  # the last fault's victims back
        last = quiet_sample(soak)
        soak.stop.set()
        for c in clients:
            c.join()
        grown = growth(first, last)
        print("quiet samples (after warm-up -> at the end):")
        for key in sorted(last):
            print(f"  {key}: {first.get(key, float('nan')):.0f} -> {last[key]:.0f}")
        print(f"answers: {dict(soak.counts)}")
        for failure in soak.failures:
            print(f"  {failure}")
        verdict = not grown and not soak.failures
        print(f"grown: {grown or 'nothing'}; {'PASS' if verdict else 'FAIL'}")
        sys.exit(0 if verdict else 1)


if __name__ == "__main__":
    main()
