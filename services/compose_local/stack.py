"""docker-compose.yml with deploy/compose.local.yml on top: up until every container is
healthy, and down leaving none of its containers, volumes (anonymous ones included),
networks or untagged images behind: only the tagged images, the build cache."""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specmesh.services.compose_local.docker import (
    compose_binary,
    docker,
    ensure_docker,
    inspect,
    run,
)
from specmesh.services.compose_local.images import (
    PROJECT_IMAGE,
    ROOT,
    build_all,
    our_images,
    remove_superseded,
)

PROJECT = "specmesh"  # docker-compose.yml's `name`
PROJECT_LABEL = f"label=com.docker.compose.project={PROJECT}"
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.local.yml")
STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", "~/.local/state")).expanduser()
ENV_FILE = STATE_DIR / "specmesh" / "compose-local.env"
# docker-compose.yml refuses to start without these (README, Production settings)
PASSWORDS = (
    *(f"SPECMESH_NATS_{kind}_PASSWORD" for kind in
      ("GATEWAY", "TOKENIZER", "PREFILL", "DECODE", "DRAFTER", "LEARNER")),
    "SPECMESH_KV_DIRECT_SECRET",
    "SPECMESH_REDIS_PASSWORD",  # valkey's, for the redis-kv profile
    "GRAFANA_ADMIN_PASSWORD",
)  # fmt: skip
# This machine is shared with other work: engines' KV caches sized for a small model.
LOCAL_SETTINGS = {"SPECMESH_KV_CACHE_GB": "0.25"}
ONE_SHOT = ("model-init",)  # services that run to completion instead of staying healthy
HEALTHY_TIMEOUT_S = 900.0


def compose(*args: str) -> list[str]:
    """The compose command line for this deployment (its files, env file and project)."""
    argv = [compose_binary(), "--project-directory", str(ROOT), "--env-file", str(ENV_FILE)]
    for path in COMPOSE_FILES:
        argv += ["-f", str(path)]
    return [*argv, *args]


def write_env_file(port: int) -> None:
    """Passwords (random, kept from an earlier `up` so restarted services still agree), the
    image, the gateway's port; owner-only, outside the repository."""
    values = _read_env_file()
    for name in PASSWORDS:
        # a letter first: nats-server parses a $VARIABLE's value, and one that starts with
        # a digit as a number (the server then refuses deploy/nats.conf)
        values.setdefault(name, "p" + secrets.token_hex(24))
    values |= {"SPECMESH_IMAGE": PROJECT_IMAGE, "SPECMESH_GATEWAY_PORTS": str(port)}
    for name, value in LOCAL_SETTINGS.items():
        values[name] = os.environ.get(name, value)
    ENV_FILE.parent.mkdir(parents=True, exist_ok=True)
    ENV_FILE.touch(mode=0o600)
    ENV_FILE.write_text("".join(f"{k}={v}\n" for k, v in sorted(values.items())))


def _read_env_file() -> dict[str, str]:
    if not ENV_FILE.exists():
        return {}
    lines = ENV_FILE.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def up(port: int, scales: Sequence[str]) -> None:
    """Build what is missing, start the deployment, wait until every container is healthy."""
    started = time.monotonic()
    ensure_docker()
    build_all()
    built = time.monotonic()
    write_env_file(port)
    scale_args = [arg for scale in scales for arg in ("--scale", scale)]
    run(compose("up", "-d", "--no-build", "--pull", "never", "--remove-orphans", *scale_args))
    wait_healthy()
    healthy = time.monotonic()
    remove_superseded()  # the project image a rebuild replaced, now that no container runs it
    print(
        f"compose-local: every container healthy; images ready in {built - started:.0f} s, "
        f"containers healthy {healthy - built:.0f} s after `up`, "
        f"{healthy - started:.0f} s in all (time to healthy)"
    )
    print(f"compose-local: the API is at http://127.0.0.1:{port}/v1", flush=True)


def containers() -> list[dict[str, Any]]:
    """`docker inspect` of every container of the project, running or not."""
    ids = docker("ps", "-aq", "--filter", PROJECT_LABEL, capture=True).split()
    return inspect(*ids)


def service_of(container: dict[str, Any]) -> str:
    return container["Config"]["Labels"]["com.docker.compose.service"]


def is_ready(container: dict[str, Any]) -> bool:
    """Healthy, or (a one-shot job) finished successfully."""
    state = container["State"]
    if service_of(container) in ONE_SHOT:
        return state["Status"] == "exited" and state["ExitCode"] == 0
    return state.get("Health", {}).get("Status") == "healthy"


def describe(container: dict[str, Any]) -> str:
    state = container["State"]
    health = state.get("Health", {}).get("Status", "no check")
    return f"{container['Name'].lstrip('/')}: {state['Status']}, {health}"


def wait_healthy(timeout: float = HEALTHY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        found = containers()
        if found and all(is_ready(c) for c in found):
            return
        if time.monotonic() > deadline:
            waiting = "\n  ".join(describe(c) for c in found if not is_ready(c))
            raise TimeoutError(f"not healthy after {timeout:.0f} s:\n  {waiting}")
        time.sleep(2)


def down(remove_images: bool) -> None:
    """Remove the project's containers, the volumes they mounted (named or anonymous) and
    networks, and our images a rebuild left untagged; list the images kept as the build
    cache (or remove them too)."""
    ensure_docker()
    # Anonymous volumes carry no project label: known only from the containers' mounts.
    mounted = mounted_volumes(containers())
    if ENV_FILE.exists():
        run(compose("--profile", "*", "down", "--volumes", "--remove-orphans", "--timeout", "30"))
    for name in set(mounted) & _volumes():
        docker("volume", "rm", name, capture=True)  # what `down --volumes` did not remove
    in_use = remove_superseded()
    leftovers = _leftovers() + [f"volume {name}" for name in mounted if name in _volumes()]
    leftovers += [f"untagged image {image}" for image in in_use]
    if leftovers:
        raise RuntimeError("left behind: " + ", ".join(leftovers))
    if remove_images:
        tags = [line.split()[0] for line in our_images()]
        if tags:
            docker("rmi", *tags)
    ENV_FILE.unlink(missing_ok=True)
    kept = our_images()
    print("compose-local: no container, volume, network or untagged image of ours is left")
    if kept:
        print("compose-local: images kept as the build cache (`down --images` removes them):")
        for line in kept:
            print(f"  {line}")


def mounted_volumes(found: list[dict[str, Any]]) -> list[str]:
    """The Docker volumes the containers mount, named and anonymous, each once."""
    names = (m["Name"] for c in found for m in c.get("Mounts") or [] if m["Type"] == "volume")
    return list(dict.fromkeys(names))


def _volumes() -> set[str]:
    return set(docker("volume", "ls", "-q", capture=True).split())


def _leftovers() -> list[str]:
    """Containers, volumes and networks still labelled with the project."""
    listings = {
        "container": ["ps", "-a", "--format", "{{.Names}}"],
        "volume": ["volume", "ls", "--format", "{{.Name}}"],
        "network": ["network", "ls", "--format", "{{.Name}}"],
    }
    found = []
    for kind, listing in listings.items():
        names = docker(*listing, "--filter", PROJECT_LABEL, capture=True).split()
        found += [f"{kind} {name}" for name in names]
    return found


def passthrough(args: Sequence[str]) -> int:
    """A compose command on this deployment (`scripts/compose-local compose ps`)."""
    return subprocess.run(compose(*args)).returncode
