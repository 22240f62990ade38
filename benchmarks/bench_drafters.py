"""Drafters side by side over the services: no speculation, NGRAM, STANDALONE, EAGLE,
EAGLE-3, NEXTN, DFLASH.

    python benchmarks/bench_drafters.py [--model DIR] [--new-tokens 96] [--runs 3]
        [--standalone-draft DIR] [--eagle-head DIR] [--eagle3-head DIR] [--nextn-layer DIR]
        [--dflash-draft DIR] [--setups none,NGRAM,EAGLE3,NEXTN@3/2/6,DFLASH]
        [--sets chat,copy] [--fixed] [--draft-quantization int8] [--temperature 0.7]

Each setup is its own `specmesh up` (five services, shm transport), one request at a
time (concurrency 1), greedy. Two prompt sets: `chat`, the held-out chat prompts
(`benchmarks/prompts/chat_heldout.json`, topics no drafter trained on) and `copy`,
bench_ngram's rewrite and repetition prompts. Per setup and set it prints
generated tokens/s and the acceptance length (tokens per verify step), and each
setup's speed over no speculation and over NGRAM: ratios taken within a run (the
setups run back to back), then the median over `--runs`. First it prints the verify
cost curve the engine measures when it starts (what draft budgets are chosen by).
A setup
without its drafter option uses the drafter that ships for the default model (a setup
with neither is skipped). Every output is
checked to equal the output without speculation (with `--temperature` > 0 each
request is seeded, and seeded draws do not depend on speculation). A setup
`NAME@STEPS/TOPK/TOKENS` drafts that shape (`--speculative-num-steps`,
`--speculative-eagle-topk`, `--speculative-num-draft-tokens`; with `--fixed`, also
`--no-speculative-adaptive`: every step verifies all its drafts); a bare name takes
the defaults.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ngram import REPEAT, REWRITE  # noqa: E402
from deployment import specmesh_up  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.speculative.config import SpeculativeConfig, shipped_drafter  # noqa: E402

CHAT = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())
SETS = {"chat": CHAT, "copy": REWRITE + REPEAT}


def run_set(
    client: httpx.Client, url: str, prompts: list[str], new_tokens: int, temperature: float
) -> dict:
    """One request at a time: tokens/s, acceptance length, texts."""
    tokens = steps = accepted = 0
    texts = []
    start = time.perf_counter()
    for seed, prompt in enumerate(prompts):
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "temperature": temperature,
            "seed": seed,
            "max_tokens": new_tokens,
        }
        r = client.post(f"{url}/v1/chat/completions", json=body).json()
        texts.append(r["choices"][0]["message"]["content"])
        tokens += r["usage"]["completion_tokens"]
        spec = r.get("metrics", {}).get("speculative_decoding", {})
        steps += spec.get("num_spec_steps", 0)
        accepted += spec.get("num_accepted_draft_tokens", 0)
    seconds = time.perf_counter() - start
    return {
        "rate": tokens / seconds,
        "accept": 1 + accepted / steps if steps else 1.0,
        "texts": texts,
    }


def run_setup(
    model: Path, args: list[str], sets: list[str], new_tokens: int, temperature: float
) -> dict[str, dict]:
    with (
        start_nats() as bus,
        specmesh_up(model, *args, "--nats-url", bus.url) as url,
        httpx.Client(timeout=900) as client,
    ):
        run_set(client, url, ["Say hello.", "Count to five."], 16, temperature)  # warm-up
        return {name: run_set(client, url, SETS[name], new_tokens, temperature) for name in sets}


def shape_args(shape: str, fixed: bool) -> list[str]:
    """`STEPS/TOPK/TOKENS` as the draft-shape options; `fixed`: no adaptive budget."""
    values = shape.split("/")
    if len(values) != 3 or not all(v.isdigit() for v in values):
        raise SystemExit(f"a draft shape is STEPS/TOPK/TOKENS, got {shape!r}")
    names = ("num-steps", "eagle-topk", "num-draft-tokens")
    pairs = zip(names, values, strict=True)
    adaptive = ["--no-speculative-adaptive"] if fixed else []
    return [arg for name, v in pairs for arg in (f"--speculative-{name}", v)] + adaptive


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    drafters = {
        "STANDALONE": "--standalone-draft",
        "EAGLE": "--eagle-head",
        "EAGLE3": "--eagle3-head",
        "NEXTN": "--nextn-layer",
        "DFLASH": "--dflash-draft",
    }
    for algorithm, flag in drafters.items():
        parser.add_argument(flag, default=None, help=f"{algorithm} drafter (default: shipped)")
    parser.add_argument("--setups", default="none,NGRAM,STANDALONE,EAGLE,EAGLE3,NEXTN,DFLASH")
    parser.add_argument("--sets", default=",".join(SETS), help="prompt sets: chat, copy")
    parser.add_argument(
        "--fixed", action="store_true", help="shaped setups verify every draft (budgets off)"
    )
    parser.add_argument(
        "--draft-quantization", default=None, help="model drafters' weights (int8, int4, bf16)"
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    sets = args.sets.split(",")
    if not sets or not set(sets) <= set(SETS):
        raise SystemExit(f"--sets takes {', '.join(SETS)}, got {args.sets!r}")
    model = Path(args.model) if args.model else fetch_default_model()
    heads = {a: getattr(args, f.removeprefix("--").replace("-", "_")) for a, f in drafters.items()}
    setups = {}
    for name in args.setups.split(","):
        algorithm, _, shape = name.partition("@")
        if name == "none":
            setups[name] = []
        elif (
            algorithm in heads
            and not heads[algorithm]
            and not shipped_drafter(str(model), algorithm)
        ):
            print(f"skipping {name}: no {drafters[algorithm]} given and none ships")
        else:
            setups[name] = ["--speculative-algorithm", algorithm]
            if heads.get(algorithm):
                setups[name] += ["--speculative-draft-model-path", heads[algorithm]]
            if shape:
                setups[name] += shape_args(shape, args.fixed)
            if args.draft_quantization and algorithm != "NGRAM":
                setups[name] += ["--speculative-draft-model-quantization", args.draft_quantization]
    spec = SpeculativeConfig(speculative_algorithm="NGRAM")  # budgets up to 7 drafts
    costs = LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.25), spec).speculator.costs
    curve = "  ".join(f"{k}: {t / costs.verify[0]:.2f}" for k, t in enumerate(costs.verify))
    print(f"verify cost, k drafts / a plain decode step ({costs.verify[0] * 1e3:.1f} ms): {curve}")
    results: dict[tuple[str, str], list[dict]] = {}
    for run in range(args.runs):
        for name, up in setups.items():
            outcome = run_setup(model, up, sets, args.new_tokens, args.temperature)
            for set_name, result in outcome.items():
                results.setdefault((name, set_name), []).append(result)
                reference = results.get(("none", set_name), [result])[-1]["texts"]
                if result["texts"] != reference:
                    print(f"WARNING: {name} {set_name}: output differs from no speculation")
            line = "  ".join(
                f"{s} {results[(name, s)][-1]['rate']:.1f} tok/s "
                f"(accept {results[(name, s)][-1]['accept']:.2f})"
                for s in sets
            )
            print(f"run {run + 1} {name}: {line}", flush=True)

    def ratio(name: str, base: str, set_name: str) -> str:
        if (base, set_name) not in results:
            return "-"
        pairs = zip(results[(name, set_name)], results[(base, set_name)], strict=True)
        return f"{statistics.median(a['rate'] / b['rate'] for a, b in pairs):.2f}x"

    sampling = f"temperature {args.temperature}" if args.temperature else "greedy"
    print(
        f"\nconcurrency 1, {sampling}, up to {args.new_tokens} tokens, medians of {args.runs} runs"
    )
    print(f"{'setup':<16}{'set':<6}{'tok/s':>8}{'accept':>8}{'vs none':>9}{'vs NGRAM':>10}")
    for name in setups:
        for set_name in sets:
            rs = results[(name, set_name)]
            rate = statistics.median(r["rate"] for r in rs)
            accept = statistics.median(r["accept"] for r in rs)
            print(
                f"{name:<16}{set_name:<6}{rate:>8.1f}{accept:>8.2f}"
                f"{ratio(name, 'none', set_name):>9}{ratio(name, 'NGRAM', set_name):>10}"
            )


if __name__ == "__main__":
    main()
