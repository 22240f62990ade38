"""C++ CPU kernels (`matmul.cpp`: matmuls over column-blocked weights; `quant.cpp`: matmuls
over GGUF's quantized blocks; `attention.cpp`: tiled causal attention for prefill;
`decoder.cpp`: the fused decoder step; `pool.cpp`: the thread pool they run their jobs on),
compiled on first use by torch's extension builder and cached under
~/.cache/torch_extensions. One build per content of the sources and torch installation,
compiled from copies of the sources kept beside the builds: torch's builder rebuilds when a
build's command changes (its source paths, torch's include paths), so checkouts on one
machine (or an image's build step and its installed package) sharing a build by its paths,
or virtualenvs sharing one by its name, rebuilt it in turns. One process at a time loads a
build, under a lock the kernel releases when its holder dies: torch's own lock file, left
behind by a process killed mid-build, would hold every later one forever. Without a compiler
or AVX2 they are simply absent and the model runs its plain torch path."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = ("attention.cpp", "decoder.cpp", "matmul.cpp", "pool.cpp", "quant.cpp")
HERE = Path(__file__).parent


def _source_files(sources: Path = HERE) -> list[Path]:
    return sorted([*sources.glob("*.cpp"), *sources.glob("*.h")])


def build_name(sources: Path = HERE) -> str:
    """The extension's name (its build directory), keyed by every source and header and by
    the torch it builds against (its version and where it lies)."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update(f"{torch.__version__} {Path(torch.__file__).parent}".encode())
    for path in _source_files(sources):
        digest.update(path.name.encode() + path.read_bytes())
    return f"specmesh_cpu_{digest.hexdigest()}"


def build_root() -> Path:
    """Where torch's builder keeps the builds: TORCH_EXTENSIONS_DIR where it is set (the
    image's /opt/torch_extensions), else its default under ~/.cache. torch's
    get_default_build_root is only that default: sources staged there in an image went to
    root's home at its build and to the service user's unwritable one at run time, so every
    container ran the torch path."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def staged_sources(name: str, sources: Path = HERE) -> Path:
    """The sources copied under the build root, in a folder named like the build: the same
    paths for the same content wherever the package lies."""
    staged = build_root() / "specmesh_sources" / name
    if not staged.is_dir():
        staged.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=staged.parent))
        for path in _source_files(sources):
            shutil.copy2(path, tmp)
        try:
            os.rename(tmp, staged)
        except OSError:  # another process staged them first
            shutil.rmtree(tmp)
    return staged


@contextlib.contextmanager
def exclusive_build(name: str) -> Iterator[Path]:
    """Hold build `name` (its folder) alone. Inside, a lock file torch's builder left is
    stale (its holder was killed): it goes, so torch's builder does not wait on it forever."""
    build_dir = build_root() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # read-only: a build another user made (an image's) is still lockable
    held = os.open(build_dir / "specmesh.flock", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if (build_dir / "lock").exists():
            (build_dir / "lock").unlink()
        yield build_dir
    finally:
        os.close(held)


@functools.cache
def load() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here."""
    return compile_sources(HERE)


def compile_sources(sources: Path) -> ModuleType | None:
    """The kernels compiled from the sources in `sources` (this package's, or another
    revision's for a side-by-side benchmark), or None where they cannot be built here."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils.cpp_extension import load as build

    try:
        name = build_name(sources)
        staged = staged_sources(name, sources)
        with exclusive_build(name) as build_dir:
            module = build(
                name=name,
                sources=[str(staged / f) for f in SOURCES],
                extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"],
                build_directory=str(build_dir),
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
