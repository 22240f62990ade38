"""A GGUF served as it ships: specmesh on its quantized blocks beside llama.cpp on the file.

    python benchmarks/bench_quantized.py [--new-tokens 128] [--runs 1] [--concurrency 1,8,32]
        [--setups fp32,gguf,llama.cpp,gguf+NGRAM,gguf+EAGLE3,llama.cpp+ngram,llama.cpp+eagle3,
        int8,int4] [--plot docs/plots/quantized.svg]

The default model's own GGUF (Q4_1 matrices, a Q8_0 embedding), held-out chat prompts (10,
or as many as the concurrency, cycling the 24), greedy, every answer `--new-tokens` long
(ignore_eos), over each server's OpenAI chat API, no speculation: `fp32`, `specmesh up` on
the weights expanded to fp32 (today's default); `gguf`, `specmesh up --quantization gguf`;
`llama.cpp`, `llama-server` on the same file (benchmarks/peers/llama_cpp.sh builds it,
cached; `-np` slots as the concurrency, no prompt cache); with speculation, `gguf+NGRAM` and
`gguf+EAGLE3` (the shipped head), `llama.cpp+ngram` (`--spec-type ngram-mod`) and
`llama.cpp+eagle3` (`--spec-type draft-eagle3`, the shipped head converted by llama.cpp's
`convert_hf_to_gguf.py --target-model-dir`); `int8` and `int4`, the safetensors weights
quantized at load (`--quantization int8|int4`). Prints generated tokens/s per setup and
concurrency, and ratios taken within a run (medians over `--runs`); checks that `gguf`
writes `fp32`'s texts and that speculation on the blocks writes `gguf`'s. `--plot` draws
tokens/s per setup and concurrency (matplotlib, the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from itertools import cycle, islice
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_services import over_http  # noqa: E402
from deployment import specmesh_up  # noqa: E402
from peers.llama_cpp import llama_cpp_eagle3, llama_cpp_paths, llama_server  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.model.gguf_loader import SOURCE_GGUF  # noqa: E402
from specmesh.shared.speculative.config import shipped_drafter  # noqa: E402

HELDOUT = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())
GGUF = ("--quantization", "gguf")
UP_ARGS = {
    "fp32": (),
    "gguf": GGUF,
    "gguf+NGRAM": (*GGUF, "--speculative-algorithm", "NGRAM"),
    "gguf+EAGLE3": (*GGUF, "--speculative-algorithm", "EAGLE3"),
    "int8": ("--quantization", "int8"),
    "int4": ("--quantization", "int4"),
}
LLAMA_ARGS = {
    "llama.cpp": (),
    "llama.cpp+ngram": ("--spec-type", "ngram-mod"),
    "llama.cpp+eagle3": ("--spec-type", "draft-eagle3"),
}
# Setups compared in each run: ours over llama.cpp's, with and without speculation.
RATIOS = [
    ("gguf", "fp32"),
    ("int8", "fp32"),
    ("int4", "fp32"),
    ("gguf", "llama.cpp"),
    ("gguf+NGRAM", "llama.cpp+ngram"),
    ("gguf+EAGLE3", "llama.cpp+eagle3"),
    ("gguf+NGRAM", "llama.cpp"),
    ("gguf+EAGLE3", "llama.cpp"),
]


def prompts_for(concurrency: int) -> list[str]:
    """10 held-out prompts, or one per slot when there are more slots."""
    return list(islice(cycle(HELDOUT), max(10, concurrency)))


def measure(
    setup: str, model: Path, prompts: list[str], new_tokens: int, concurrency: int
) -> tuple[float, list[str]]:
    """tokens/s and texts of one setup at one concurrency, on a fresh server."""
    if setup in LLAMA_ARGS:
        server, _ = llama_cpp_paths(model)
        args = ("-np", str(concurrency), "--cache-ram", "0", *LLAMA_ARGS[setup])
        if setup == "llama.cpp+eagle3":
            args += ("-md", llama_cpp_eagle3(model, Path(shipped_drafter(None, "EAGLE3"))))
        with llama_server(server, str(model / SOURCE_GGUF), *args) as url:
            over_http(url, prompts[:2], 8, 2)
            return over_http(url, prompts, new_tokens, concurrency)
    with start_nats() as bus, specmesh_up(model, *UP_ARGS[setup], "--nats-url", bus.url) as url:
        over_http(url, prompts[:2], 8, 2)
        return over_http(url, prompts, new_tokens, concurrency)


def plot(path: Path, medians: dict[int, dict[str, float]]) -> None:
    """Grouped bars: tokens/s of each setup at each concurrency."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    setups = list(next(iter(medians.values())))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(setups)
    for i, setup in enumerate(setups):
        xs = [c + (i - (len(setups) - 1) / 2) * width for c in range(len(medians))]
        ax.bar(xs, [m[setup] for m in medians.values()], width, label=setup)
    ax.set_xticks(range(len(medians)), [f"concurrency {c}" for c in medians])
    ax.set_ylabel("generated tokens/s")
    ax.set_title("SmolLM2-135M-Instruct Q4_1 GGUF, greedy, 2 CPU cores")
    ax.legend(fontsize=8, ncols=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--setups", default="fp32,gguf,llama.cpp")
    parser.add_argument("--plot", type=Path, default=None, help="an SVG or PNG to draw")
    args = parser.parse_args()
    model = fetch_default_model()
    setups = args.setups.split(",")
    medians: dict[int, dict[str, float]] = {}
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        prompts = prompts_for(concurrency)
        speeds: dict[str, list[float]] = {s: [] for s in setups}
        for run in range(args.runs):
            texts = {}
            for setup in setups:
                speed, texts[setup] = measure(setup, model, prompts, args.new_tokens, concurrency)
                speeds[setup].append(speed)
                print(f"concurrency {concurrency}, run {run + 1}: {setup} {speed:.1f} tok/s")
            for setup in (s for s in setups if s.startswith("gguf")):
                reference = "fp32" if setup == "gguf" else "gguf"
                if reference in texts:
                    pairs = zip(texts[setup], texts[reference], strict=True)
                    same = sum(a == b for a, b in pairs)
                    print(f"  {setup}'s texts equal {reference}'s: {same} of {len(prompts)}")
        medians[concurrency] = {s: statistics.median(v) for s, v in speeds.items()}
        for setup, value in medians[concurrency].items():
            print(f"concurrency {concurrency}: {setup} median {value:.1f}")
        for a, b in RATIOS:
            if a in speeds and b in speeds:
                ratios = [x / y for x, y in zip(speeds[a], speeds[b], strict=True)]
                print(f"concurrency {concurrency}: {a} / {b} = {statistics.median(ratios):.2f}x")
    if args.plot:
        plot(args.plot, medians)


if __name__ == "__main__":
    main()
