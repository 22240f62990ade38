"""KV hand-off between hosts: through valkey against decode pulling from prefill (direct).

    python benchmarks/bench_kv_transfer.py [--tokens 256,2048,8192] [--rates 0,10000,1000]
        [--runs 5] [--ttft-tokens 2048] [--parts handoff,ttft]

Part 1 on `scripts/cluster`'s topology (hosts as network namespaces on a bridge): a writer
in the prefill host's namespace stores a prompt's blocks (the default model's block size in
bytes), a reader in decode-0's namespace reads them: through the valkey host (`redis`: the
bytes cross the network twice, a write then a read) or straight from the writer (`direct`:
once). The hand-off time is the write plus the read, both on the prompt's first-token
path; median of `--runs`, per prompt length and per link rate (`--rates` in Mbit/s on what
each host sends, 0: unlimited). Part 2 brings the whole cluster up once per transport and
times the first token of a `--ttft-tokens` prompt end to end (median of `--runs`), outputs
compared. `scripts/cluster down` at the end, whatever happened.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from cluster_faults import cluster  # noqa: E402
from specmesh.services.cluster_harness import netns, state  # noqa: E402
from specmesh.services.cluster_harness.topology import valkey_url  # noqa: E402
from specmesh.shared.transport import DirectOptions, make_transport  # noqa: E402

PORT = 8124


def block_bytes() -> int:
    """Bytes of one full block of the default model's K/V (fp32, 16 tokens)."""
    from specmesh.shared.model.config import ModelConfig
    from specmesh.shared.model.fetch import fetch_default_model

    cfg = ModelConfig.from_file(Path(fetch_default_model()) / "config.json")
    return cfg.num_layers * 2 * 16 * cfg.num_kv_heads * cfg.head_dim * 4


def worker(role: str, kind: str, url: str, address: str) -> None:
    """Runs in a host's namespace: answers JSON lines from stdin (a writer stores
    {"blocks", "size", "tag"}; a reader reads {"keys", "source"}) with the seconds taken."""
    options = {"password": os.environ["SPECMESH_REDIS_PASSWORD"]} if kind == "redis" else None
    transport = make_transport(kind, "bench", url, options, DirectOptions(host=address))
    for line in sys.stdin:
        req = json.loads(line)
        if role == "writer":
            blobs = {f"{req['tag']}-{i}": os.urandom(req["size"]) for i in range(req["blocks"])}
            start = time.perf_counter()
            transport.put_many(blobs, ttl_s=60)
            reply = {"seconds": time.perf_counter() - start, "source": transport.address}
        else:
            start = time.perf_counter()
            got = transport.source(req["source"]).get_many(req["keys"])
            reply = {"seconds": time.perf_counter() - start}
            reply["missing"] = [i for i, g in enumerate(got) if g is None]
        print(json.dumps(reply), flush=True)


class Worker:
    def __init__(self, host: str, role: str, kind: str, url: str, address: str) -> None:
        argv = ["ip", "netns", "exec", f"smc-{host}", sys.executable, __file__, "--worker"]
        argv += [role, kind, url, address]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
        )

    def ask(self, req: dict) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def handoff_seconds(kind: str, tokens: int, runs: int, size: int) -> float:
    cs = state.load()
    prefill, decode = cs.host("prefill").host, cs.host("decode-0").host
    env_url = valkey_url(cs.host("valkey").host)
    os.environ["SPECMESH_REDIS_PASSWORD"] = cs.redis_password
    writer = Worker("prefill", "writer", kind, env_url, prefill.address)
    reader = Worker("decode-0", "reader", kind, env_url, decode.address)
    try:
        times = []
        for _ in range(runs):
            tag, blocks = uuid.uuid4().hex, -(-tokens // 16)
            put = writer.ask({"blocks": blocks, "size": size, "tag": tag})
            keys = [f"{tag}-{i}" for i in range(blocks)]
            got = reader.ask({"keys": keys, "source": put["source"]})
            if got["missing"]:
                raise RuntimeError(f"{kind}: blocks {got['missing']} of {blocks} missing")
            times.append(put["seconds"] + got["seconds"])
        return statistics.median(times)
    finally:
        writer.close()
        reader.close()


def set_rates(rate_mbit: float | None) -> None:
    for host in state.load().hosts:
        if host.role not in ("nats",):
            netns.limit_rate(host.host, rate_mbit)


def part_one(args: argparse.Namespace) -> None:
    size = block_bytes()
    print(f"block: {size} bytes (16 tokens); hand-off = write + read, median of {args.runs}")
    print("| link rate | prompt tokens | MB | valkey (ms) | direct (ms) | valkey / direct |")
    print("|---|---|---|---|---|---|")
    for rate in args.rates:
        set_rates(rate or None)
        for tokens in args.tokens:
            redis_s = handoff_seconds("redis", tokens, args.runs, size)
            direct_s = handoff_seconds("direct", tokens, args.runs, size)
            mb = -(-tokens // 16) * size / 1e6
            label = f"{rate} Mbit/s" if rate else "unlimited"
            print(
                f"| {label} | {tokens} | {mb:.0f} | {redis_s * 1e3:.0f} | {direct_s * 1e3:.0f} "
                f"| {redis_s / direct_s:.2f} |",
                flush=True,
            )
    set_rates(None)


def first_token_seconds(url: str, prompt: str) -> tuple[float, str]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    start, first, text = time.perf_counter(), None, ""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                first = first or time.perf_counter()
                text += json.loads(line[6:])["choices"][0]["text"]
    assert first is not None
    return first - start, text


def part_two(args: argparse.Namespace) -> None:
    url = f"http://127.0.0.1:{PORT}"
    words = "the quick brown fox jumps over a lazy dog near river bank ".split()
    texts: dict[str, list[str]] = {}
    for kind in ("redis", "direct"):
        cluster("up", "--port", str(PORT), "--kv-transport", kind)
        try:
            first_token_seconds(url, "warm up")
            times = []
            for run in range(args.runs):
                prompt = f"{run} " + " ".join(
                    words[i % len(words)] for i in range(args.ttft_tokens)
                )
                seconds, text = first_token_seconds(url, prompt)
                times.append(seconds)
                texts.setdefault(kind, []).append(text)
            print(
                f"{kind}: first token of a ~{args.ttft_tokens}-token prompt in "
                f"{statistics.median(times):.2f} s (median of {args.runs})",
                flush=True,
            )
        finally:
            cluster("down")
    print("outputs equal:", texts["redis"] == texts["direct"])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(*sys.argv[2:6])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="256,2048,8192")
    parser.add_argument("--rates", default="0,10000,1000", help="Mbit/s, 0: unlimited")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ttft-tokens", type=int, default=2048)
    parser.add_argument("--parts", default="handoff,ttft")
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.rates = [float(r) for r in args.rates.split(",")]
    if "handoff" in args.parts:
        try:
            cluster("up", "--port", str(PORT), "--kv-transport", "redis")
            part_one(args)
        finally:
            cluster("down")
    if "ttft" in args.parts:
        part_two(args)


if __name__ == "__main__":
    main()
