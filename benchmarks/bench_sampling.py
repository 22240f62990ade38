"""Truncated sampling (top_k, top_p, min_p) against sorting the whole vocabulary.

    python benchmarks/bench_sampling.py [--rows 128] [--runs 7]

The model samples one answer (temperature 0.8); its logits at each position, as a
batch of `--rows` rows, are truncated by `to_probs`'s `_truncate` under each setting,
beside one stable sort of the same rows (the whole-row path, which it used to take for
every row). Prints the medians of `--runs` interleaved rounds, their ratio, and how
many rows each setting still sorts whole (flat ones, ties across the cut).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from specmesh.shared.model.fetch import fetch_default_model
from specmesh.shared.sampling import sampler
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.tokenizer import Tokenizer

SETTINGS = {
    "top_k 20, T 0.7": SamplingParams(top_k=20, temperature=0.7),
    "top_p 0.9, T 0.7": SamplingParams(top_p=0.9, temperature=0.7),
    "top_p 0.95, T 1": SamplingParams(top_p=0.95, temperature=1.0),
    "min_p 0.05, T 1": SamplingParams(min_p=0.05, temperature=1.0),
    "top_p 0.9, T 1.5": SamplingParams(top_p=0.9, temperature=1.5),
}
PROMPT = "Write a short story about a lighthouse keeper and a storm."


@torch.no_grad()
def answer_logits(rows: int) -> torch.Tensor:
    """[rows, V] the model's logits along an answer it sampled (transformers)."""
    from transformers import AutoModelForCausalLM

    model_dir = fetch_default_model()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([Tokenizer(model_dir).encode_chat([{"role": "user", "content": PROMPT}])])
    torch.manual_seed(0)
    out = model.generate(
        ids, max_new_tokens=rows, min_new_tokens=rows, do_sample=True, temperature=0.8
    )
    return model(out).logits[0, ids.shape[1] - 1 : -1].float()


def seconds(fn: Callable[..., object], *args: object) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def sort_whole(logits: torch.Tensor) -> object:
    return logits.sort(dim=-1, descending=True, stable=True)


def whole_rows(logits: torch.Tensor, params: list[SamplingParams]) -> int:
    """How many rows `_truncate` sorts whole under `params`."""
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[-1] for p in params])
    top_p = torch.tensor([[p.top_p] for p in params])
    min_logit = torch.full((len(params), 1), -torch.inf)
    if params[0].min_p > 0:
        min_logit = logits.max(-1, keepdim=True).values + torch.tensor(params[0].min_p).log()
    best = sampler._best(logits, top_k, top_p, min_logit)
    return len(logits) if best is None else int(best[3].sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    logits = answer_logits(args.rows)
    print(f"{args.rows} rows of {logits.shape[-1]} logits")
    for name, params in SETTINGS.items():
        x, batch = logits / params.temperature, [params] * len(logits)
        ours, whole = [], []
        for _ in range(args.runs):
            ours.append(seconds(sampler._truncate, x, batch))
            whole.append(seconds(sort_whole, x))
        a, b = statistics.median(ours), statistics.median(whole)
        print(
            f"{name:<18} truncate {a * 1e3:6.1f} ms   whole-row sort {b * 1e3:6.1f} ms   "
            f"{b / a:4.1f}x   rows sorted whole {whole_rows(x, batch)}/{len(x)}"
        )


if __name__ == "__main__":
    main()
