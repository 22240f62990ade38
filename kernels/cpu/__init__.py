"""C++ CPU kernels (`matmul.cpp`: matmuls over column-blocked weights; `decoder.cpp`: the
fused decoder step), compiled on first use by torch's extension builder and
cached under ~/.cache/torch_extensions. Without a compiler or AVX2 they are simply absent
and the model runs its plain torch path."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils.cpp_extension import load as build

    try:
        return build(
            name="specmesh_cpu",
            sources=[str(Path(__file__).with_name(f)) for f in ("decoder.cpp", "matmul.cpp")],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # no compiler, no headers: the torch path still works
        log.warning("CPU kernels unavailable, using the torch path: %s", exc)
        return None
