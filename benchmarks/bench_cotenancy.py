"""Serving beside a busy neighbour: quiet vs one busy loop at nice 19 vs one at nice 0.

    python benchmarks/bench_cotenancy.py [--model DIR] [--new-tokens 128] [--runs 3]
        [--setups engine,services,EAGLE3,NGRAM,llama.cpp] [--llama-server PATH --gguf FILE]
        [--time-limit 300]

The neighbour is what a user starts in another terminal: `nice -n N python3 -c "while
True: pass"` in a session of its own (so, where the kernel groups sessions, it competes
with the whole deployment, not with one of its processes). Setups, each started once and
measured under every condition in turn (quiet, nice 19, nice 0, then again for `--runs`):

- `engine`: the in-process engine (LLMEngine in this process, no services);
- `services`: `specmesh up`, no speculation; `EAGLE3`, `NGRAM`: `specmesh up` with that
  drafter (EAGLE-3: the head that ships for the default model);
- `llama.cpp`: llama.cpp's `llama-server -t <cores> -np 8` on an F32 GGUF of the same model
  (`benchmarks/peers/llama_cpp.sh` builds both and prints their paths, which this script
  runs when `--llama-server` is not given).

Each setup answers the held-out chat prompts greedily, `--new-tokens` tokens each
(ignore_eos), one at a time (c=1: the first 4 prompts) and eight at once (c=8: 8 prompts).
It prints generated tokens/s per condition (medians over the runs) and the share of the
quiet speed each busy condition keeps (ratios within a run, then their median). Over HTTP
the answers stream, and a measurement stops at `--time-limit` seconds (or where an answer's
stream is silent for a minute): its rate is then the tokens streamed by then over that
time, marked `*` (a server starved by the neighbour would otherwise hold the run for hours).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deployment import specmesh_up  # noqa: E402
from peers.llama_cpp import llama_cpp_paths, llama_server  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.sampling.params import SamplingParams  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
CHAT = json.loads((HERE / "prompts" / "chat_heldout.json").read_text())
CONDITIONS = {"quiet": None, "nice 19": 19, "nice 0": 0}
CONCURRENCY = {1: CHAT[:4], 8: CHAT[:8]}
SETUPS = ("engine", "services", "EAGLE3", "NGRAM", "llama.cpp")
READ_SECONDS = 60.0  # an answer's stream silent this long counts as stopped


class Rate(NamedTuple):
    """Generated tokens/s of one measurement; `complete`: every answer finished in time."""

    tokens_per_s: float
    complete: bool = True


# one setup's rate at one concurrency
Measure = Callable[[int], Rate]


@contextlib.contextmanager
def busy_loop(nice: int | None) -> Iterator[None]:
    """One busy process at `nice` in a session of its own while the block runs."""
    if nice is None:
        yield
        return
    loop = [sys.executable, "-c", "while True: pass"]
    proc = subprocess.Popen(["nice", "-n", str(nice), *loop], start_new_session=True)
    try:
        time.sleep(0.5)  # let the scheduler see it
        yield
    finally:
        proc.kill()
        proc.wait()


def over_http(url: str, concurrency: int, new_tokens: int, limit: float) -> Rate:
    """Generated tokens/s of the chat prompts sent `concurrency` at a time, streamed; past
    `limit` seconds (or a read silent for READ_SECONDS) an answer stops where it is, and
    the rate counts what came by then."""
    start = time.perf_counter()
    deadline = start + limit

    def one(prompt: str) -> tuple[int, bool]:
        """(tokens, whether the answer finished before the deadline)."""
        if time.perf_counter() > deadline:
            return 0, False
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": 0,
            "max_tokens": new_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        chunks = 0  # both servers stream a content chunk a token
        try:
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    if event.get("usage"):
                        return event["usage"]["completion_tokens"], True
                    chunks += any(c["delta"].get("content") for c in event["choices"])
                    if time.perf_counter() > deadline:
                        return chunks, False
        except httpx.ReadTimeout:
            return chunks, False
        raise RuntimeError(f"{url} closed an answer without its usage")

    with httpx.Client(timeout=READ_SECONDS) as client:
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(one, CONCURRENCY[concurrency]))
    seconds = min(time.perf_counter(), deadline) - start
    return Rate(sum(tokens for tokens, _ in answers) / seconds, all(done for _, done in answers))


@contextlib.contextmanager
def engine_setup(model: Path, new_tokens: int) -> Iterator[Measure]:
    engine = LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.5, max_num_seqs=8))
    tok = Tokenizer(model)
    ids = {
        c: [tok.encode_chat([{"role": "user", "content": p}]) for p in ps]
        for c, ps in CONCURRENCY.items()
    }
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def measure(concurrency: int) -> Rate:
        start = time.perf_counter()
        batches = [
            ids[concurrency][i : i + concurrency]
            for i in range(0, len(ids[concurrency]), concurrency)
        ]
        tokens = sum(len(out) for batch in batches for out in engine.generate(batch, params))
        return Rate(tokens / (time.perf_counter() - start))

    yield measure


@contextlib.contextmanager
def services_setup(model: Path, new_tokens: int, limit: float, *up: str) -> Iterator[Measure]:
    with start_nats() as bus, specmesh_up(model, *up, "--nats-url", bus.url) as url:
        yield lambda c: over_http(url, c, new_tokens, limit)


@contextlib.contextmanager
def llama_cpp_setup(server: str, gguf: str, new_tokens: int, limit: float) -> Iterator[Measure]:
    with llama_server(server, gguf, "-np", "8", "-c", "8192") as url:
        yield lambda c: over_http(url, c, new_tokens, limit)


def measure_setup(measure: Measure, runs: int) -> dict[tuple[str, int], list[Rate]]:
    """Rates per (condition, concurrency), one entry per run."""
    for c in CONCURRENCY:  # warm-up: compiled paths, caches, first-request costs
        measure(c)
    rates: dict[tuple[str, int], list[Rate]] = {}
    for _ in range(runs):
        for condition, nice in CONDITIONS.items():
            with busy_loop(nice):
                for c in CONCURRENCY:
                    rates.setdefault((condition, c), []).append(measure(c))
    return rates


def report(name: str, rates: dict[tuple[str, int], list[Rate]]) -> None:
    def cell(condition: str, c: int) -> str:
        """The median rate, `*` where a run stopped at the time limit."""
        runs = rates[(condition, c)]
        mark = "" if all(r.complete for r in runs) else "*"
        return f"{statistics.median(r.tokens_per_s for r in runs):>6.1f}{mark:1}"

    for c in CONCURRENCY:
        quiet = [r.tokens_per_s for r in rates[("quiet", c)]]
        cells = [cell("quiet", c)]
        for condition in list(CONDITIONS)[1:]:
            busy = [r.tokens_per_s for r in rates[(condition, c)]]
            kept = statistics.median(b / q for b, q in zip(busy, quiet, strict=True))
            cells.append(f"{cell(condition, c)} ({kept:>4.0%})")
        print(f"{name:<10} {c:>4}  " + "  ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--time-limit", type=float, default=300, help="seconds a measurement")
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    n, limit = args.new_tokens, args.time_limit
    setups = {
        "engine": lambda: engine_setup(model, n),
        "services": lambda: services_setup(model, n, limit),
        "EAGLE3": lambda: services_setup(model, n, limit, "--speculative-algorithm", "EAGLE3"),
        "NGRAM": lambda: services_setup(model, n, limit, "--speculative-algorithm", "NGRAM"),
        "llama.cpp": lambda: llama_cpp_setup(*_llama_cpp(args, model), n, limit),
    }
    chosen = args.setups.split(",")
    if unknown := set(chosen) - set(setups):
        parser.error(f"unknown setups {sorted(unknown)}; choose from {list(setups)}")
    print(
        f"{len(os.sched_getaffinity(0))} cores; {n} tokens per request, greedy; "
        f"medians of {args.runs} runs; (kept) = busy / quiet within a run; "
        f"* = stopped at {limit:g} s"
    )
    print(f"{'setup':<10} {'conc':>4}  {'quiet':>7}  {'nice 19':>14}  {'nice 0':>14}  (tok/s)")
    for name in chosen:
        with setups[name]() as measure:
            report(name, measure_setup(measure, args.runs))


def _llama_cpp(args: argparse.Namespace, model: Path) -> tuple[str, str]:
    if args.llama_server and args.gguf:
        return args.llama_server, args.gguf
    return llama_cpp_paths(model)


if __name__ == "__main__":
    main()
