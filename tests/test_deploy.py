"""The deployment files and what they rely on.

docker-compose.yml, deploy/compose.gpu*.yml, the Nomad jobs, Prometheus, Grafana and
collector configs are parsed (no Docker or Nomad here) and checked against the code: every
service has a health check, restart policy, environment, scaling and resource settings;
each command runs a module that exists; every SPECMESH_* variable is an option some
service reads; every pool that holds the model runs one dtype, and NGRAM drafters reserve
no GPU. Then NATS runs with deploy/nats.conf and valkey with a password, `specmesh up`
runs against both, and every metric the Grafana dashboard queries is found on the
services' /metrics after one speculative request. Last, a decode worker refuses K/V
that a prefill of another dtype computed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import tomllib
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import hcl2
import httpx
import pytest
import redis
import yaml
from deployment import (
    SERVICE_PASSWORDS,
    assert_least_privilege,
    chat,
    heartbeats,
    scrape,
    specmesh_up,
)
from helpers import tiny_llama
from specmesh.services.decode.config import DecodeConfig
from specmesh.services.drafter.config import DrafterConfig
from specmesh.services.gateway.config import GatewayConfig
from specmesh.services.learner.config import LearnerConfig, OnlineLearningConfig
from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.shared.bus import Bus, NatsAuth
from specmesh.shared.config import DEFAULT_MODEL_NAME, env_name
from specmesh.shared.cores import CoresConfig
from specmesh.shared.engine.engine import EngineConfig
from specmesh.shared.infra import ServerProcess, free_port, start_nats, start_valkey
from specmesh.shared.logs import LogConfig
from specmesh.shared.protocol import nats_users
from specmesh.shared.service import ServiceConfig, service_main
from specmesh.shared.speculative.config import (
    DRAFTERS_MISSING,
    HEADS_DIR,
    SHIPPED,
    SpeculativeConfig,
)
from specmesh.shared.transport import TransportConfig

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
SERVICES = ("gateway", "tokenizer", "prefill", "decode", "drafter")
ALL_SERVICES = (*SERVICES, "learner")  # the learner runs where a pool learns online
MODEL_POOLS = ("prefill", "decode", "drafter")  # they load the model (a drafter unless NGRAM)
GPU_POOLS = ("prefill", "decode")  # the drafter's GPU depends on its algorithm
COMPOSE_GPU = DEPLOY / "compose.gpu.yml"
COMPOSE_GPU_DRAFTER = DEPLOY / "compose.gpu-drafter.yml"
TOPOLOGIES = {  # compose files on top of docker-compose.yml
    "cpu": (),
    "gpu": (COMPOSE_GPU,),
    "gpu-model-drafter": (COMPOSE_GPU, COMPOSE_GPU_DRAFTER),
}
NATS_NODES = ("nats-0", "nats-1", "nats-2")  # one NATS cluster
INFRA = (*NATS_NODES, "valkey", "otel-collector", "jaeger", "prometheus", "grafana")
CONFIGS = [
    ServiceConfig,
    LogConfig,
    CoresConfig,
    GatewayConfig,
    TokenizerConfig,
    EngineConfig,
    SpeculativeConfig,
    TransportConfig,
    DecodeConfig,
    DrafterConfig,
    LearnerConfig,
    OnlineLearningConfig,
]
# Read outside the option dataclasses: the model cache.
OTHER_VARIABLES = {"SPECMESH_CACHE"}
HCL = hcl2.SerializationOptions(
    with_comments=False, explicit_blocks=False, strip_string_quotes=True, preserve_heredocs=False
)


def _option_variables(configs: Iterable[type] = CONFIGS) -> set[str]:
    """Every SPECMESH_* variable some service reads (secrets also as *_FILE), or one that
    reads `configs`."""
    names = set(OTHER_VARIABLES)
    for cls in configs:
        for f in dataclasses.fields(cls):
            names.add(env_name(f.name))
            if f.metadata.get("secret"):
                names.add(env_name(f.name) + "_FILE")
    return names


def _runs_module(argv: list[str]) -> str:
    """The module of a `python -m <module>` command, which must exist."""
    assert argv[:2] == ["python", "-m"], argv
    module = argv[2]
    assert importlib.util.find_spec(f"{module}.__main__") is not None, f"no module {module}"
    return module


def _script_exists(name: str) -> None:
    """A console script of this package, whose target function exists."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts[name].partition(":")
    assert hasattr(importlib.import_module(module), function), scripts[name]


def _compose(path: Path = ROOT / "docker-compose.yml") -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _compose_stack(*overlays: Path) -> dict[str, Any]:
    """docker-compose.yml with `overlays` on top (`-f` after `-f`), merged as compose merges
    them: mappings key by key, anything else replaced."""
    merged = _compose()
    for path in overlays:
        merged = _merge(merged, _compose(path))
    return merged


def _merge(base: Any, override: Any) -> Any:
    if isinstance(base, dict) and isinstance(override, dict):
        return {**base, **{key: _merge(base.get(key), v) for key, v in override.items()}}
    return override


def _default(value: str) -> str:
    """The value compose uses for `${NAME:-default}` when NAME is unset."""
    match = re.fullmatch(r"\$\{\w+:-(.+)\}", value)
    assert match, value
    return match[1]


def _reserved_gpus(service: dict[str, Any]) -> list[str]:
    """The GPUs (device ids) a compose service reserves."""
    devices = service["deploy"]["resources"].get("reservations", {}).get("devices", [])
    for device in devices:
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    return [gpu for device in devices for gpu in device["device_ids"]]


def _hcl(name: str) -> dict[str, Any]:
    with open(DEPLOY / "nomad" / name) as f:
        return hcl2.load(f, serialization_options=HCL)


def _blocks(items: list[dict[str, Any]]) -> dict[str, Any]:
    """Labelled HCL blocks (`group "x" {...}`) as one dict by label."""
    return {label: body for item in items for label, body in item.items()}


def _dashboard_metrics() -> set[str]:
    """Sample names in the dashboard's PromQL (histograms as _bucket/_sum/_count)."""
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "specmesh.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\b(?:specmesh_|sglang:)[a-z0-9_]+", e)}


# docker-compose.yml


def test_compose_runs_each_service_from_the_one_image() -> None:
    services = _compose()["services"]
    assert set(SERVICES) | set(INFRA) <= set(services)
    image = services["gateway"]["image"]
    for name in [*SERVICES, "model-init"]:
        service = services[name]
        assert service["image"] == image
        assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    for name in SERVICES:
        assert _runs_module(services[name]["command"]) == f"specmesh.services.{name}"
    assert services["model-init"]["command"][0] == "specmesh"
    _script_exists("specmesh")
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ENV SPECMESH_CACHE=/models" in dockerfile
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile  # CPU default


