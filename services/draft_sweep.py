"""`specmesh bench speculative`: sweep each algorithm's draft shape over prompt sets and
print the fastest setting per workload (what SGLang's `bench_speculative.py` does).

Every setting runs in the engine itself (the drafter beside it), one request at a time,
greedy, with the adaptive budget off so that the shape measured is the shape set; each
setting's output is checked against decoding without speculation. Ratios are to the plain
engine measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from specmesh.shared.config import model_option, option
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import CHAIN_ONLY, SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer

PROMPTS_DIR = Path(__file__).parents[1] / "benchmarks" / "prompts"
DEFAULT_WORKLOADS = (
    f"chat={PROMPTS_DIR / 'chat_heldout.json'},copy={PROMPTS_DIR / 'copy_heavy.json'}"
)
Shape = tuple[int, int, int]  # num_steps, topk, num_draft_tokens


def _ints(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ValueError(f"--{name} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--{name} takes integers >= 1, got {text!r}")
    return values


@dataclass(frozen=True)
class DraftSweepConfig:
    """Each field is also a `specmesh bench speculative` option."""

    model: str | None = model_option()
    algorithms: str = option(
        "NGRAM,STANDALONE,EAGLE3,NEXTN,DFLASH", "comma-separated algorithms to sweep"
    )
    speculative_draft_model_path: str | None = option(
        None, "draft for the one algorithm swept (default: the drafter shipped for the model)"
    )
    num_steps: str = option("1,2,3,5", "--speculative-num-steps values (model drafters)")
    topk: str = option("1,2", "--speculative-eagle-topk values (chain-only algorithms: 1)")
    num_draft_tokens: str = option(
        "4,8",
        "--speculative-num-draft-tokens values (NGRAM; DFLASH: block sizes; a tree verifies "
        "that many of its best nodes, root included, at most all it grows)",
    )
    workloads: str = option(
        DEFAULT_WORKLOADS,
        "comma-separated NAME=FILE.json: a JSON list of prompts, or an object of such lists",
    )
    num_prompts: int = option(8, "prompts per workload")
    max_tokens: int = option(64, "new tokens per request")
    output: str | None = option(None, "also write every measurement to this JSON file")

    def grid(self, algorithm: str) -> list[Shape]:
        """The shapes swept for `algorithm`."""
        if algorithm in ("NGRAM", "DFLASH"):  # a chain of tokens - 1 drafts per step
            return [(t - 1, 1, t) for t in _ints(self.num_draft_tokens, "num-draft-tokens")]
        topks = [1] if algorithm in CHAIN_ONLY else _ints(self.topk, "topk")
        tokens = _ints(self.num_draft_tokens, "num-draft-tokens")
        shapes = [
            (s, k, s + 1 if k == 1 else min(t, s * k + 1))
            for s in _ints(self.num_steps, "num-steps")
            for k in topks
            for t in tokens
        ]
        return list(dict.fromkeys(shapes))

    def prompt_sets(self) -> dict[str, list[str]]:
        sets = {}
        for item in self.workloads.split(","):
            name, _, file = item.partition("=")
            try:
                data = json.loads(Path(file).read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--workloads {name}: {exc}") from None
            prompts = sum(data.values(), []) if isinstance(data, dict) else data
            if not prompts or not all(isinstance(p, str) for p in prompts):
                raise ValueError(f"--workloads {name}: {file} holds no list of prompts")
            sets[name] = prompts[: self.num_prompts]
        return sets


@dataclass
class Result:
    workload: str
    algorithm: str
    shape: Shape | None  # None: no speculation
    tokens_per_s: float
    acceptance_length: float
    speedup: float = 1.0


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], float]:
    """(outputs, tokens/s), each request alone."""
    engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    started, outputs = time.perf_counter(), []
    for ids in prompts:
        outputs += engine.generate([ids], params)
    return outputs, sum(map(len, outputs)) / (time.perf_counter() - started)


def sweep(cfg: DraftSweepConfig) -> list[Result]:
    """Measure every (workload, algorithm, shape); print each row and the best per workload."""
    model = str(resolve_model(cfg.model))
    tokenizer = Tokenizer(Path(model))
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens)
    algorithms = [a.strip().upper() for a in cfg.algorithms.split(",") if a.strip()]
    if cfg.speculative_draft_model_path and len(algorithms) != 1:
        raise ValueError("--speculative-draft-model-path names the draft of one algorithm")
    grids = {a: cfg.grid(a) for a in algorithms}
    results: list[Result] = []
    print(
        f"{'workload':10} {'algorithm':10} {'steps':>5} {'topk':>4} {'tokens':>6} "
        f"{'tok/s':>7} {'accept':>6} {'speedup':>7}"
    )
    for name, texts in cfg.prompt_sets().items():
        prompts = [tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
        plain_out, plain_rate = _run(LLMEngine(EngineConfig(model=model)), prompts, params)
        results.append(_report(Result(name, "none", None, plain_rate, 1.0)))
        for algorithm in algorithms:
            for shape in grids[algorithm]:
                spec = SpeculativeConfig(
                    speculative_algorithm=algorithm,
                    speculative_draft_model_path=cfg.speculative_draft_model_path,
                    speculative_num_steps=shape[0],
                    speculative_eagle_topk=shape[1],
                    speculative_num_draft_tokens=shape[2],
                    speculative_adaptive=False,
                )
                engine = LLMEngine(EngineConfig(model=model), spec)
                outputs, rate = _run(engine, prompts, params)
                if outputs != plain_out:
                    raise RuntimeError(f"{algorithm} {shape} changed the greedy output on {name}")
                accepted = engine.speculator.stats.acceptance_length
                results.append(
                    _report(Result(name, algorithm, shape, rate, accepted, rate / plain_rate))
                )
    _print_best(results)
    if cfg.output:
        Path(cfg.output).write_text(json.dumps([r.__dict__ for r in results], indent=1) + "\n")
    return results


def _report(r: Result) -> Result:
    steps, topk, tokens = r.shape or ("-", "-", "-")
    print(
        f"{r.workload:10} {r.algorithm:10} {steps:>5} {topk:>4} {tokens:>6} "
        f"{r.tokens_per_s:7.1f} {r.acceptance_length:6.2f} {r.speedup:6.2f}x",
        flush=True,
    )
    return r


def _print_best(results: list[Result]) -> None:
    print(
        "\nbest per workload and algorithm (--speculative-num-steps / -eagle-topk / "
        "-num-draft-tokens):"
    )
    for workload in dict.fromkeys(r.workload for r in results):
        rows = [r for r in results if r.workload == workload and r.shape]
        for algorithm in dict.fromkeys(r.algorithm for r in rows):
            best = max((r for r in rows if r.algorithm == algorithm), key=lambda r: r.speedup)
            print(
                f"  {workload}: {algorithm} {best.shape} at {best.speedup:.2f}x "
                f"(acceptance {best.acceptance_length:.2f})"
            )
        if rows:
            top = max(rows, key=lambda r: r.speedup)
            median = statistics.median(r.speedup for r in rows)
            print(
                f"  {workload}: fastest {top.algorithm} {top.shape} "
                f"{top.speedup:.2f}x (median of all settings {median:.2f}x)"
            )
