"""The disaggregation tax: the five-service pipeline vs the in-process engine, one run.

    python benchmarks/bench_services.py [--model DIR] [--new-tokens 128] [--runs 3]
        [--algorithm NGRAM] [--kv-transport shm]

Same prompts (bench_speculative's rewrite set), same algorithm, greedy. For
concurrency 1 (one request at a time) and 8 (eight at once) it prints
generated tokens/s of: the in-process engine (LLMEngine, no HTTP), and
`specmesh up` with overlap on and off (each service its own process, over NATS
and the KV transport, requests over HTTP); and the ratios. Both deployments
stay up side by side and the three setups take turns within each run, so the
machine's drift hits them alike; medians of `--runs`. Outputs are checked to be equal everywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_speculative import REWRITE  # noqa: E402
from deployment import specmesh_up  # noqa: E402

from shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from shared.infra import start_nats  # noqa: E402
from shared.model.fetch import fetch_default_model  # noqa: E402
from shared.sampling.params import SamplingParams  # noqa: E402
from shared.speculative.config import SpeculativeConfig  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402

CONCURRENCY = (1, 8)


def in_process(
    engine: LLMEngine, prompts: list[list[int]], new_tokens: int, concurrency: int
) -> tuple[float, list[list[int]]]:
    """tokens/s and outputs of the engine in this process."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        outputs += engine.generate(prompts[i : i + concurrency], params)
    seconds = time.perf_counter() - start
    return sum(map(len, outputs)) / seconds, outputs


def over_http(
    url: str, prompts: list[str], new_tokens: int, concurrency: int
) -> tuple[float, list[str]]:
    def one(prompt: str) -> tuple[str, int]:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": new_tokens,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
        return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, prompts))
    seconds = time.perf_counter() - start
    return sum(n for _, n in results) / seconds, [text for text, _ in results]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--algorithm", default="NGRAM")
    parser.add_argument("--kv-transport", default="shm", choices=["shm", "redis"])
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    tok = Tokenizer(model)
    prompts = REWRITE
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in prompts]
    rates: dict[tuple[str, int], list[float]] = {}
    up = ["--speculative-algorithm", args.algorithm, "--kv-transport", args.kv_transport]
    with ExitStack() as stack:
        urls = {}
        for overlap in ("overlap", "no-overlap"):
            bus = stack.enter_context(start_nats())  # one bus each: they must not meet
            namespace = f"bench-{overlap}"
            urls[f"services {overlap}"] = stack.enter_context(
                specmesh_up(
                    model, *up, f"--{overlap}", "--nats-url", bus.url, "--kv-namespace", namespace
                )
            )
        # One engine for all runs, like the services: NGRAM's shared trie learns in both.
        spec = SpeculativeConfig(speculative_algorithm=args.algorithm)
        engine = LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.5), spec)
        in_process(engine, ids[:2], 8, 2)  # warm-up, the same for all three
        for url in urls.values():
            over_http(url, prompts[:2], 8, 2)
        for _ in range(args.runs):
            for c in CONCURRENCY:
                rate, outputs = in_process(engine, ids, args.new_tokens, c)
                rates.setdefault(("in-process", c), []).append(rate)
                expected = [tok.decode(o) for o in outputs]
                for name, url in urls.items():
                    rate, texts = over_http(url, prompts, args.new_tokens, c)
                    rates.setdefault((name, c), []).append(rate)
                    if texts != expected:
                        print(f"WARNING: {name} c={c}: output differs from the in-process engine")

    print(
        f"\n{args.algorithm}, {len(prompts)} prompts, {args.new_tokens} tokens, greedy, "
        f"{args.kv_transport} transport; median tok/s of {args.runs} runs"
    )
    header = f"{'':<22}" + "".join(f"{'c=' + str(c):>12}" for c in CONCURRENCY)
    print(header)
    median = {k: statistics.median(v) for k, v in rates.items()}
    for name in ("in-process", "services overlap", "services no-overlap"):
        print(f"{name:<22}" + "".join(f"{median[(name, c)]:>12.1f}" for c in CONCURRENCY))
    for name in ("services overlap", "services no-overlap"):
        ratios = "".join(
            f"{median[(name, c)] / median[('in-process', c)]:>11.2f}x" for c in CONCURRENCY
        )
        print(f"{name + ' / in-proc':<22}{ratios}")


if __name__ == "__main__":
    main()