def test_the_images_service_user_loads_the_kernels_it_compiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The image compiles kernels/cpu as root into TORCH_EXTENSIONS_DIR; its services load
    them as the specmesh user, whose home is not writable. The sources the build ran from are
    staged there too (not under the home directory: the same paths at build and at run time,
    so nothing rebuilds or fails), and the image's build loads them as that user."""
    from specmesh.kernels import cpu

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    staged = cpu.staged_sources("specmesh_cpu_test")
    assert staged == tmp_path / "specmesh_sources" / "specmesh_cpu_test"
    assert {p.name for p in staged.iterdir()} == {p.name for p in cpu._source_files()}
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    compiled = next(i for i, line in enumerate(lines) if "kernels.cpu import load; load()" in line)
    assert "ENV TORCH_EXTENSIONS_DIR=/opt/torch_extensions" in lines[:compiled]
    user = lines.index("USER specmesh")
    assert "chown -R specmesh /opt/torch_extensions" in " ".join(lines[compiled:user])
    assert lines[user + 3].startswith('RUN python -c "import torch; from specmesh.kernels.cpu')
    assert "assert load() is not None" in lines[user + 4]


def test_the_image_installs_locked_dependencies_before_the_source() -> None:
    """A source change must not reinstall dependencies: the locks are installed before any
    source is copied, the package after it without dependencies; and .dockerignore lets in
    every path the Dockerfile copies."""
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    steps = [line for line in lines if line.startswith(("COPY ", "RUN pip "))]
    source = next(i for i, line in enumerate(steps) if line.startswith("COPY services"))
    assert any("-r requirements/serve.lock" in line for line in steps[:source])
    assert all(line.startswith("COPY") for line in steps[source:-1])
    assert steps[-1].startswith("RUN pip install") and "--no-deps" in steps[-1]
    copied = {path for line in steps if line.startswith("COPY ") for path in line.split()[1:-1]}
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    admitted = {line.removeprefix("!") for line in lines if line.startswith("!")}
    for path in map(Path, copied):  # admitted itself or through a folder above it
        assert {path, *path.parents} & {Path(a) for a in admitted}, path
    # The drafters (their own distribution, retrained rarely): the first of the repository's
    # files in, and installed, before any code.
    code = [i for i, s in enumerate(steps) if s.startswith("COPY ") and "requirements" not in s]
    assert steps[code[0]] == "COPY drafters drafters"
    assert steps[code[0] + 1].startswith("RUN pip install --no-cache-dir --no-deps ./drafters")


# The wheels

MAIN_WHEEL_MB = 2  # the main wheel's bound: code and the CPU kernels' sources (0.43 MB now)
DRAFTERS = {f"{DEFAULT_MODEL_NAME}-{a}" for a in ("EAGLE3", "NEXTN", "DFLASH", "STANDALONE")}


def _wheel(project: Path, tmp: Path) -> Path:
    """`project`'s wheel as `pip install` builds it, its build files under `tmp`: not in the
    checkout, whose build/ would keep them (a later build takes every file a build/ holds)."""
    (tmp / "egg").mkdir(parents=True)
    cfg = tmp / "build.cfg"  # setuptools reads it besides the project's own
    cfg.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp / 'egg'}\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
        + ["-w", str(tmp), str(project)],
        env={**os.environ, "DIST_EXTRA_CONFIG": str(cfg)},
        check=True,
    )
    (wheel,) = tmp.glob("*.whl")
    return wheel


