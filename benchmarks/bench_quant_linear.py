"""quant_linear's throughput per GGUF block type (BF16 too), side by side: GB/s of packed
weights read.

    python benchmarks/bench_quant_linear.py [--mb 60] [--repeats 9] [--rows 1,8] [--threads N]
        [--kernels avx2,vnni]

A decode step's matmuls in miniature: pairs of [1536, 768] and [576, 1536] weights (K
whole 256-weight superblocks, so every type fits) stacked to about `--mb` MB of Q4_1,
multiplied one after another by `--rows` activation rows. `--kernels avx2,vnni` times
quant_linear's AVX2 and AVX-512 VNNI kernels in turns (default: the one this CPU runs).
The types take turns within each repeat (a busy neighbour slows them alike); medians over
`--repeats`. Random blocks: the time does not depend on the values.
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import numpy as np
import torch
from specmesh.kernels.cpu import load, set_num_threads
from specmesh.shared.model.gguf_loader import FP16_SCALES, SERVED_BLOCK_TYPES

Q = gguf.GGMLQuantizationType
SHAPES = ((1536, 768), (576, 1536))  # [N, K]: up/gate-like, down-like


def random_blocks(rng: np.random.Generator, n: int, k: int, kind: Q) -> torch.Tensor:
    """uint8 [n, row bytes] of `kind`: random bytes, every fp16 field a small finite scale
    (BF16: random finite weights)."""
    if kind == Q.BF16:
        weights = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32))
        return weights.bfloat16().view(torch.uint8)
    values, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n * k // values, block_bytes), dtype=np.uint8)
    at, count = FP16_SCALES[kind]
    scales = rng.uniform(1e-4, 1e-3, (len(raw), count)).astype(np.float16)
    raw[:, at : at + 2 * count] = scales.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=60)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--kernels", default=None, help="avx2,vnni: each quant_linear kernel")
    args = parser.parse_args()
    set_num_threads(args.threads)
    kernel, rng = load(), np.random.default_rng(0)
    default = kernel.quant_vnni()
    isas = args.kernels.split(",") if args.kernels else ["vnni" if default else "avx2"]
    pair_bytes = sum(n * k * 5 / 8 for n, k in SHAPES)  # Q4_1: 5 bits a weight
    shapes = SHAPES * round(args.mb * 1e6 / pair_bytes)
    packed = {
        kind: [(kernel.quant_pack(random_blocks(rng, n, k, kind), int(kind)), n) for n, k in shapes]
        for kind in SERVED_BLOCK_TYPES
    }
    none = torch.empty(0)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        times: dict[tuple[Q, str], list[float]] = {}
        for _ in range(args.repeats):
            for isa in isas:
                kernel.quant_vnni(isa == "vnni")
                for kind, weights in packed.items():
                    start = time.perf_counter()
                    for (w, n), (_, k) in zip(weights, shapes, strict=True):
                        kernel.quant_linear(xs[k], w, int(kind), n, none, None)
                    times.setdefault((kind, isa), []).append(time.perf_counter() - start)
        for (kind, isa), samples in times.items():
            mb = sum(w.nbytes for w, _ in packed[kind]) / 1e6
            median = statistics.median(samples)
            print(
                f"{rows} rows {kind.name:5} {isa:4} {mb:6.1f} MB {median * 1e3:7.2f} ms "
                f"{mb / 1e3 / median:6.2f} GB/s"
            )
    kernel.quant_vnni(default)


if __name__ == "__main__":
    main()
