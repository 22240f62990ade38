"""The base step against the machine's limit, side by side in one run.

    python benchmarks/bench_step.py [--model DIR] [--runs 7] [--context 300]
        [--new-tokens 32] [--services] [--quantization gguf|int8|int4|bf16]

Prints, each a median over `--runs` interleaved rounds:
- the memory-read floor of the batch-1 step: the bytes it must read (every weight as the
  kernels hold it: fp32 column blocks, or with `--quantization` their blocks; and the
  sequence's K/V at `--context`), over the read bandwidth of a plain sum in this process,
  by three probes: a 512 MB buffer (past any cache: memory), the same on huge pages (where
  the kernels pack the weights: 4 KB pages read slower on some machines), and a buffer of
  the step's own bytes read again and again, as decode reads them (a large L3 holds them
  on some machines);
- our forward step at batch 1, 8 and 32 (one new token per sequence over
  `--context` cached tokens), timed as decode runs it, step after step (the median of 20
  after 10 unmeasured), and the batch-1 step's ratio to each floor; beside it the same
  step through the model's torch path (what runs where the fused CPU kernel is unavailable);
- the verify-cost curve: one sequence forwarding k = 1..16 tokens (a draft chain),
  as a multiple of the batch-1 step;
- end-to-end greedy generation, our engine vs transformers `generate`, at batch
  1, 8 and 32 (tokens/s and ratio);
- with `--services`, the services pipeline (`specmesh up`, no speculation) at
  concurrency 1 and 8 against the in-process engine and transformers on the same
  chat prompts.
Ratios are taken within a round, then their median is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from specmesh.kernels.cpu import load as load_cpu_kernels
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.fetch import fetch_default_model
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.tokenizer import Tokenizer
from torch import nn

BATCHES = (1, 8, 32)
VERIFY_TOKENS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
PROBE_BYTES = 512 * 2**20
FLOORS = ("floor", "huge_floor", "cached_floor")  # a round's floors, as its probes' keys
CHAT = [
    "Explain how a hash map works.",
    "Write a short story about a robot learning to paint.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle for a ten-year-old.",
    "List five tips for writing clean Python code.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet.",
    "How does public-key cryptography work?",
]


def seconds(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall time of `repeat` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def steady_seconds(fn: Callable[[], object], warm: int = 10, repeat: int = 20) -> float:
    """Median wall time of `repeat` calls after `warm` unmeasured ones: consecutive steps,
    as decode runs them (the first steps after other work find their bytes out of cache)."""
    for _ in range(warm):
        fn()
    return seconds(fn, repeat)


def weight_bytes_per_step(model: LlamaForCausalLM) -> int:
    """Weight bytes a decode step must stream: every matmul weight once, as its kernel
    holds it (the embedding lookup reads a row; a tied LM head is counted as the matmul
    it is)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    return sum((m.weight if m.packed is None else m.packed).nbytes for m in linears)


def kv_bytes_per_step(engine: LLMEngine, context: int) -> int:
    """K/V bytes one sequence's decode step reads at `context` cached tokens."""
    itemsize = engine.kv_cache.dtype.itemsize
    return engine.model.config.kv_elements_per_token * context * itemsize


class StepProbe:
    """Forward passes over scratch blocks of the engine's cache (contents do not matter
    for timing)."""

    def __init__(self, engine: LLMEngine, context: int) -> None:
        self.runner, self.context = engine.runner, context
        self.block_size = engine.kv_cache.block_size
        self.blocks_per_seq = (context + 16) // self.block_size + 1

    @contextlib.contextmanager
    def torch_path(self) -> Iterator[None]:
        """Steps inside skip the fused CPU kernel."""
        fused, self.runner.fused = self.runner.fused, None
        try:
            yield
        finally:
            self.runner.fused = fused

    def forward(self, batch: int, new_tokens: int) -> None:
        spans, ids, positions, rows = [], [], [], []
        for b in range(batch):
            first = b * self.blocks_per_seq
            table = list(range(first, first + self.blocks_per_seq))
            spans.append(SequenceSpan(table, self.context, new_tokens))
            ids += [1] * new_tokens
            positions += range(self.context, self.context + new_tokens)
            rows += range(len(rows), len(rows) + new_tokens)
        self.runner.forward(spans, ids, positions, rows)


def read_bandwidth(buffer: torch.Tensor, warm: int = 0) -> float:
    """Bytes/s of a plain read (a sum) over `buffer`, best of 5 after `warm` unmeasured."""
    for _ in range(warm):
        buffer.sum()
    return buffer.numel() * buffer.element_size() / min(seconds(buffer.sum, 1) for _ in range(5))


