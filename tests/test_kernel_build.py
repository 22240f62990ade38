"""kernels/cpu's build: one per sources and torch, and no lock left by a killed builder."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from specmesh.kernels.cpu import build_name, exclusive_build

pytestmark = pytest.mark.unit

HOLD = """
import sys, time
from specmesh.kernels.cpu import exclusive_build
with exclusive_build(sys.argv[1]):
    open(sys.argv[2], "w").close()
    time.sleep(60)
"""


def test_a_builder_killed_inside_holds_no_one_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name, held = "specmesh_cpu_test", tmp_path / "held"
    child = subprocess.Popen([sys.executable, "-c", HOLD, name, str(held)], env=os.environ)
    deadline = time.monotonic() + 60
    while not held.exists():
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    (tmp_path / name / "lock").touch()  # torch's lock file, as a builder killed mid-build leaves it
    entered = threading.Event()

    def build() -> None:
        with exclusive_build(name):
            assert not (tmp_path / name / "lock").exists()
            entered.set()

    waiting = threading.Thread(target=build, daemon=True)
    waiting.start()
    assert not entered.wait(0.5)  # held while the child lives
    child.kill()
    child.wait()
    assert entered.wait(10)  # its lock went with it, and torch's stale file is gone


def test_the_build_is_named_by_its_sources_and_torch() -> None:
    name = build_name()
    assert name.startswith("specmesh_cpu_") and name == build_name()
