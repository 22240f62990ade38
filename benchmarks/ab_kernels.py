"""This checkout's CPU kernels against a git revision's, taking turns in one process.

    python benchmarks/ab_kernels.py --base REV [--quantization gguf] [--batch 1]
        [--new-tokens 1] [--context 300] [--rounds 30] [--same-weights]
    python benchmarks/ab_kernels.py --base REV --prefill 4096 [--rounds 4]

Each build of `kernels/cpu` serves an engine of its own, its weights packed by that build
(so a change to a packing layout, `block_weight` or `quant_pack`, compares too), the two
taking turns: decode steps in blocks of 25 (the first 3 of each dropped), or one long
prompt's prefill per turn; the order flips every round. Prints each build's median and
the speed-up of this checkout over the base, per round and their median. Wall time on
this machine moves by 2x between days and by a third within minutes: a kernel change is
judged by this ratio, not by times taken apart. The ratio has a bias and a scatter of
its own (two engines, their memory placed apart): run a control first, `--base HEAD` with
nothing changed (on a Zen 4 day it read 0.996-1.045x), and judge a change against it.
Memory on this machine reads at different speeds by where a buffer lands (one 256 MB
buffer ~26 GB/s, the next ~32, round after round), so two engines' weights may not read
alike: `--same-weights` (decode, builds that pack their weights alike) gives both builds'
fused decoders one engine's weights. A base whose `Decoder` takes other arguments (before
2a4c42a, which gave it the embedding and the step as lists) does not compare.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import specmesh.kernels.cpu as cpu_kernels  # noqa: E402
import specmesh.shared.model.layers as layers  # noqa: E402
from bench_prefill import prefill_engine, prompt_ids, timed_prefill  # noqa: E402
from bench_step import StepProbe  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.model.fused import FusedDecoder  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS_PER_TURN, WARM_STEPS = 25, 3


def sources_at(revision: str, into: Path) -> Path:
    """kernels/cpu's files as they were at `revision`, copied into `into`."""
    listing = subprocess.run(
        ["git", "ls-tree", "--name-only", revision, "kernels/cpu/"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for path in listing:
        blob = subprocess.run(
            ["git", "show", f"{revision}:{path}"], cwd=REPO, capture_output=True, check=True
        ).stdout
        (into / Path(path).name).write_bytes(blob)
    return into


def build(sources: Path) -> ModuleType:
    module = cpu_kernels.compile_sources(sources)
    if module is None:
        raise SystemExit(f"the kernels in {sources} do not build here")
    return module


class Builds:
    """An engine per kernel build, its weights packed and its steps fused by that build; or,
    `same_weights`, one engine whose weights (packed by the first build) every build's
    fused decoder reads, so that where the memory holds them is no difference."""

    def __init__(
        self,
        make_engine: Callable[[], LLMEngine],
        modules: list[ModuleType],
        same_weights: bool = False,
    ) -> None:
        self.modules, self.engines, self.fused = modules, [], []
        for build, module in enumerate(modules):
            self.use_kernels(build)
            engine = self.engines[0] if same_weights and build else make_engine()
            model, kv = engine.runner.model, engine.kv_cache.layers
            self.engines.append(engine)
            self.fused.append(FusedDecoder.build(model, kv, module))

    def use_kernels(self, build: int) -> None:
        layers.load_cpu_kernels = lambda: self.modules[build]

    def use(self, build: int) -> LLMEngine:
        self.use_kernels(build)
        engine = self.engines[build]
        engine.runner.fused = self.fused[build]
        return engine


def turns(builds: Builds, rounds: int, turn: Callable[[LLMEngine], list[float]]) -> None:
    """`rounds` rounds of one turn per build (order flipped each round); prints medians."""
    times: list[list[float]] = [[], []]
    ratios = []
    for r in range(rounds):
        medians = [0.0, 0.0]
        for build in (0, 1) if r % 2 == 0 else (1, 0):
            samples = turn(builds.use(build))
            times[build] += samples
            medians[build] = statistics.median(samples)
        ratios.append(medians[0] / medians[1])
    base, new = (statistics.median(t) for t in times)
    print(f"base {base * 1e3:.2f} ms, this checkout {new * 1e3:.2f} ms")
    print(f"speed-up over the base: {statistics.median(ratios):.3f}x (median of {rounds} rounds)")
    print("per round: " + " ".join(f"{x:.3f}" for x in ratios))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="git revision whose kernels/cpu to compare")
    parser.add_argument("--quantization", default=None, help="decode steps on these blocks")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=1, help="rows per sequence a step")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--prefill", type=int, default=0, help="prompt tokens: time prefill")
    parser.add_argument("--rounds", type=int, default=None, help="default 30 (prefill: 4)")
    parser.add_argument(
        "--same-weights",
        action="store_true",
        help="one engine's weights for both builds (decode; builds that pack weights alike)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        modules = [build(sources_at(args.base, Path(tmp))), build(cpu_kernels.HERE)]
    model = fetch_default_model()
    if args.prefill:
        builds = Builds(lambda: prefill_engine(model, args.prefill, args.quantization), modules)
        ids = prompt_ids(Tokenizer(str(model)), args.prefill)
        turns(builds, args.rounds or 4, lambda engine: [timed_prefill(engine, ids)[0]])
        return
    config = EngineConfig(
        model=str(model), max_num_seqs=max(args.batch, 8), quantization=args.quantization
    )
    builds = Builds(lambda: LLMEngine(config), modules, args.same_weights)

    def steps(engine: LLMEngine) -> list[float]:
        probe, samples = StepProbe(engine, args.context), []
        for i in range(STEPS_PER_TURN):
            start = time.perf_counter()
            probe.forward(args.batch, args.new_tokens)
            if i >= WARM_STEPS:
                samples.append(time.perf_counter() - start)
        return samples

    turns(builds, args.rounds or 30, steps)


if __name__ == "__main__":
    main()