def generate_rates(
    engine: LLMEngine, hf: nn.Module, prompts: list[list[int]], new_tokens: int
) -> tuple[float, float]:
    """Greedy tokens/s of our engine and of transformers on the same batch."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ours = seconds(lambda: engine.generate(prompts, params), 1)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def theirs() -> None:
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    tokens = new_tokens * len(prompts)
    return tokens / ours, tokens / seconds(theirs, 1)


def median_row(rounds: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--services", action="store_true")
    parser.add_argument(
        "--quantization", default=None, help="gguf, int8, int4, bf16: the engine on those blocks"
    )
    args = parser.parse_args()
    model_dir = args.model or str(fetch_default_model())

    from transformers import AutoModelForCausalLM

    engine = LLMEngine(
        EngineConfig(model=model_dir, max_num_seqs=max(BATCHES), quantization=args.quantization)
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = Tokenizer(model_dir)
    chat = [tok.encode_chat([{"role": "user", "content": p}]) for p in CHAT]
    probe = StepProbe(engine, args.context)
    weight_bytes = weight_bytes_per_step(engine.model)
    step_bytes = weight_bytes + kv_bytes_per_step(engine, args.context)
    memory, step_sized = torch.ones(PROBE_BYTES // 4), torch.ones(step_bytes // 4)
    huge = load_cpu_kernels().huge_page_zeros([PROBE_BYTES // 4], torch.float32)
    for batch in BATCHES:  # warm-up
        probe.forward(batch, 1)
    print(
        f"model {model_dir}; the batch-1 step reads {step_bytes / 1e6:.1f} MB "
        f"({weight_bytes / 1e6:.1f} MB of weights, the rest K/V); context {args.context}; "
        f"{torch.get_num_threads()} threads; {args.runs} rounds"
    )
    rounds = []
    for _ in range(args.runs):
        r: dict[str, float] = {
            "floor": step_bytes / read_bandwidth(memory),
            "huge_floor": step_bytes / read_bandwidth(huge),
            "cached_floor": step_bytes / read_bandwidth(step_sized, warm=5),
        }
        for batch in BATCHES:
            r[f"step{batch}"] = steady_seconds(lambda b=batch: probe.forward(b, 1))
            with probe.torch_path():
                r[f"torch{batch}"] = seconds(lambda b=batch: probe.forward(b, 1))
        for k in VERIFY_TOKENS:
            r[f"verify{k}"] = steady_seconds(lambda k=k: probe.forward(1, k)) / r["step1"]
        for batch in BATCHES:
            prompts = (chat * (batch // len(chat) + 1))[:batch]
            ours, theirs = generate_rates(engine, hf, prompts, args.new_tokens)
            r[f"ours{batch}"], r[f"hf{batch}"], r[f"gen{batch}"] = ours, theirs, ours / theirs
        for key in FLOORS:
            r[f"x_{key}"] = r["step1"] / r[key]
        rounds.append(r)
        floors = " / ".join(f"{r[key] * 1e3:.2f}" for key in FLOORS)
        ratios = " / ".join(f"{r[f'x_{key}']:.2f}x" for key in FLOORS)
        print(
            f"  round {len(rounds)}: floors {floors} ms, step1 {r['step1'] * 1e3:.2f} ms "
            f"({ratios})",
            flush=True,
        )
    m = lambda key: median_row(rounds, key)  # noqa: E731
    for name, key, size in (
        ("512 MB", "floor", PROBE_BYTES),
        ("512 MB huge-page", "huge_floor", PROBE_BYTES),
        ("step-sized", "cached_floor", step_bytes),
    ):
        print(
            f"\n{name} probe: {step_bytes / m(key) / 1e9:.1f} GB/s over {size / 1e6:.0f} MB -> "
            f"floor {m(key) * 1e3:.2f} ms; batch-1 step {m(f'x_{key}'):.2f}x it"
        )
    print(f"\n{'batch':>5} {'step ms':>8} {'torch path ms':>14}")
    for batch in BATCHES:
        step, torch_step = m(f"step{batch}") * 1e3, m(f"torch{batch}") * 1e3
        print(f"{batch:>5} {step:>8.2f} {torch_step:>14.1f}")
    print(
        "\nverify k tokens, x batch-1 step: "
        + "  ".join(f"{k}:{m(f'verify{k}'):.2f}" for k in VERIFY_TOKENS)
    )
    print(f"\n{'batch':>5} {'specmesh tok/s':>15} {'transformers':>13} {'ratio':>7}")
    for b in BATCHES:
        print(f"{b:>5} {m(f'ours{b}'):>15.1f} {m(f'hf{b}'):>13.1f} {m(f'gen{b}'):>6.2f}x")
    if args.services:
        services_table(Path(model_dir), engine, hf, chat, args)


def in_process_rate(
    engine: LLMEngine, chat: list[list[int]], concurrency: int, new_tokens: int
) -> float:
    """Greedy tokens/s of the engine over all prompts, `concurrency` at a time."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    batches = [chat[i : i + concurrency] for i in range(0, len(chat), concurrency)]
    return (
        len(chat) * new_tokens / seconds(lambda: [engine.generate(b, params) for b in batches], 1)
    )


def services_table(
    model_dir: Path,
    engine: LLMEngine,
    hf: nn.Module,
    chat: list[list[int]],
    args: argparse.Namespace,
) -> None:
    """The services (no speculation) vs the in-process engine and transformers."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_services import over_http  # noqa: PLC0415
    from deployment import specmesh_up  # noqa: PLC0415
    from specmesh.shared.infra import start_nats  # noqa: PLC0415

    n = args.new_tokens
    rows: dict[int, list[tuple[float, float, float]]] = {1: [], 8: []}
    with start_nats() as bus, specmesh_up(model_dir, "--nats-url", bus.url) as url:
        over_http(url, CHAT[:1], n, 1)  # warm-up
        for _ in range(args.runs):
            for c in rows:
                services, _ = over_http(url, CHAT, n, c)
                ours = in_process_rate(engine, chat, c, n)
                _, hf_rate = generate_rates(engine, hf, chat[:c], n)
                rows[c].append((services, services / ours, services / hf_rate))
    print(f"\n{'conc':>4} {'services tok/s':>15} {'x in-process':>13} {'x transformers':>15}")
    for concurrency, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(3)]
        print(f"{concurrency:>4} {med[0]:>15.1f} {med[1]:>12.2f}x {med[2]:>14.2f}x")


if __name__ == "__main__":
    main()
