"""A GGUF served as it ships: specmesh on its quantized blocks beside llama.cpp on the file.

    python benchmarks/bench_quantized.py [--new-tokens 128] [--runs 1] [--concurrency 1,8]
        [--setups fp32,gguf,llama.cpp,gguf+NGRAM,gguf+EAGLE3,llama.cpp+ngram,int8,int4]

The default model's own GGUF (Q4_1 matrices, a Q8_0 embedding), 10 held-out chat prompts,
greedy, every answer `--new-tokens` long (ignore_eos), over each server's OpenAI chat API,
no speculation: `fp32`, `specmesh up` on the weights expanded to fp32 (today's default);
`gguf`, `specmesh up --quantization gguf`; `llama.cpp`, `llama-server` on the same file
(benchmarks/peers/llama_cpp.sh builds it, cached; `-np` slots as the concurrency, no
prompt cache); with speculation, `gguf+NGRAM` and `gguf+EAGLE3` (the shipped head) and
`llama.cpp+ngram` (`--spec-type ngram-mod`); `int8` and `int4`, the safetensors weights
quantized at load (`--quantization int8|int4`). Prints generated tokens/s per setup and
concurrency, and ratios taken within a run (medians over `--runs`); checks that `gguf`
writes `fp32`'s texts and that speculation on the blocks writes `gguf`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_services import over_http  # noqa: E402
from deployment import specmesh_up  # noqa: E402
from peers.llama_cpp import llama_cpp_paths, llama_server  # noqa: E402

from shared.infra import start_nats  # noqa: E402
from shared.model.fetch import fetch_default_model  # noqa: E402
from shared.model.gguf_loader import SOURCE_GGUF  # noqa: E402

PROMPTS = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())[:10]
GGUF = ("--quantization", "gguf")
UP_ARGS = {
    "fp32": (),
    "gguf": GGUF,
    "gguf+NGRAM": (*GGUF, "--speculative-algorithm", "NGRAM"),
    "gguf+EAGLE3": (*GGUF, "--speculative-algorithm", "EAGLE3"),
    "int8": ("--quantization", "int8"),
    "int4": ("--quantization", "int4"),
}
LLAMA_ARGS = {"llama.cpp": (), "llama.cpp+ngram": ("--spec-type", "ngram-mod")}


def measure(setup: str, model: Path, new_tokens: int, concurrency: int) -> tuple[float, list[str]]:
    """tokens/s and texts of one setup at one concurrency, on a fresh server."""
    if setup in LLAMA_ARGS:
        server, _ = llama_cpp_paths(model)
        slots = ("-np", str(concurrency), "--cache-ram", "0", *LLAMA_ARGS[setup])
        with llama_server(server, str(model / SOURCE_GGUF), *slots) as url:
            over_http(url, PROMPTS[:2], 8, 2)
            return over_http(url, PROMPTS, new_tokens, concurrency)
    with start_nats() as bus, specmesh_up(model, *UP_ARGS[setup], "--nats-url", bus.url) as url:
        over_http(url, PROMPTS[:2], 8, 2)
        return over_http(url, PROMPTS, new_tokens, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--setups", default="fp32,gguf,llama.cpp")
    args = parser.parse_args()
    model = fetch_default_model()
    setups = args.setups.split(",")
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        speeds: dict[str, list[float]] = {s: [] for s in setups}
        for run in range(args.runs):
            texts = {}
            for setup in setups:
                speed, texts[setup] = measure(setup, model, args.new_tokens, concurrency)
                speeds[setup].append(speed)
                print(f"concurrency {concurrency}, run {run + 1}: {setup} {speed:.1f} tok/s")
            for setup in (s for s in setups if s.startswith("gguf")):
                reference = "fp32" if setup == "gguf" else "gguf"
                if reference in texts:
                    pairs = zip(texts[setup], texts[reference], strict=True)
                    same = sum(a == b for a, b in pairs)
                    print(f"  {setup}'s texts equal {reference}'s: {same} of {len(PROMPTS)}")
        for setup, values in speeds.items():
            print(f"concurrency {concurrency}: {setup} median {statistics.median(values):.1f}")
        pairs = [("gguf", "fp32"), ("int8", "fp32"), ("int4", "fp32"), ("gguf", "llama.cpp")]
        pairs += [(f"gguf+{a}", f"llama.cpp+{b}") for a, b in (("NGRAM", "ngram"),)]
        pairs += [(f"gguf+{a}", "llama.cpp") for a in ("NGRAM", "EAGLE3")]
        for a, b in pairs:
            if a in speeds and b in speeds:
                ratios = [x / y for x, y in zip(speeds[a], speeds[b], strict=True)]
                print(f"concurrency {concurrency}: {a} / {b} = {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
