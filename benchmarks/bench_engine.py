"""Decode throughput: the specmesh engine vs transformers `generate`, side by side.

    python benchmarks/bench_engine.py [--model DIR] [--runs 3] [--new-tokens 64]

Both generate the same number of greedy tokens from the same chat prompts, at
batch 1 (one request at a time) and batch 8 (eight at once; transformers with
left padding). Each configuration runs `--runs` times, interleaved, and the
medians are printed with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from shared.engine.engine import EngineConfig, LLMEngine
from shared.model.fetch import fetch_default_model
from shared.sampling.params import SamplingParams
from shared.tokenizer import Tokenizer

PROMPTS = [
    "Explain how a hash map works.",
    "Write a short story about a robot learning to paint.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle for a ten-year-old.",
    "List five tips for writing clean Python code.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet.",
    "How does public-key cryptography work?",
]


def timed(fn: Callable[[], int]) -> float:
    """Tokens per second of one call of `fn` (which returns the tokens it generated)."""
    start = time.perf_counter()
    tokens = fn()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model_dir = args.model or str(fetch_default_model())

    from transformers import AutoModelForCausalLM

    tok = Tokenizer(model_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    n = args.new_tokens
    engine = LLMEngine(EngineConfig(model=model_dir))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)

    def ours(batch: list[list[int]]) -> int:
        return sum(len(o) for o in engine.generate(batch, params))

    def theirs(batch: list[list[int]]) -> int:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * len(batch)

    ours([prompts[0]])  # warm-up both
    theirs([prompts[0]])
    print(f"model {model_dir}, {n} new tokens per request, {args.runs} runs, median tok/s")
    print(f"{'batch':>5} {'specmesh':>10} {'transformers':>13} {'ratio':>7}")
    for batch_size in (1, 8):
        mine, ref = [], []
        for run in range(args.runs):
            if batch_size == 1:
                prompt = [prompts[run % len(prompts)]]
                mine.append(timed(lambda p=prompt: ours(p)))
                ref.append(timed(lambda p=prompt: theirs(p)))
            else:
                mine.append(timed(lambda: ours(prompts)))
                ref.append(timed(lambda: theirs(prompts)))
        a, b = statistics.median(mine), statistics.median(ref)
        print(f"{batch_size:>5} {a:>10.1f} {b:>13.1f} {a / b:>6.2f}x", flush=True)


if __name__ == "__main__":
    main()
