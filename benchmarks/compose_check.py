"""docker-compose.yml run for real with scripts/compose-local (issue 35's must-shows, and
issue 34's NATS cluster under compose), each result printed:

    python benchmarks/compose_check.py [--port 8130] [--rerun]

1. `scripts/compose-local up --port P`: every container healthy (its time to healthy is
   printed); 20 greedy chats through the gateway equal transformers' greedy output; the
   bytes decode read through its KV transport (direct: pulled from prefill's container).
2. Traces: every one of those requests is one trace, with spans from all five services,
   each from its own container (the OTLP endpoint compose.local.yml runs as otel-collector).
3. `up --scale drafter=3 --scale decode=2`: the new instances heartbeat and are routed
   requests; under 8 streams, one at a time: `docker kill` of a decode container, `docker
   stop` of a drafter container, `docker kill` of a NATS node: no stream fails or changes.
4. `scripts/compose-local down`: no container, volume or network of ours left; the images
   it keeps (the build cache) listed. With --rerun, `up` and `down` once more: the cached
   run's time to healthy.

Run it in the test environment (`SPECMESH_LOCK=test source scripts/setup.sh`): it uses the
tests' chats and transformers for the reference.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
from deployment import GREEDY, PROMPTS, chat, fault_mid_stream  # noqa: E402
from specmesh.services.compose_local.stack import containers, service_of  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from test_cluster import MAX_TOKENS  # noqa: E402
from test_cluster import PROMPTS as CHATS  # noqa: E402
from test_cluster import _transformers_greedy as transformers_greedy  # noqa: E402

SCRIPT = ROOT / "scripts" / "compose-local"
SPANS_URL = "http://127.0.0.1:4318/v1/spans"  # compose.local.yml's otel-collector
SERVICES = {"gateway", "tokenizer", "prefill", "decode", "drafter"}
STREAMS = PROMPTS * 2  # concurrency 8
SCALED = {"decode": 2, "drafter": 3}
METRICS_FETCH = (
    "import urllib.request as u; print(u.urlopen('http://127.0.0.1:9100/metrics').read().decode())"
)


def compose_local(*args: str) -> float:
    """`scripts/compose-local <args>`, its output shown; the seconds it took."""
    print(f"$ scripts/compose-local {' '.join(args)}", flush=True)
    started = time.monotonic()
    subprocess.run([SCRIPT, *args], check=True)
    return time.monotonic() - started


def names(service: str) -> list[str]:
    """The running containers of a compose service, oldest first."""
    found = [c for c in containers() if service_of(c) == service and c["State"]["Running"]]
    found.sort(key=lambda c: c["Created"])
    return [c["Name"].lstrip("/") for c in found]


def hostnames() -> dict[str, str]:
    """Container hostname (what a service's instance id holds) -> container name."""
    return {c["Config"]["Hostname"]: c["Name"].lstrip("/") for c in containers()}


def greedy_chats(url: str) -> tuple[list[str], list[str]]:
    """The 20 chats' greedy texts through the gateway and their request ids."""

    def one(prompt: str) -> tuple[str, str]:
        response = chat(url, prompt, temperature=0, max_tokens=MAX_TOKENS)
        response.raise_for_status()
        return response.json()["choices"][0]["message"]["content"], response.headers["x-request-id"]

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, CHATS))
    return [text for text, _ in results], [rid for _, rid in results]


