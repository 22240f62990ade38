"""The disaggregation tax: the five-service pipeline vs the in-process engine, one run.

    python benchmarks/bench_services.py [--model DIR] [--new-tokens 64] [--runs 5]
        [--algorithm NGRAM|EAGLE3|...|none] [--kv-transport shm]

Same prompts (bench_ngram's rewrite set), same algorithm, greedy, every
request `--new-tokens` long (ignore_eos, as serving benchmarks do: at concurrency 8
all eight stay in the batch to the end instead of one long answer decoding alone).
For concurrency 1 (one request at a time) and 8 (eight at once) it prints
generated tokens/s of: the in-process engine (LLMEngine, no HTTP), and
`specmesh up` with overlap on and off (`--algorithm none`: once, without speculation;
each service its own process, over NATS and the KV transport, requests over HTTP);
and the ratios. Every measurement
starts fresh (a new engine, a new deployment), so no n-gram trie or prefix
cache remembers an earlier pass; the setups run back to back, ratios
are taken within a run, and the medians of `--runs` are printed. Outputs are
checked to be equal everywhere."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ngram import REWRITE  # noqa: E402
from deployment import specmesh_up  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.sampling.params import SamplingParams  # noqa: E402
from specmesh.shared.speculative.config import SpeculativeConfig  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402

CONCURRENCY = (1, 8)


def in_process(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[float, list[list[int]]]:
    """tokens/s and outputs of the engine in this process."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += engine.generate(prompts[i : i + concurrency], params)
    seconds = time.perf_counter() - start
    return sum(map(len, outputs)) / seconds, outputs


def over_http(
    url: str, prompts: list[str], new_tokens: int, concurrency: int
) -> tuple[float, list[str]]:
    """tokens/s and texts over HTTP. Like a load generator, the client keeps its
    connections open: a new httpx client per request costs ~70 ms of CPU here."""

    def one(prompt: str) -> tuple[str, int]:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": new_tokens,
            "ignore_eos": True,
        }
        r = client.post(f"{url}/v1/chat/completions", json=body).json()
        return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]

    with httpx.Client(timeout=600) as client:
        client.get(f"{url}/health")  # connect before the clock starts
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, prompts))
        seconds = time.perf_counter() - start
    return sum(n for _, n in results) / seconds, [text for text, _ in results]


OVERLAP = {"services overlap": "--overlap", "services no-overlap": "--no-overlap"}


def run_in_process(
    model: Path, algorithm: str | None, ids: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[float, list[list[int]]]:
    spec = SpeculativeConfig(speculative_algorithm=algorithm)
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.5), spec)
    in_process(engine, ids[:2], 8, 2)  # warm-up, the same for all three
    return in_process(engine, ids, new_tokens, concurrency)


def run_services(
    model: Path, up: list[str], prompts: list[str], new_tokens: int, concurrency: int
) -> tuple[float, list[str]]:
    with start_nats() as bus, specmesh_up(model, *up, "--nats-url", bus.url) as url:
        over_http(url, prompts[:2], 8, 2)
        return over_http(url, prompts, new_tokens, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)  # runs differ by up to ~15% here
    parser.add_argument("--algorithm", default="NGRAM", help="none: no speculation")
    parser.add_argument("--kv-transport", default="shm", choices=["shm", "redis"])
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    tok = Tokenizer(model)
    prompts = REWRITE
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    algorithm = None if args.algorithm.lower() == "none" else args.algorithm
    up = ["--kv-transport", args.kv_transport]
    services = {"services": []}  # without speculation there is nothing to overlap
    if algorithm is not None:
        up += ["--speculative-algorithm", algorithm]
        services = {name: [flag] for name, flag in OVERLAP.items()}
    setups = ("in-process", *services)
    rates: dict[tuple[str, int], list[float]] = {}
    for run in range(args.runs):
        for c in CONCURRENCY:
            rate, outputs = run_in_process(model, algorithm, ids, args.new_tokens, c)
            rates.setdefault(("in-process", c), []).append(rate)
            expected = [tok.decode(o) for o in outputs]
            for name, flags in services.items():
                rate, texts = run_services(model, [*up, *flags], prompts, args.new_tokens, c)
                rates.setdefault((name, c), []).append(rate)
                if texts != expected:
                    print(f"WARNING: {name} c={c}: output differs from the in-process engine")
            line = "  ".join(f"{name} {rates[(name, c)][-1]:.1f}" for name in setups)
            print(f"run {run + 1} c={c}: {line} tok/s", flush=True)

    print(
        f"\n{args.algorithm}, {len(prompts)} prompts, {args.new_tokens} tokens, greedy, "
        f"{args.kv_transport} transport; median of {args.runs} runs, each from a fresh start"
    )
    label = max(map(len, services)) + len(" / in-proc") + 2  # the widest row name
    print(f"{'tok/s':<{label}}" + "".join(f"{'c=' + str(c):>12}" for c in CONCURRENCY))
    for name in setups:
        medians = (statistics.median(rates[(name, c)]) for c in CONCURRENCY)
        print(f"{name:<{label}}" + "".join(f"{m:>12.1f}" for m in medians))
    for name in services:
        # Ratios within each run (the setups ran back to back), then their median.
        ratios = (
            statistics.median(
                s / i for s, i in zip(rates[(name, c)], rates[("in-process", c)], strict=True)
            )
            for c in CONCURRENCY
        )
        print(f"{name + ' / in-proc':<{label}}" + "".join(f"{r:>11.2f}x" for r in ratios))


if __name__ == "__main__":
    main()
