"""C++ CPU kernels (`matmul.cpp`: matmuls over column-blocked weights; `quant.cpp`: matmuls
over GGUF's quantized blocks; `attention.cpp`: tiled causal attention for prefill;
`decoder.cpp`: the fused decoder step; `pool.cpp`: the thread pool they run their jobs on),
compiled on first use by torch's extension builder and cached under
~/.cache/torch_extensions, one build per content of the sources: checkouts of different
versions on one machine keep their own builds instead of rebuilding one in turns. Without
a compiler or AVX2 they are simply absent and the model runs its plain torch path."""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = ("attention.cpp", "decoder.cpp", "matmul.cpp", "pool.cpp", "quant.cpp")
HERE = Path(__file__).parent


def build_name() -> str:
    """The extension's name: its build directory, keyed by every source and header."""
    digest = hashlib.blake2b(digest_size=6)
    for path in sorted([*HERE.glob("*.cpp"), *HERE.glob("*.h")]):
        digest.update(path.name.encode() + path.read_bytes())
    return f"specmesh_cpu_{digest.hexdigest()}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils.cpp_extension import load as build

    try:
        module = build(
            name=build_name(),
            sources=[str(HERE / f) for f in SOURCES],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"],
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        log.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
    module.set_num_threads(torch.get_num_threads())
    return module


def set_num_threads(threads: int) -> None:
    """Compute threads of this process: torch's CPU ops and the kernels' pool alike."""
    torch.set_num_threads(threads)
    kernel = load()
    if kernel is not None:
        kernel.set_num_threads(threads)
