"""Long prompts: prefill time beside transformers and llama.cpp, and a short request's first
token while a long prompt is being prefilled.

    python benchmarks/bench_prefill.py [--model DIR] [--lengths 2048,8190] [--runs 3]
        [--setups specmesh,transformers,llama.cpp] [--llama-server PATH --gguf FILE]
        [--quantization gguf] [--fairness]

Prefill: one prompt of each length (held-out chat text, cut to that many tokens), the time
to its first token (greedy), for: `specmesh`, the in-process engine with its defaults
(chunked prefill, the engine a prefill service runs); `transformers`, one forward of
the whole prompt (AutoModelForCausalLM, fp32, SDPA); `llama.cpp`, `llama-server` on an F32
GGUF of the model (`/completion`, `n_predict` 1, no prompt cache). The setups take turns
within each run; medians of `--runs`, and ratios within a run. The first tokens must agree.
`--quantization gguf`: specmesh on the model's own GGUF blocks as they ship, and
llama-server on that same file (transformers stays fp32; where llama.cpp's int8
activations pick another first token, the script warns).

`--fairness`: `specmesh up`; an 8,190-token prompt is sent, and from 0.2 s later until it
is answered, a short streamed chat every few seconds; prints each short one's time to its
first token (and the worst), and alone for comparison.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from deployment import specmesh_up  # noqa: E402
from peers.llama_cpp import llama_cpp_paths, llama_server  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.model.gguf_loader import SOURCE_GGUF  # noqa: E402
from specmesh.shared.sampling.params import SamplingParams  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402

HERE = Path(__file__).resolve().parent
CHAT = json.loads((HERE / "prompts" / "chat_heldout.json").read_text())
SETUPS = ("specmesh", "transformers", "llama.cpp")
LONG = 8190
SHORT = "Name three colours."
PROBE_GAP = 3.0  # seconds between short requests while the long prompt is in prefill

# a prompt's ids -> (seconds to its first token, that token)
Prefill = Callable[[list[int]], tuple[float, int]]


def prompt_ids(tok: Tokenizer, length: int) -> list[int]:
    """`length` tokens of held-out chat text, repeated as needed."""
    ids: list[int] = []
    while len(ids) < length:
        ids += tok.encode("\n\n".join(CHAT))
    return ids[:length]


def prefill_engine(model: Path, longest: int, quantization: str | None = None) -> LLMEngine:
    """The engine with its defaults, its KV cache sized for a `longest`-token prompt."""
    config = EngineConfig(
        model=str(model), kv_cache_gb=0.1 + longest * 6e-5, quantization=quantization
    )
    return LLMEngine(config)


def timed_prefill(engine: LLMEngine, ids: list[int]) -> tuple[float, int]:
    """Seconds to the first (greedy) token of `ids`, and that token; nothing cached before."""
    engine.scheduler.block_manager.flush()  # no prefix cache between runs
    start = time.perf_counter()
    (out,) = engine.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - start, out[0]


def specmesh(model: Path, longest: int, quantization: str | None) -> Prefill:
    return functools.partial(timed_prefill, prefill_engine(model, longest, quantization))


def transformers_forward(model: Path) -> Prefill:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(ids: list[int]) -> tuple[float, int]:
        start = time.perf_counter()
        logits = lm(torch.tensor([ids]), logits_to_keep=1).logits
        return time.perf_counter() - start, int(logits[0, -1].argmax())

    return run


def llama_cpp(url: str) -> Prefill:
    def run(ids: list[int]) -> tuple[float, int]:
        body = {"prompt": ids, "n_predict": 1, "temperature": 0, "cache_prompt": False}
        start = time.perf_counter()
        reply = httpx.post(f"{url}/completion", json={**body, "n_probs": 1}, timeout=600)
        seconds = time.perf_counter() - start
        return seconds, reply.json()["completion_probabilities"][0]["id"]

    return run


def measure(setups: dict[str, Prefill], prompts: dict[int, list[int]], runs: int) -> None:
    times: dict[tuple[str, int], list[float]] = {}
    for run in range(runs):
        for length, ids in prompts.items():
            tokens = {}
            for name, prefill in setups.items():
                seconds, tokens[name] = prefill(ids)
                times.setdefault((name, length), []).append(seconds)
            line = "  ".join(f"{n} {times[(n, length)][-1]:.2f} s" for n in setups)
            print(f"run {run + 1}, {length} tokens: {line}", flush=True)
            if len(set(tokens.values())) > 1:
                print(f"WARNING: first tokens differ: {tokens}")
    print(f"\nprefill, seconds to the first token (median of {runs})")
    print(f"{'':<14}" + "".join(f"{length:>10}" for length in prompts))
    for name in setups:
        medians = (statistics.median(times[(name, n)]) for n in prompts)
        print(f"{name:<14}" + "".join(f"{m:>10.2f}" for m in medians))
    for peer in [n for n in setups if n != "specmesh"]:
        pairs = {n: zip(times[(peer, n)], times[("specmesh", n)], strict=True) for n in prompts}
        ratios = (statistics.median(p / s for p, s in pairs[n]) for n in prompts)
        print(f"{'x ' + peer:<14}" + "".join(f"{r:>9.2f}x" for r in ratios))


def fairness(model: Path, tok: Tokenizer) -> None:
    """A short chat's time to its first token, alone and while a long prompt prefills."""
    long_body = {"input_ids": prompt_ids(tok, LONG), "sampling_params": {"max_new_tokens": 1}}
    room = ["--kv-cache-gb", "1"]  # the test deployment's 0.25 GB holds no 8k context
    with start_nats() as bus, specmesh_up(model, "--nats-url", bus.url, *room) as url:
        alone = sorted(first_token_seconds(url) for _ in range(3))[1]
        replies: list[httpx.Response] = []

        def send() -> None:
            replies.append(httpx.post(f"{url}/generate", json=long_body, timeout=600))

        sender = threading.Thread(target=send)
        start = time.monotonic()
        sender.start()
        time.sleep(0.2)
        beside = []  # (seconds into the long prompt, the short one's first token)
        while sender.is_alive():
            sent = time.monotonic() - start
            beside.append((sent, first_token_seconds(url)))
            time.sleep(PROBE_GAP)
        sender.join()
        long_seconds = time.monotonic() - start
    if replies[0].status_code != 200:
        raise RuntimeError(f"the long prompt failed: {replies[0].text[:300]}")
    print(f"\nshort chat, first token: alone {alone:.2f} s (median of 3); while an {LONG}-token")
    print(f"prompt was in prefill ({long_seconds:.1f} s to its answer), sent at:")
    for sent, seconds in beside:
        print(f"  {sent:5.1f} s: {seconds:.2f} s")
    worst = max(seconds for _, seconds in beside)
    print(f"worst {worst:.2f} s, median {statistics.median(s for _, s in beside):.2f} s")


