"""NGRAM speculation vs plain decoding vs transformers, side by side in one run.

    python benchmarks/bench_ngram.py [--model DIR] [--new-tokens 128] [--runs 1]

Two prompt sets: rewrite-style (rewrite code with a small change, correct a
sentence, extend a list) and literal repetition. For each set it prints
tokens/s of: specmesh plain greedy, specmesh + NGRAM, transformers `generate`,
and transformers prompt-lookup decoding; the measured NGRAM acceptance length;
and an offline simulation over the same greedy outputs of tree n-gram drafting
with a fixed 11-token budget (what the drafter could reach if every step
drafted the full budget) as the reference. Each request runs alone (batch 1);
speculative output is checked to equal plain output.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.fetch import fetch_default_model
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.accept import accept_greedy
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest
from specmesh.shared.speculative.ngram import NgramDrafter
from specmesh.shared.tokenizer import Tokenizer

# Rewrite-style prompts (rewrite code with a small change, correct a sentence, extend a
# list) and literal repetition; `specmesh bench speculative` measures on them too.
COPY_HEAVY = json.loads((Path(__file__).parent / "prompts" / "copy_heavy.json").read_text())
REWRITE, REPEAT = COPY_HEAVY["rewrite"], COPY_HEAVY["repeat"]


def simulate(drafter: NgramDrafter, prompt: list[int], output: list[int], budget: int) -> float:
    """Mean acceptance length of tree n-gram drafting over a known greedy output.

    The greedy target's choice after a node at depth d is the true token d+1 places on;
    acceptance only ever asks at nodes on the true path, so that is all it needs."""
    truth = prompt + output
    drafter.open("sim", prompt)
    steps, known, new = 0, len(prompt), []
    while known < len(truth):
        tree = drafter.propose([DraftRequest("sim", new, budget)])[0]
        targets = [truth[known + d] if known + d < len(truth) else -1 for d in tree.depths()]
        new = [t for t in accept_greedy(tree, targets)[1] if t != -1]
        known += len(new)
        steps += 1
    drafter.close("sim")
    return len(output) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    model_dir = args.model or str(fetch_default_model())

    from transformers import AutoModelForCausalLM

    tok = Tokenizer(model_dir)
    cfg = EngineConfig(model=model_dir, kv_cache_gb=0.5)
    plain = LLMEngine(cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)

    def hf_run(ids: list[int], **extra: int) -> int:
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False, **extra
            )
        return out.shape[1] - len(ids)

    def ours(engine: LLMEngine, ids: list[int]) -> list[int]:
        return engine.generate([ids], params)[0]

    hf_run(tok.encode("hi"))  # warm-up
    print(f"model {model_dir}, up to {args.new_tokens} greedy tokens per request, batch 1")
    header = f"{'set':<10} {'plain':>7} {'NGRAM':>7} {'HF':>7} {'HF-PLD':>7}"
    print(f"{header} {'NGRAM/HF':>9} {'NGRAM/plain':>11} {'accept':>7} {'offline':>8}")
    for name, texts in (("rewrite", REWRITE), ("repeat", REPEAT)):
        prompts = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
        rates: dict[str, list[float]] = {k: [] for k in ("plain", "ngram", "hf", "pld")}
        accept, offline = [], []
        for _ in range(args.runs):
            # A fresh drafter per run: its shared trie must not remember the last run's answers.
            spec = LLMEngine(cfg, SpeculativeConfig("NGRAM"))
            timings = {k: [0.0, 0] for k in rates}
            for ids in prompts:
                for key, run in (
                    ("plain", lambda i=ids: len(ours(plain, i))),
                    ("ngram", lambda i=ids, e=spec: len(ours(e, i))),
                    ("hf", lambda i=ids: hf_run(i)),
                    ("pld", lambda i=ids: hf_run(i, prompt_lookup_num_tokens=10)),
                ):
                    start = time.perf_counter()
                    n = run()
                    timings[key][0] += time.perf_counter() - start
                    timings[key][1] += n
            for k, (seconds, tokens) in timings.items():
                rates[k].append(tokens / seconds)
            accept.append(spec.speculator.stats.acceptance_length)
        for ids in prompts:
            out = ours(plain, ids)
            assert ours(spec, ids) == out, "speculative output differs from plain greedy"
            sim = NgramDrafter(SpeculativeConfig("NGRAM").resolved())
            offline.append(simulate(sim, ids, out, budget=11))
        m = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"{name:<10} {m['plain']:>7.1f} {m['ngram']:>7.1f} {m['hf']:>7.1f} {m['pld']:>7.1f} "
            f"{m['ngram'] / m['hf']:>8.2f}x {m['ngram'] / m['plain']:>10.2f}x "
            f"{statistics.median(accept):>7.2f} {statistics.mean(offline):>8.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
