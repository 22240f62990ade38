"""Kernels: `cpu/`, the fused CPU decoder (C++, compiled on first use); `triton/`, Triton
kernels for the GPU path (paged causal/tree attention, the engine's `--attention-backend
triton`; draft-tree acceptance, KV block and accepted-path copies, not yet wired in);
`check/`, `python -m specmesh.kernels.check`, which holds each Triton kernel to the
torch/Python path it stands for (under Triton's interpreter where there is no GPU). GPU code
is imported only when chosen: nothing imports `kernels.triton` at module import time, so CPU
use needs no Triton (the `gpu` extra)."""

import os

# Set before torch loads (`shared` imports this package first): torch's OpenMP threads sleep
# as soon as a parallel region ends. Spinning, they took the cores that the CPU kernels'
# pool and other processes' threads were waiting for. A process that loaded torch first
# keeps its own setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
