"""Every check: on the GPU where there is one, else under Triton's interpreter."""

from __future__ import annotations

import os

import torch
from specmesh.kernels.check.result import Result


def device() -> str:
    """The device to check on: cuda where there is a GPU, else cpu with Triton's interpreter
    on. Call it before importing a kernel module: Triton reads TRITON_INTERPRET when a kernel
    is defined."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") == "0":
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def run(small: bool | None = None) -> list[Result]:
    """Every check; `small` (the default without a GPU) keeps shapes to the interpreter's."""
    dev = device()
    from specmesh.kernels.check import accept, attention, kv_blocks, kv_move  # after device()

    small = dev == "cpu" if small is None else small
    dtypes = [torch.float32] if dev == "cpu" else [torch.float32, torch.bfloat16]
    results = [*attention.check(dev, small), *accept.check(dev, small)]
    for dtype in dtypes:
        results += [*kv_blocks.check(dev, dtype, small), kv_move.check(dev, dtype, small)]
    return results