def _installed(*wheels: Path, code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`code` run where only `wheels` installed specmesh: unpacked into one folder (as into
    site-packages), before the dependencies' site-packages, without this checkout's
    editable install (-S: no .pth files)."""
    site = cwd / "site"
    for wheel in wheels:
        zipfile.ZipFile(wheel).extractall(site)
    path = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"]])
    return subprocess.run(
        [sys.executable, "-S", "-c", code],
        env={**os.environ, "PYTHONPATH": path},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_drafters_install_apart_from_the_main_wheel(tmp_path: Path) -> None:
    """`pip install .` carries no weights: the drafters trained for the default model are
    drafters/, a distribution of their own (specmesh-drafters) that adds specmesh.drafters
    beside the main package; `shipped_drafter` finds them there once both are installed, and
    with the main wheel alone asking for one says what to install. A checkout (this one, as
    scripts/setup.sh installs it) takes its own drafters/ uninstalled."""
    assert HEADS_DIR == ROOT / "drafters"
    main = _wheel(ROOT, tmp_path / "main")
    with zipfile.ZipFile(main) as whl:
        names = whl.namelist()
    assert not [n for n in names if n.endswith(".safetensors") or "/drafters/" in n]
    assert main.stat().st_size < MAIN_WHEEL_MB * 2**20, main.stat().st_size

    drafters = _wheel(ROOT / "drafters", tmp_path / "drafters")
    with zipfile.ZipFile(drafters) as whl:
        sizes = {i.filename: i.file_size for i in whl.infolist()}
    package = {n for n in sizes if not n.startswith("specmesh_drafters-")}  # not its metadata
    assert not package & set(names)  # no file of the main wheel, specmesh/__init__.py neither
    assert SHIPPED == DRAFTERS
    for name in DRAFTERS:
        files = sorted(p for p in (ROOT / "drafters" / name).iterdir() if p.is_file())
        assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in files}
        for path in files:
            assert sizes.get(f"specmesh/drafters/{name}/{path.name}") == path.stat().st_size

    check = (
        "from specmesh.shared.speculative.config import SpeculativeConfig, shipped_drafter\n"
        "assert SpeculativeConfig('EAGLE3', '/my/head').resolved()  # a head given: no need\n"
        "print(shipped_drafter(None, 'EAGLE3'))"
    )
    both = _installed(main, drafters, code=check, cwd=tmp_path / "both")
    assert both.returncode == 0, both.stderr
    installed = tmp_path / "both" / "site" / "specmesh" / "drafters"
    assert both.stdout.strip() == str(installed / f"{DEFAULT_MODEL_NAME}-EAGLE3")
    alone = _installed(main, code=check, cwd=tmp_path / "alone")
    assert alone.returncode == 1
    assert alone.stderr.strip().splitlines()[-1] == f"ValueError: {DRAFTERS_MISSING}"


def test_compose_services_have_health_restart_scaling_and_limits() -> None:
    compose = _compose()
    services = compose["services"]
    for name, service in services.items():
        limits = service["deploy"]["resources"]["limits"]
        assert limits["cpus"] and limits["memory"], name
        assert service["restart"] in ("unless-stopped", "always", "on-failure"), name
        check = service["healthcheck"]
        if check.get("disable"):  # a one-shot job: the services wait for it to finish instead
            assert service["restart"] == "on-failure"
            waits = services["decode"]["depends_on"][name]["condition"]
            assert waits == "service_completed_successfully"
        else:
            assert check["test"][0] in ("CMD", "CMD-SHELL") and check["interval"], name
    drain = dataclasses.fields(ServiceConfig)
    (drain_timeout,) = [f.default for f in drain if f.name == "drain_timeout"]
    for name in SERVICES:
        service = services[name]
        env = service["environment"]
        assert "container_name" not in service  # it would make `--scale` impossible
        # `docker stop` waits this long before SIGKILL: the drain after SIGTERM must fit
        assert int(service["stop_grace_period"].removesuffix("s")) > drain_timeout, name
        assert service["deploy"]["replicas"], name
        assert "models:/models" in service["volumes"]
        assert "models" in compose["volumes"]
        # The health check asks /health where the service serves it.
        port = env["SPECMESH_PORT"] if name == "gateway" else env["SPECMESH_METRICS_PORT"]
        assert f"127.0.0.1:{port}/health" in " ".join(service["healthcheck"]["test"])
        for dependency in (*NATS_NODES, "valkey"):
            assert service["depends_on"][dependency]["condition"] == "service_healthy"
        # valkey only runs with the redis-kv profile: without it, nothing to wait for
        assert service["depends_on"]["valkey"]["required"] is False
    gateway_ports = services["gateway"]["ports"][0]
    assert re.search(r"\d+-\d+}?:8000$", gateway_ports), "a port range, so gateways scale"


def test_compose_environment_is_wired() -> None:
    services = _compose()["services"]
    known = _option_variables()
    for name in SERVICES:
        env = services[name]["environment"]
        unknown = {k for k in env if k.startswith("SPECMESH_")} - known
        assert not unknown, f"{name} sets variables no service reads: {unknown}"
        assert env["SPECMESH_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in NATS_NODES)
        # direct by default (decode pulls K/V from prefill's container); redis: valkey
        assert _default(env["SPECMESH_KV_TRANSPORT"]) == "direct"
        assert env["SPECMESH_KV_DIRECT_SECRET"].startswith("${SPECMESH_KV_DIRECT_SECRET:?")
        assert "SPECMESH_KV_DIRECT_PORT" not in env  # 0: any port, all open between containers
        assert env["SPECMESH_REDIS_URL"].startswith("redis://valkey:6379")
        assert env["SPECMESH_METRICS_HOST"] == "0.0.0.0"  # reachable by Prometheus
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
        # The servers' passwords and the clients' come from the same variables; each kind
        # of service is its own NATS user.
        assert env["SPECMESH_NATS_USER"] == name
        for node in NATS_NODES:
            nats_password = services[node]["environment"][f"NATS_{name.upper()}_PASSWORD"]
            assert env["SPECMESH_NATS_PASSWORD"] == nats_password
        redis_password = services["valkey"]["environment"]["VALKEY_PASSWORD"]
        assert env["SPECMESH_REDIS_PASSWORD"] == redis_password
    assert "4318:4318" in services["otel-collector"]["ports"]
    for server in (*NATS_NODES, "valkey"):  # only the services reach them, on compose's network
        assert "ports" not in services[server], server
    assert services["valkey"]["profiles"] == ["redis-kv"]


def test_compose_runs_nats_as_a_cluster_of_three() -> None:
    """Each node: deploy/nats.conf, its own name and JetStream volume, routes to every node
    (nats-server drops the one back to itself) on the cluster port it listens on."""
    compose = _compose()
    routes = ",".join(f"nats-route://{node}:6222" for node in NATS_NODES)
    for node in NATS_NODES:
        service = compose["services"][node]
        argv = service["command"]
        assert argv[0] == "nats-server" and "--config=/etc/nats/nats.conf" in argv
        assert f"--name={node}" in argv and "--cluster_name=specmesh" in argv
        assert "--cluster=nats://0.0.0.0:6222" in argv and f"--routes={routes}" in argv
        assert "./deploy/nats.conf:/etc/nats/nats.conf:ro" in service["volumes"]
        assert f"{node}-data:/data" in service["volumes"] and f"{node}-data" in compose["volumes"]
        assert "8222/healthz" in " ".join(service["healthcheck"]["test"])


def test_compose_local_overlay_only_swaps_images() -> None:
    """deploy/compose.local.yml (scripts/compose-local): the images built here for the
    services docker-compose.yml has, an OTLP endpoint of ours as otel-collector, and only
    the services no package provides (Jaeger, Grafana) left out by a profile."""
    from specmesh.services.compose_local.images import INFRA_IMAGES, PROJECT_IMAGE
    from specmesh.services.compose_local.stack import COMPOSE_FILES, ONE_SHOT

    assert COMPOSE_FILES == (ROOT / "docker-compose.yml", DEPLOY / "compose.local.yml")
    services = _compose()["services"]
    overlay = _compose(DEPLOY / "compose.local.yml")["services"]
    assert set(overlay) <= set(services) and set(ONE_SHOT) <= set(services)
    left_out = {name for name, s in overlay.items() if s.get("profiles")}
    assert left_out == {"jaeger", "grafana"}
    assert all(overlay[name] == {"profiles": ["registry-images"]} for name in left_out)
    built = {image.tag for image in INFRA_IMAGES}
    for name in set(overlay) - left_out - {"otel-collector"}:
        assert set(overlay[name]) == {"image"} and overlay[name]["image"] in built, name
    assert built == {overlay[name]["image"] for name in (*NATS_NODES, "valkey", "prometheus")}
    sink = overlay["otel-collector"]
    assert sink["command"][:3] == ["python", "-m", "specmesh.services.compose_local.otlp_sink"]
    assert importlib.util.find_spec(sink["command"][2]) is not None
    assert "4318:4318" in services["otel-collector"]["ports"]
    assert "4318/health" in " ".join(sink["healthcheck"]["test"])
    assert PROJECT_IMAGE.startswith("specmesh-local/")


def test_compose_services_on_the_image_mount_its_volumes() -> None:
    """A container of the project image without a mount at a path the Dockerfile declares a
    VOLUME gets an anonymous volume, which no compose label names: each service on the image
    mounts one there, in docker-compose.yml and under scripts/compose-local's overlay."""
    dockerfile = (DEPLOY / "Dockerfile").read_text().splitlines()
    declared = {
        path for line in dockerfile if line.startswith("VOLUME ") for path in line.split()[1:]
    }
    assert declared == {"/models"}
    for stack in (_compose(), _compose_stack(DEPLOY / "compose.local.yml")):
        on_image = [
            name
            for name, service in stack["services"].items()
            if service.get("image", "").startswith("${SPECMESH_IMAGE")
        ]
        assert {"gateway", "model-init", "learner"} <= set(on_image)
        for name in on_image:
            targets = {
                volume.split(":")[1] for volume in stack["services"][name].get("volumes", [])
            }
            assert declared <= targets, name


class _FakeDocker:
    """The docker and compose commands scripts/compose-local's `down` runs, against state
    kept here: containers (with their mounts), volumes, and images by id with their tags."""

    def __init__(self) -> None:
        from specmesh.services.compose_local.images import IMAGE_LABEL

        self.label = IMAGE_LABEL
        anonymous = "f" * 64
        self.containers = {
            "c-decode": {"Mounts": [{"Type": "volume", "Name": "specmesh_models"}], "Image": "new"},
            "c-otel": {"Mounts": [{"Type": "volume", "Name": anonymous}], "Image": "old"},
        }
        self.volumes = {"specmesh_models", anonymous, "someone-elses"}
        self.labelled = {"specmesh_models"}  # anonymous volumes carry no compose label
        # id -> (tags, ours): "old" the project image a rebuild replaced while "c-otel" ran it
        self.images = {"new": (["specmesh-local/specmesh:cpu"], True), "old": ([], True),
                       "theirs": ([], False)}  # fmt: skip

    def compose_down(self, argv: list[str]) -> str:
        assert argv[-5:] == ["down", "--volumes", "--remove-orphans", "--timeout", "30"]
        self.containers.clear()
        self.volumes -= self.labelled  # like compose: the declared volumes only
        return ""

    def __call__(self, *args: str, capture: bool = False) -> str:
        from specmesh.services.compose_local.docker import DockerError

        match args:
            case ("ps", "-aq", "--filter", _):
                return "\n".join(self.containers)
            case ("volume", "ls", "-q"):
                return "\n".join(self.volumes)
            case ("volume", "rm", name):
                self.volumes.remove(name)
            case ("images", "-q", "--no-trunc", "--filter", "dangling=true", "--filter", label):
                assert label == f"label={self.label}"
                return "\n".join(i for i, (tags, ours) in self.images.items() if ours and not tags)
            case ("rmi", image):
                if any(c["Image"] == image for c in self.containers.values()):
                    raise DockerError(f"{image} is in use")
                del self.images[image]
            case ("images", "--format", _):
                return "\n".join(f"{t} 2GB" for tags, _ in self.images.values() for t in tags)
            case ("volume", "ls", "--format", _, "--filter", _):
                return "\n".join(self.volumes & self.labelled)
            case ("ps" | "network", *_):
                return "\n".join(self.containers) if args[0] == "ps" else ""
            case _:
                raise AssertionError(args)
        return ""


def test_compose_local_down_leaves_only_the_tagged_images(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`scripts/compose-local down` removes what `up` made: the containers, the volumes they
    mounted, anonymous ones included (which `compose down --volumes` may miss and no label
    names), and the project image a rebuild left untagged while a container still ran on it;
    it keeps the tagged images (the build cache) and lists them, and touches nothing else."""
    from specmesh.services.compose_local import images, stack

    fake = _FakeDocker()
    env_file = tmp_path / "compose-local.env"
    env_file.write_text("SPECMESH_IMAGE=specmesh-local/specmesh:cpu\n")
    monkeypatch.setattr(stack, "ENV_FILE", env_file)
    monkeypatch.setattr(stack, "ensure_docker", lambda: None)
    monkeypatch.setattr(stack, "compose_binary", lambda: "docker-compose")
    monkeypatch.setattr(stack, "inspect", lambda *ids: [fake.containers[i] for i in ids])
    monkeypatch.setattr(stack, "run", fake.compose_down)
    monkeypatch.setattr(stack, "docker", fake)
    monkeypatch.setattr(images, "docker", fake)
    assert images.remove_superseded() == ["old"]  # at `up`'s rebuild: "c-otel" still runs it

    stack.down(remove_images=False)
    assert fake.volumes == {"someone-elses"}
    assert fake.images == {"new": (["specmesh-local/specmesh:cpu"], True), "theirs": ([], False)}
    assert not env_file.exists()
    printed = capsys.readouterr().out
    assert "no container, volume, network or untagged image of ours is left" in printed
    assert "  specmesh-local/specmesh:cpu 2GB" in printed


def test_compose_local_labels_every_image_it_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The label is how `down` finds an image of ours that a rebuild left untagged: on each
    image built, not on the base (every layer of a build in progress would inherit it)."""
    from specmesh.services.compose_local import images

    builds: list[tuple[str, ...]] = []

    def docker(*args: str, capture: bool = False) -> str:
        if args[0] == "build":
            builds.append(args)
        return ""

    monkeypatch.setattr(images, "docker", docker)
    monkeypatch.setattr(images, "image_exists", lambda tag: False)
    images.build_project()
    for image in images.INFRA_IMAGES:
        images.build_infra(image)
    assert len(builds) == 1 + len(images.INFRA_IMAGES)
    for argv in builds:
        assert argv[argv.index("--label") + 1] == images.IMAGE_LABEL


def test_compose_and_nomad_size_threads_to_each_services_cpus() -> None:
    """Threads beyond a container's CPU limit are throttled; fewer leave its CPUs idle."""
    services = _compose()["services"]
    groups = _blocks(_blocks(_hcl("specmesh.nomad.hcl")["job"])["specmesh"]["group"])
    for name in ALL_SERVICES:
        env, limits = services[name]["environment"], services[name]["deploy"]["resources"]
        threads, cpus = (
            _default(v) if v.startswith("${") else v
            for v in (env["SPECMESH_THREADS"], limits["limits"]["cpus"])
        )
        assert threads == cpus, name
        (task,) = _blocks(groups[name]["task"]).values()
        reserved = task["resources"][0]["cpu"] // 1000
        assert int(task["env"][0]["SPECMESH_THREADS"]) == reserved, name
    # On a contended host decode's steps keep their share before other containers'.
    assert services["decode"]["cpu_shares"] > max(
        services[name].get("cpu_shares", 1024) for name in SERVICES if name != "decode"
    )


def test_compose_has_no_default_passwords() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    secrets = re.findall(r"\$\{(\w*(?:PASSWORD|SECRET)\w*)([^}]*)\}", text)
    assert {name for name, _ in secrets} == {
        *(f"SPECMESH_NATS_{name.upper()}_PASSWORD" for name in ALL_SERVICES),
        "SPECMESH_KV_DIRECT_SECRET",
        "SPECMESH_REDIS_PASSWORD",
        "GRAFANA_ADMIN_PASSWORD",
    }
    for name, rest in secrets:  # ${NAME:?message}: compose refuses to start without it
        if name == "SPECMESH_REDIS_PASSWORD":  # valkey's (profile redis-kv) refuses instead
            assert rest == ":-", rest
        else:
            assert rest.startswith(":?") and name in rest, (name, rest)
    valkey = _compose()["services"]["valkey"]
    assert valkey["environment"]["VALKEY_PASSWORD"] == "${SPECMESH_REDIS_PASSWORD:-}"
    assert '[ -n "$$VALKEY_PASSWORD" ] || {' in valkey["command"][2]


@pytest.mark.parametrize("overlays", TOPOLOGIES.values(), ids=TOPOLOGIES)
def test_compose_pools_that_hold_the_model_run_one_dtype(overlays: tuple[Path, ...]) -> None:
    """Decode reads the K/V prefill computed (and refuses another dtype's): every pool
    that holds the model names the same dtype, bfloat16 on GPUs, and prefill runs on
    decode's image and device."""
    services = _compose_stack(*overlays)["services"]
    (dtype,) = {services[name]["environment"]["SPECMESH_DTYPE"] for name in MODEL_POOLS}
    assert _default(dtype) == ("bfloat16" if overlays else "float32")
    prefill, decode = services["prefill"], services["decode"]
    assert (prefill["image"], prefill["build"]) == (decode["image"], decode["build"])
    assert prefill["environment"].get("SPECMESH_DEVICE") == decode["environment"].get(
        "SPECMESH_DEVICE"
    )


@pytest.mark.parametrize("model_drafter", [False, True], ids=["ngram", "model-drafter"])
def test_compose_gpu_pools_reserve_their_own_gpus(model_drafter: bool) -> None:
    """compose.gpu.yml: prefill and decode each reserve a GPU of their own; drafters only
    with compose.gpu-drafter.yml (model drafters), so NGRAM, the default, reserves none."""
    overlays = TOPOLOGIES["gpu-model-drafter" if model_drafter else "gpu"]
    services = _compose_stack(*overlays)["services"]
    assert _default(services["drafter"]["environment"]["SPECMESH_SPECULATIVE_ALGORITHM"]) == "NGRAM"
    on_gpu = (*GPU_POOLS, "drafter") if model_drafter else GPU_POOLS
    reserved = []
    for name in MODEL_POOLS:
        service = services[name]
        assert "cu1" in service["build"]["args"]["TORCH_INDEX_URL"]  # a CUDA torch build
        assert service["environment"]["SPECMESH_DEVICE"] == ("cuda" if name in on_gpu else "cpu")
        gpus = _reserved_gpus(service)
        assert len(gpus) == (name in on_gpu), name
        reserved += gpus
    assert len(set(reserved)) == len(reserved)  # no two pools on one GPU


def test_prometheus_scrapes_every_service_where_it_serves() -> None:
    env = _compose()["services"]["decode"]["environment"]
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == set(ALL_SERVICES)  # every service, the learner too
    for name, job in jobs.items():
        (sd,) = job["dns_sd_configs"]
        assert sd["names"] == [name]  # compose's DNS answers with every replica
        assert sd["port"] == (8000 if name == "gateway" else int(env["SPECMESH_METRICS_PORT"]))


def test_grafana_provisions_the_dashboard_and_its_datasources() -> None:
    grafana = _compose()["services"]["grafana"]
    provisioning = DEPLOY / "grafana" / "provisioning"
    datasources = yaml.safe_load((provisioning / "datasources" / "specmesh.yaml").read_text())
    by_type = {d["type"]: d for d in datasources["datasources"]}
    assert by_type["prometheus"]["url"] == "http://prometheus:9090"
    assert by_type["jaeger"]["url"] == "http://jaeger:16686"
    providers = yaml.safe_load((provisioning / "dashboards" / "specmesh.yaml").read_text())
    path = providers["providers"][0]["options"]["path"]
    assert f"./deploy/grafana/dashboards:{path}:ro" in grafana["volumes"]
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in grafana["volumes"]
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "specmesh.json").read_text())
    targets = [t for p in dashboard["panels"] for t in p.get("targets", [])]
    assert targets and {t["datasource"]["uid"] for t in targets} == {by_type["prometheus"]["uid"]}