def kv_bytes_read(container: str) -> float:
    """specmesh_kv_transport_bytes_total that decode read, from its /metrics (asked inside
    its container: the metrics port is not published on the host)."""
    metrics = subprocess.run(
        ["docker", "exec", container, "python", "-c", METRICS_FETCH],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    series = 'specmesh_kv_transport_bytes_total{direction="read",service="decode"} '
    read = [
        float(line.removeprefix(series)) for line in metrics.splitlines() if line.startswith(series)
    ]
    return sum(read)


def check_traces(request_ids: list[str], timeout: float = 60) -> None:
    """Each request one trace, spanning all five services, each span's container named."""
    deadline = time.monotonic() + timeout
    while True:
        spans = httpx.get(SPANS_URL, timeout=30).json()
        by_trace: dict[str, list[dict[str, str]]] = defaultdict(list)
        for span in spans:
            by_trace[span["trace_id"]].append(span)
        traces = {}
        for rid in request_ids:
            traced = {s["trace_id"] for s in spans if s["request_id"] == rid}
            if len(traced) == 1:
                traces[rid] = by_trace[traced.pop()]
        covered = [
            rid
            for rid, trace in traces.items()
            if {s["service"].removeprefix("specmesh-") for s in trace} >= SERVICES
        ]
        if len(covered) == len(request_ids) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print(f"traces: {len(covered)} of {len(request_ids)} requests are one trace over all five")
    if traces:
        hosts = hostnames()
        sample = next(iter(traces.values()))
        where = sorted(
            {
                f"{s['service'].removeprefix('specmesh-')}@{_container(s['instance'], hosts)}"
                for s in sample
            }
        )
        print(f"  one of them ({len(sample)} spans): {', '.join(where)}")


def _container(instance: str, hosts: dict[str, str]) -> str:
    """The container an instance id (<kind>-<hostname>-<pid>) ran in."""
    return next((name for host, name in hosts.items() if f"-{host}-" in instance), instance)


def routed(url: str) -> dict[str, dict[str, float]]:
    """The gateway's requests routed per kind and instance."""
    counts: dict[str, dict[str, float]] = defaultdict(dict)
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("specmesh_routed_requests_total{"):
            labels, value = line[len("specmesh_routed_requests_total{") :].rsplit("} ", 1)
            fields = dict(part.split("=", 1) for part in labels.split(","))
            kind, instance = fields["kind"].strip('"'), fields["instance_id"].strip('"')
            counts[kind][instance] = float(value)
    return counts


def wait_instances(url: str, timeout: float = 300) -> None:
    """Until the gateway sees the scaled pools' every instance."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        if all(f'specmesh_instances{{kind="{k}"}} {n}.0' in metrics for k, n in SCALED.items()):
            return
        time.sleep(2)
    raise RuntimeError(f"the gateway did not see {SCALED} in {timeout} s")


def strike(url: str, name: str, fault: Callable[[], None], reference: list[str]) -> None:
    results, seconds = fault_mid_stream(url, STREAMS, fault, GREEDY)
    failed = [
        f"stream {i}: {error or 'changed text'}"
        for i, (text, error) in enumerate(results)
        if (text, error) != (reference[i], {})
    ]
    print(
        f"{name}: {len(failed)} of {len(STREAMS)} streams failed or changed; the last "
        f"ended {seconds:.1f} s after the fault"
    )
    for failure in failed:
        print(f"    {failure}")


def docker(*args: str) -> None:
    subprocess.run(["docker", *args], check=True, capture_output=True)


def scaled_faults(url: str, port: int) -> None:
    scale = [arg for kind, n in SCALED.items() for arg in ("--scale", f"{kind}={n}")]
    seconds = compose_local("up", "--port", str(port), *scale)
    wait_instances(url)
    print(f"scaled to {SCALED} in {seconds:.0f} s (to every container healthy)")
    before = routed(url)
    with ThreadPoolExecutor(8) as pool:
        reference = list(pool.map(lambda p: _text(url, p), STREAMS))
    after = routed(url)
    for kind in SCALED:
        served = {i: after[kind][i] - before[kind].get(i, 0) for i in after[kind]}
        print(f"  {kind}: requests routed per instance under 8 streams: {served}")
    decode, drafter = names("decode")[-1], names("drafter")[-1]
    strike(url, f"docker kill {decode} (decode)", lambda: docker("kill", decode), reference)
    strike(url, f"docker stop {drafter} (drafter)", lambda: docker("stop", drafter), reference)
    strike(url, "docker kill specmesh-nats-1-1", lambda: docker("kill", "specmesh-nats-1-1"),
           reference)  # fmt: skip


def _text(url: str, prompt: str) -> str:
    response = chat(url, prompt, **GREEDY)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8130)
    parser.add_argument("--rerun", action="store_true", help="up and down again (cached)")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    try:
        seconds = compose_local("up", "--port", str(args.port))
        print(f"up: every container healthy {seconds:.0f} s after `scripts/compose-local up`")
        reference = transformers_greedy(fetch_default_model())
        texts, request_ids = greedy_chats(url)
        same = sum(a == b for a, b in zip(texts, reference, strict=True))
        print(f"greedy: {same} of {len(CHATS)} chats equal transformers' greedy output")
        (decode,) = names("decode")
        print(f"kv transport: decode read {kv_bytes_read(decode) / 2**20:.1f} MiB of K/V")
        check_traces(request_ids)
        scaled_faults(url, args.port)
    finally:
        compose_local("down")
    if args.rerun:
        seconds = compose_local("up", "--port", str(args.port))
        print(f"cached run: every container healthy {seconds:.0f} s after `up`")
        compose_local("down")


if __name__ == "__main__":
    main()
