"""Our engine on a CUDA device, side by side in one run: greedy decode throughput per
attention backend, with and without CUDA graphs, against transformers `generate` on the same
weights.

    python benchmarks/bench_gpu.py [--model DIR] [--random-weights] [--batches 1,8,64]
        [--new-tokens 128] [--prompt-tokens 64] [--backends torch,triton,flashinfer]
        [--runs 3] [--device cuda]

`--random-weights`: the checkpoint's config and tokenizer with random weights, for a machine
the weights cannot travel to; a step's cost does not depend on the values. Each row prints
tokens/s (median of `--runs`), its ratio to transformers at that batch, and how many of the
batch's greedy outputs equal the torch backend's without graphs (bf16: a near-tie can part
two backends' paths). A backend that cannot run here (FlashInfer not installed) is reported
and skipped.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.fetch import fetch_default_model
from specmesh.shared.sampling.params import SamplingParams

Outputs = list[list[int]]
T = TypeVar("T")


def random_checkpoint(model_dir: Path, out: Path) -> str:
    """`model_dir`'s config, tokenizer and chat template with random bf16 weights in `out`
    (which may be `model_dir` itself)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != model_dir.resolve():
        for f in model_dir.iterdir():
            if f.is_file() and f.suffix not in (".safetensors", ".bin", ".gguf", ".pt"):
                shutil.copy(f, out / f.name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.to(torch.bfloat16).save_pretrained(out)
    return str(out)


def timed(fn: Callable[[], T], runs: int, device: str) -> tuple[float, T]:
    """Median seconds of `runs` calls of fn() after one warm-up, and its last result."""
    result = fn()
    times = []
    for _ in range(runs):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_rates(
    model: str,
    backend: str,
    graphs: bool,
    prompts: list[list[int]],
    batches: list[int],
    args: argparse.Namespace,
) -> dict[int, tuple[float, Outputs]]:
    """Per batch: tokens/s and the greedy outputs of one engine configuration."""
    engine = LLMEngine(
        EngineConfig(
            model=model,
            device=args.device,
            dtype="bfloat16",
            attention_backend=backend,
            disable_cuda_graph=not graphs,
            max_num_seqs=max(batches),
            mem_fraction_static=0.3,
        )
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    rates = {}
    for b in batches:
        seconds, outputs = timed(
            lambda b=b: engine.generate(prompts[:b], params), args.runs, args.device
        )
        rates[b] = (b * args.new_tokens / seconds, outputs)
    return rates


def hf_rates(
    model: str, prompts: list[list[int]], batches: list[int], args: argparse.Namespace
) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(args.device)
    rates = {}
    for b in batches:
        ids = torch.tensor(prompts[:b], device=args.device)

        def generate(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                hf.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=args.new_tokens,
                    min_new_tokens=args.new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )

        rates[b] = b * args.new_tokens / timed(generate, args.runs, args.device)[0]
    return rates


def configurations(backends: list[str]) -> list[tuple[str, bool]]:
    """(backend, CUDA graphs): the torch backend runs eagerly, the kernels both ways."""
    return [(b, g) for b in backends for g in ((False,) if b == "torch" else (False, True))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded one)")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--backends", default="torch,triton,flashinfer")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA device (or --device cpu)")
    model_dir = Path(args.model or fetch_default_model())
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = random_checkpoint(model_dir, Path(tmp)) if args.random_weights else str(model_dir)
        vocab = torch.Generator().manual_seed(0)
        prompts = torch.randint(100, 10000, (max(batches), args.prompt_tokens), generator=vocab)
        run(model, prompts.tolist(), batches, args)


def run(model: str, prompts: list[list[int]], batches: list[int], args: argparse.Namespace) -> None:
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}; model: {model}; {args.new_tokens} new tokens")
    hf = hf_rates(model, prompts, batches, args)
    release_memory()  # each engine's weights and cache go before the next one's
    print("transformers: " + ", ".join(f"batch {b} {hf[b]:.0f} tok/s" for b in batches))
    reference: dict[int, Outputs] = {}
    print(f"{'backend':<11}{'graphs':<8}{'batch':>6}{'tok/s':>10}{'vs HF':>8}{'same':>8}")
    for backend, graphs in configurations(args.backends.split(",")):
        try:
            rates = engine_rates(model, backend, graphs, prompts, batches, args)
        except (ImportError, RuntimeError, ValueError) as e:
            print(f"{backend:<11}{str(graphs):<8} cannot run here: {e}")
            continue
        finally:
            release_memory()
        for b, (rate, outputs) in rates.items():
            reference.setdefault(b, outputs)
            same = sum(o == r for o, r in zip(outputs, reference[b], strict=True))
            print(
                f"{backend:<11}{str(graphs):<8}{b:>6}{rate:>10.0f}{rate / hf[b]:>7.2f}x"
                f"{same:>5}/{b}"
            )


if __name__ == "__main__":
    main()