def first_token_seconds(url: str) -> float:
    body = {"messages": [{"role": "user", "content": SHORT}], "stream": True, "max_tokens": 4}
    start = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - start
    raise RuntimeError("no content came back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--lengths", default=f"2048,{LONG}")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--quantization", choices=["gguf"], default=None)
    parser.add_argument("--fairness", action="store_true")
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    tok = Tokenizer(model)
    prompts = {n: prompt_ids(tok, n) for n in map(int, args.lengths.split(","))}
    names = [name for name in args.setups.split(",") if name]  # none: only --fairness
    setups: dict[str, Prefill] = {}
    if "specmesh" in names:
        setups["specmesh"] = specmesh(model, max(prompts), args.quantization)
    if "transformers" in names:
        setups["transformers"] = transformers_forward(model)
    if "llama.cpp" in names:
        server, gguf = (args.llama_server, args.gguf) if args.gguf else llama_cpp_paths(model)
        if args.quantization and not args.gguf:
            gguf = str(model / SOURCE_GGUF)
        with llama_server(server, gguf, "-np", "1", "-c", str(max(prompts) + 16)) as url:
            setups["llama.cpp"] = llama_cpp(url)
            measure(setups, prompts, args.runs)
    elif setups:
        measure(setups, prompts, args.runs)
    weights = args.quantization or "fp32"
    print(f"{torch.get_num_threads()} threads; {' '.join(names)}; weights {weights}")
    if args.fairness:
        fairness(model, tok)


if __name__ == "__main__":
    main()
