"""llama.cpp's llama-server as a benchmark peer: the paths `llama_cpp.sh` builds (cached),
and a server on a free port for the length of a `with` block."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from specmesh.shared.infra import free_port

SCRIPT = Path(__file__).resolve().parent / "llama_cpp.sh"


def llama_cpp_paths(model: Path) -> tuple[str, str]:
    """Build (or find, cached) llama-server and the F32 GGUF of `model` with the script."""
    found = _run_script(model)
    return found["LLAMA_SERVER"], found["GGUF"]


def llama_cpp_eagle3(model: Path, head: Path) -> str:
    """The F32 GGUF of EAGLE-3 `head` for `model`, made by llama.cpp's own converter."""
    return _run_script(model, head)["DRAFT"]


def _run_script(*args: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHON": sys.executable}
    argv = [str(SCRIPT), *map(str, args)]
    out = subprocess.run(argv, env=env, check=True, capture_output=True)
    return dict(line.split("=", 1) for line in out.stdout.decode().split())


@contextlib.contextmanager
def llama_server(server: str, gguf: str, *args: str) -> Iterator[str]:
    """`llama-server -m gguf -t <our cores> args...`; yields its URL once it is healthy."""
    port = free_port()
    cores = str(len(os.sched_getaffinity(0)))
    argv = [server, "-m", gguf, "--port", str(port), "-t", cores, *args]
    # Not our processes' passive OpenMP wait (kernels/__init__.py sets it for torch): with
    # it llama.cpp's OpenMP threads sleep between its ops, 3x slower at concurrency 1.
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while not _ready(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"llama-server did not start:\n{log.read().decode()}")
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            proc.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
