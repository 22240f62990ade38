"""`--model org/name`: a Hugging Face repo id, found in a hub cache laid out as
huggingface_hub lays it out (built here from the default model's files), placed and kept
offline by the hub's own variables. No test reaches the network (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from huggingface_hub import constants
from specmesh.shared.config import model_name_of
from specmesh.shared.model.fetch import ModelFetchError, resolve_model
from tokenizers import Tokenizer

pytestmark = pytest.mark.unit

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "12fd25f77366fa6b3b4b768ec3050bf629380bac"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json")
FILES += ("tokenizer_config.json",)


@pytest.fixture
def hf_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """Set HF_* variables as a user would: huggingface_hub reads them when imported, so its
    constants are read again (and again once the variables are restored)."""

    def set_env(**variables: str) -> None:
        for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
            monkeypatch.delenv(name, raising=False)
        for name, value in {"HF_HUB_OFFLINE": "1", **variables}.items():
            monkeypatch.setenv(name, value)
        importlib.reload(constants)

    yield set_env
    monkeypatch.undo()
    importlib.reload(constants)


def _hub_cache(hub: Path, model_dir: Path) -> Path:
    """`hub` holding REPO_ID at COMMIT: content in blobs/, named by symlinks in
    snapshots/<commit>/, refs/main naming the commit. Returns the snapshot directory."""
    repo = hub / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, name in enumerate(FILES):
        blob = repo / "blobs" / f"{i:064x}"  # the hub names blobs by content hash
        blob.symlink_to(model_dir / name)  # the default model's file, not a 500 MB copy
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


def test_a_repo_id_is_served_from_the_hub_cache_under_hf_home(
    tmp_path: Path, smollm_dir: Path, hf_env: Callable[..., None]
) -> None:
    snapshot = _hub_cache(tmp_path / "hf" / "hub", smollm_dir)
    hf_env(HF_HOME=str(tmp_path / "hf"))
    model_dir = resolve_model(REPO_ID)
    assert model_dir == snapshot
    assert Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("Paris").ids
    assert model_name_of(str(model_dir)) == model_name_of(REPO_ID) == "SmolLM2-135M-Instruct"


def test_hf_hub_cache_places_the_cache(
    tmp_path: Path, smollm_dir: Path, hf_env: Callable[..., None]
) -> None:
    snapshot = _hub_cache(tmp_path / "elsewhere", smollm_dir)
    hf_env(HF_HOME=str(tmp_path / "hf"), HF_HUB_CACHE=str(tmp_path / "elsewhere"))
    assert resolve_model(REPO_ID) == snapshot


def test_a_repo_missing_from_the_cache_says_where_it_looked(
    tmp_path: Path, hf_env: Callable[..., None]
) -> None:
    hf_env(HF_HUB_CACHE=str(tmp_path / "empty"))
    with pytest.raises(ModelFetchError) as failed:
        resolve_model("nobody/no-such-model")
    message = str(failed.value)
    assert f"not in the hub cache at {tmp_path / 'empty'}" in message
    assert "HF_HUB_OFFLINE" in message and "hf download nobody/no-such-model" in message


def test_local_paths_are_not_repo_ids(
    tmp_path: Path, hf_env: Callable[..., None], monkeypatch: pytest.MonkeyPatch
) -> None:
    hf_env(HF_HUB_CACHE=str(tmp_path / "empty"))
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/name") == Path("org/name")  # a directory wins over a repo id
    assert resolve_model("./missing/dir") == Path("./missing/dir")  # no repo id: left as is