def test_dashboard_covers_what_operators_watch() -> None:
    metrics = _dashboard_metrics()
    wanted = {
        "specmesh_requests_total",  # request rate
        "sglang:time_to_first_token_seconds_bucket",  # TTFT percentiles
        "sglang:inter_token_latency_seconds_bucket",  # ITL percentiles
        "specmesh_spec_accepted_tokens_total",  # acceptance length per algorithm
        "specmesh_spec_verify_steps_total",
        "specmesh_draft_seconds_sum",  # draft vs verify time
        "specmesh_verify_seconds_sum",
        "specmesh_kv_blocks_used",  # KV blocks in use
        "specmesh_queue_length",  # queue lengths
        "specmesh_active_requests",  # per-instance load
        "specmesh_routed_requests_total",
    }
    assert wanted <= metrics, wanted - metrics


def test_collector_sends_traces_to_jaeger() -> None:
    services = _compose()["services"]
    config = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    assert config["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    host, port = config["exporters"]["otlp"]["endpoint"].split(":")
    assert host in services and port == "4317"  # Jaeger takes OTLP gRPC
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and pipeline["exporters"] == ["otlp"]
    assert "/etc/otelcol/config.yaml" in services["otel-collector"]["command"][0]


# Nomad


def test_nomad_job_has_a_group_per_service() -> None:
    spec = _hcl("specmesh.nomad.hcl")
    variables = _blocks(spec["variable"])
    assert "default" not in variables["nats_url"]  # passed in
    assert variables["kv_transport"]["default"] == "direct"  # redis: redis_url passed in too
    known = _option_variables()
    groups = _blocks(_blocks(spec["job"])["specmesh"]["group"])
    assert set(groups) == set(ALL_SERVICES)
    for name, group in groups.items():
        assert group["count"] == f"${{var.{name}_count}}" and f"{name}_count" in variables
        assert group["restart"][0]["attempts"] > 0
        (service,) = group["service"]
        assert service["provider"] == "nomad" and "metrics" in service["tags"]
        (check,) = service["check"]
        assert check["type"] == "http" and check["path"] == "/health"
        port = _blocks(group["network"][0]["port"])[service["port"]]
        (task,) = _blocks(group["task"]).values()
        assert task["driver"] == "docker"
        config = task["config"][0]
        assert _runs_module([config["command"], *config["args"]]) == f"specmesh.services.{name}"
        assert service["port"] in config["ports"]
        env = task["env"][0]
        unknown = {k for k in env if k.startswith("SPECMESH_")} - known
        assert not unknown, f"{name} sets variables no service reads: {unknown}"
        assert env["SPECMESH_NATS_URL"] == "${var.nats_url}"
        served_on = env["SPECMESH_PORT"] if name == "gateway" else env["SPECMESH_METRICS_PORT"]
        if config.get("network_mode") == "host":  # no mapping: it serves on the port given
            assert served_on == f"${{NOMAD_PORT_{service['port']}}}" and "to" not in port
        else:
            assert port["to"] == int(served_on)
        # Secrets are files rendered from Nomad Variables into the task's secrets/ directory.
        rendered = {t["destination"] for t in task["template"]}
        for key, value in env.items():
            if key.endswith(("_PASSWORD_FILE", "_SECRET_FILE")):
                assert value.replace("${NOMAD_SECRETS_DIR}", "secrets") in rendered, key
        assert "SPECMESH_NATS_PASSWORD_FILE" in env
        if name in ("prefill", "decode"):  # the two ends of the KV transport
            assert env["SPECMESH_KV_TRANSPORT"] == "${var.kv_transport}"
            assert "SPECMESH_KV_DIRECT_SECRET_FILE" in env
            assert env["SPECMESH_REDIS_URL"] == "${var.redis_url}"
            assert "SPECMESH_REDIS_PASSWORD_FILE" in env
        resources = task["resources"][0]
        assert resources["cpu"] > 0 and resources["memory"] > 0
        devices = _blocks(resources.get("device", []))
        if name in GPU_POOLS:
            assert devices["nvidia/gpu"]["count"] == 1
            assert env["SPECMESH_DEVICE"] == "cuda"
        else:
            assert not devices


def test_nomad_prefill_serves_direct_kv_where_other_hosts_reach_it() -> None:
    """--kv-transport direct: prefill binds the address it names to decode, so it runs on
    the host's network, at the host's address, on a port Nomad declares for it."""
    groups = _blocks(_blocks(_hcl("specmesh.nomad.hcl")["job"])["specmesh"]["group"])
    prefill = groups["prefill"]
    (task,) = _blocks(prefill["task"]).values()
    assert task["config"][0]["network_mode"] == "host"
    assert "kv" in _blocks(prefill["network"][0]["port"]) and "kv" in task["config"][0]["ports"]
    env = task["env"][0]
    assert env["SPECMESH_KV_DIRECT_HOST"] == "${NOMAD_IP_kv}"
    assert env["SPECMESH_KV_DIRECT_PORT"] == "${NOMAD_PORT_kv}"


def _if(value: str, condition: str, holds: bool) -> str:
    """`${<condition> ? a : b}` in a Nomad job: a where the condition holds, else b."""
    match = re.fullmatch(rf"\$\{{{re.escape(condition)} \? (.+) : (.+)\}}", value)
    assert match, value
    return match[1] if holds else match[2]


def test_nomad_pools_run_one_dtype_and_ngram_drafters_reserve_no_gpu() -> None:
    spec = _hcl("specmesh.nomad.hcl")
    assert _blocks(spec["variable"])["dtype"]["default"] == "bfloat16"
    groups = _blocks(_blocks(spec["job"])["specmesh"]["group"])
    tasks = {name: next(iter(_blocks(groups[name]["task"]).values())) for name in MODEL_POOLS}
    for task in tasks.values():  # one image and one dtype for all (decode reads prefill's K/V)
        assert task["env"][0]["SPECMESH_DTYPE"] == "${var.dtype}"
        assert task["config"][0]["image"] == "${var.gpu_image}"
    # The drafter's GPU follows the algorithm: a model drafter's, none for NGRAM.
    (local,) = spec["locals"]
    assert local["drafter_gpu"] == '${var.speculative_algorithm != "NGRAM"}'
    drafter = tasks["drafter"]
    (dynamic,) = drafter["resources"][0]["dynamic"]
    device = dynamic["device"]
    assert device["labels"] == ["${device.value}"] and device["content"] == [{"count": 1}]
    for algorithm in ("NGRAM", "EAGLE3"):
        gpu = algorithm != "NGRAM"
        gpus = _if(device["for_each"], "local.drafter_gpu", gpu)
        assert gpus == ('["nvidia/gpu"]' if gpu else "[]")
        on = _if(drafter["env"][0]["SPECMESH_DEVICE"], "local.drafter_gpu", gpu)
        assert on == ('"cuda"' if gpu else '"cpu"')


def test_nomad_learner_follows_online_learning_and_keeps_its_versions() -> None:
    """As compose's `learning` profile: off unless asked for (count 0), the drafters told
    to send what they serve by the same variable, the learner niced and its versions on a
    host volume that outlives the allocation."""
    spec = _hcl("specmesh.nomad.hcl")
    variables = _blocks(spec["variable"])
    assert variables["learner_count"]["default"] == 0
    assert variables["speculative_online_learning"]["default"] is False
    groups = _blocks(_blocks(spec["job"])["specmesh"]["group"])
    drafter, learner = (
        next(iter(_blocks(groups[n]["task"]).values())) for n in ("drafter", "learner")
    )
    online = "${var.speculative_online_learning}"
    assert drafter["env"][0]["SPECMESH_SPECULATIVE_ONLINE_LEARNING"] == online
    env = learner["env"][0]
    assert env["SPECMESH_NATS_USER"] == "learner" and int(env["SPECMESH_NICE"]) > 0
    for key in ("SPECMESH_SPECULATIVE_ALGORITHM", "SPECMESH_SPECULATIVE_DRAFT_MODEL_PATH"):
        assert env[key] == drafter["env"][0][key]  # it trains the head the drafters serve
    volumes = _blocks(groups["learner"]["volume"])
    mounts = {m["destination"]: m["volume"] for m in learner["volume_mount"]}
    versions = volumes[mounts[env["SPECMESH_SPECULATIVE_ONLINE_DIR"]]]
    assert versions["type"] == "host" and not versions["read_only"]
    assert "nats_learner_password" in learner["template"][0]["data"]


def test_nomad_infrastructure_job() -> None:
    spec = _hcl("specmesh-infra.nomad.hcl")
    groups = _blocks(_blocks(spec["job"])["specmesh-infra"]["group"])
    assert {"nats", "valkey", "otel-collector"} <= set(groups)
    for name, group in groups.items():
        assert group["count"] == (3 if name == "nats" else 1) and group["restart"], name
        checks = [c for s in group["service"] for c in s.get("check", [])]
        assert checks, f"{name} has no health check"
        ports = _blocks(group["network"][0]["port"])
        for check in checks:
            assert check.get("port", group["service"][0]["port"]) in ports
        (task,) = _blocks(group["task"]).values()
        assert task["resources"][0]["cpu"] > 0 and task["resources"][0]["memory"] > 0
    ports = _blocks(groups["nats"]["network"][0]["port"])
    assert ports["client"]["static"] == 4222 and ports["monitor"]["static"] == 8222
    (nats,) = _blocks(groups["nats"]["task"]).values()
    config = nats["template"][0]["data"]
    assert "max_payload: 8MB" in config and "jetstream" in config and "password" in config
    # A cluster of three on distinct clients, routed through the registry's cluster service.
    assert ports["cluster"]["static"] == 6222 and "cluster" in nats["config"][0]["ports"]
    assert groups["nats"]["constraint"][0]["operator"] == "distinct_hosts"
    (cluster,) = [s for s in groups["nats"]["service"] if s["port"] == "cluster"]
    config = config.replace('\\"', '"')  # python-hcl2 escapes them
    assert f'range nomadService "{cluster["name"]}"' in config and "listen: 0.0.0.0:6222" in config
    assert 'server_name: nats-{{ env "NOMAD_ALLOC_INDEX" }}' in config  # JetStream needs names
    (valkey,) = _blocks(groups["valkey"]["task"]).values()
    assert "requirepass" in valkey["template"][0]["data"]


# NATS and valkey as configured for deployment, with authentication


NATS_PASSWORD = "nats-secret"
REDIS_PASSWORD = "redis-secret"


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    """nats-server with deploy/nats.conf (password auth, JetStream, monitoring) on free
    loopback ports: (client URL, monitoring port)."""
    tmp = tmp_path_factory.mktemp("nats")
    deployed = (DEPLOY / "nats.conf").read_text()
    assert "store_dir: /data" in deployed  # the container's volume; a temp dir here
    (tmp / "nats.conf").write_text(deployed.replace("store_dir: /data", f"store_dir: {tmp}"))
    port, monitor = free_port(), free_port()
    binary = Path(sysconfig.get_path("scripts")) / "nats-server"
    argv = [str(binary), "-c", str(tmp / "nats.conf"), "-a", "127.0.0.1"]
    argv += ["-p", str(port), "-m", str(monitor)]
    passwords = {f"NATS_{user.upper()}_PASSWORD": pw for user, pw in SERVICE_PASSWORDS.items()}
    env = {**os.environ, **passwords}
    with open(tmp / "nats.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, (tmp / "nats.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{monitor}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "nats-server did not come up"
            time.sleep(0.05)
        yield f"nats://127.0.0.1:{port}", monitor
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def secured_valkey() -> Iterator[ServerProcess]:
    with start_valkey() as server:
        redis.Redis.from_url(server.url).config_set("requirepass", REDIS_PASSWORD)
        yield server


@pytest.fixture(scope="module")
def secret_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Password files as mounted secrets look: one line, a trailing newline."""
    tmp = tmp_path_factory.mktemp("secrets")
    files = {"nats": tmp / "nats_password", "redis": tmp / "redis_password"}
    files["nats"].write_text(NATS_PASSWORD + "\n")
    files["redis"].write_text(REDIS_PASSWORD + "\n")
    return files


def test_nats_config_serves_jetstream_monitoring_and_auth(secured_nats: tuple[str, int]) -> None:
    url, monitor = secured_nats
    varz = httpx.get(f"http://127.0.0.1:{monitor}/varz").json()
    assert varz["max_payload"] == 8 * 1024 * 1024
    assert httpx.get(f"http://127.0.0.1:{monitor}/jsz").status_code == 200

    async def connect(auth: NatsAuth) -> None:
        bus = await Bus.connect(url, "test", auth)
        await bus.close()

    asyncio.run(connect(NatsAuth(nats_user="gateway", nats_password=SERVICE_PASSWORDS["gateway"])))
    with pytest.raises(ConnectionError):
        asyncio.run(connect(NatsAuth(nats_user="gateway", nats_password="wrong")))


def test_deployed_nats_gives_each_service_only_its_subjects(
    secured_nats: tuple[str, int],
) -> None:
    """deploy/nats.conf and the Nomad job's copy list the permissions shared/protocol.py
    defines (what `specmesh up` gives its own server), and nats-server enforces them."""
    infra = _blocks(_blocks(_hcl("specmesh-infra.nomad.hcl")["job"])["specmesh-infra"]["group"])
    (nats_task,) = _blocks(infra["nats"]["task"]).values()
    nomad = nats_task["template"][0]["data"].replace('\\"', '"')  # python-hcl2 escapes them
    for config in ((DEPLOY / "nats.conf").read_text(), nomad):
        entries = re.findall(r"\{user: (\w+), password: .*,\s*permissions: (\{.*\})\}", config)
        expected = nats_users(dict.fromkeys(ALL_SERVICES, ""))
        assert {u: json.loads(p) for u, p in entries} == {
            e["user"]: e["permissions"] for e in expected
        }
    assert_least_privilege(secured_nats[0])


def test_a_wrong_nats_password_fails_at_start(secured_nats: tuple[str, int]) -> None:
    argv = [sys.executable, "-m", "specmesh.services.drafter", "--speculative-algorithm", "NGRAM"]
    argv += ["--nats-url", secured_nats[0], "--nats-user", "drafter"]
    env = {**os.environ, "SPECMESH_NATS_PASSWORD": "wrong"}
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Authorization Violation" in result.stderr


def test_redis_password_and_tls_options(secured_valkey: ServerProcess) -> None:
    url = secured_valkey.url
    good = TransportConfig(kv_transport="redis", redis_url=url, redis_password=REDIS_PASSWORD)
    transport = good.open()
    transport.put_many({"k": b"v"}, ttl_s=5)
    assert transport.get_many(["k"]) == [b"v"]
    transport.close()
    with pytest.raises(ConnectionError, match="unreachable"):
        TransportConfig(kv_transport="redis", redis_url=url).open()
    with pytest.raises(ValueError, match="rediss://"):
        TransportConfig(kv_transport="redis", redis_url=url, redis_tls_ca="ca.pem").open()


def test_secrets_come_from_flags_environment_or_files(
    secret_files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    def parsed(argv: list[str]) -> tuple[ServiceConfig, TransportConfig]:
        configs: list[Any] = []

        class Capture:  # stands in for a service class: records its configs, runs nothing
            kind = "capture"
            computes = False

            def __init__(self, *cfgs: Any) -> None:
                configs.extend(cfgs)

            def serve(self) -> None:
                pass

        service_main(Capture, [TransportConfig], argv)
        return configs[0], configs[1]

    cfg, tcfg = parsed(["--nats-password-file", str(secret_files["nats"])])
    assert cfg.nats_password == NATS_PASSWORD  # the file's trailing newline is not part of it
    monkeypatch.setenv("SPECMESH_REDIS_PASSWORD_FILE", str(secret_files["redis"]))
    cfg, tcfg = parsed(["--nats-password", "given"])
    assert cfg.nats_password == "given" and tcfg.redis_password == REDIS_PASSWORD
    monkeypatch.setenv("SPECMESH_REDIS_PASSWORD", "from-env")  # a value beats a file
    assert parsed([])[1].redis_password == "from-env"
    with pytest.raises(SystemExit) as exit_info:
        parsed(["--nats-token-file", str(secret_files["nats"].parent / "missing")])
    assert exit_info.value.code == 2


# The services as deployed: authenticated NATS and valkey, every dashboard metric served


@pytest.fixture(scope="module")
def deployment(
    smollm_dir: Path,
    secured_valkey: ServerProcess,
    secret_files: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Path]]:
    """`specmesh up` with NGRAM against a password-protected valkey, its password from a
    file: (HTTP URL, launcher output)."""
    log = tmp_path_factory.mktemp("up") / "up.log"
    args = ["--kv-transport", "redis", "--redis-url", secured_valkey.url]
    args += ["--redis-password-file", str(secret_files["redis"]), "--kv-namespace", "deploy-test"]
    args += ["--speculative-algorithm", "NGRAM"]
    with specmesh_up(smollm_dir, *args, log=log) as url:
        yield url, log


def test_every_dashboard_metric_is_served(deployment: tuple[str, Path]) -> None:
    url, log = deployment
    prompt = "Repeat exactly: red green blue, red green blue, red green blue, red green blue."
    response = chat(url, prompt, temperature=0, max_tokens=48)
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == response.json()["id"]
    # `specmesh up` lists each process with its /metrics URL (its own too, for restarts);
    # the gateway serves its own.
    listed = re.findall(r"^\s+(\S+)\s+pid \d+\s+(http://\S+/metrics)$", log.read_text(), re.M)
    launcher = dict(listed).pop("specmesh-up")
    assert "specmesh_service_restarts_total" in httpx.get(launcher, timeout=10).text
    listed = [(instance, u) for instance, u in listed if instance != "specmesh-up"]
    assert {instance.split("-")[0] for instance, _ in listed} == set(SERVICES) - {"gateway"}
    for _, metrics_url in listed:
        health = httpx.get(metrics_url.removesuffix("/metrics") + "/health", timeout=10)
        assert health.status_code == 200 and health.text == "ok\n"
    urls = [f"{url}/metrics", *(u for _, u in listed)]
    wanted = _dashboard_metrics()
    deadline = time.monotonic() + 15  # gauges are set with each heartbeat (every second)
    while True:
        served = {name for u in urls for name, _ in scrape(u)}
        missing = wanted - served
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, f"the dashboard queries metrics no service serves: {sorted(missing)}"


# K/V of another dtype: what the GPU topology did before every pool named one


def test_decode_refuses_kv_of_another_dtype(smollm_dir: Path, tmp_path: Path) -> None:
    """Prefill in float32, decode in bfloat16 (a tiny random model with SmolLM2's
    tokenizer): decode refuses each request with an error naming both sides, logged once,
    instead of missing every block and recomputing the prompt in silence; the gateway
    answers with OpenAI's error JSON."""
    model = Path(tiny_llama(tmp_path / "tiny", vocab=49152, seed=3))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, model / name)
    log = tmp_path / "up.log"
    common = ["--model", str(model), "--kv-cache-gb", "0.25", "--kv-namespace", "dtype-test"]
    with start_nats() as nats:
        argv = [sys.executable, "-m", "specmesh.services.prefill", "--nats-url", nats.url, *common]
        prefill = subprocess.Popen([*argv, "--dtype", "float32"])
        try:
            args = ["--nats-url", nats.url, "--prefills", "0", "--dtype", "bfloat16", *common[2:]]
            with specmesh_up(model, *args, log=log) as url:
                while not any(i.startswith("prefill") for i in heartbeats(nats.url, 1.0)):
                    assert prefill.poll() is None
                responses = [chat(url, "Hello", max_tokens=4) for _ in range(2)]
        finally:
            prefill.terminate()
            prefill.wait(30)
    for response in responses:
        assert response.status_code == 500, response.text
        error = response.json()["error"]
        assert error["type"] == "server_error"
        assert re.fullmatch(
            r"prefill's K/V is for tiny \(LlamaForCausalLM, 1 layers\), float32, KV float32, "
            r"block size 16 \[\w+\], this decode worker's for tiny \(LlamaForCausalLM, 1 layers\), "
            r"bfloat16, KV bfloat16, block size 16 \[\w+\]: run prefill and decode with the same "
            r"model, --dtype, --kv-cache-dtype and --block-size",
            error["message"],
        ), error["message"]
    assert log.read_text().count("refusing requests prefilled elsewhere") == 1


def test_otlp_sink_keeps_spans_with_their_service_instance_and_request() -> None:
    """compose.local.yml's otel-collector: what a service exports, decoded as it serves it."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from specmesh.services.compose_local.otlp_sink import REQUEST_ID, decode_spans

    def attribute(key: str, value: str) -> KeyValue:
        return KeyValue(key=key, value=AnyValue(string_value=value))

    request = ExportTraceServiceRequest()
    exported = request.resource_spans.add()
    exported.resource.attributes.extend(
        [attribute("service.name", "specmesh-gateway"), attribute("service.instance.id", "g-1")]
    )
    span = exported.scope_spans.add().spans.add()
    span.name, span.trace_id, span.span_id = "chat", bytes(range(16)), bytes(range(8))
    span.attributes.append(attribute(REQUEST_ID, "chatcmpl-1"))
    assert decode_spans(request.SerializeToString()) == [
        {
            "service": "specmesh-gateway",
            "instance": "g-1",
            "name": "chat",
            "trace_id": bytes(range(16)).hex(),
            "span_id": bytes(range(8)).hex(),
            "parent_span_id": "",
            "request_id": "chatcmpl-1",
        }
    ]
