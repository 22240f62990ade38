"""STANDALONE's student: the target restricted to some layers and residual coordinates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from specmesh.shared.model.loader import load_model, save_model
from specmesh.shared.training.student_trainer import causal_hidden, new_student, spaced_layers

from tests.helpers import tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tiny_llama(tmp_path_factory.mktemp("t") / "target", 512, seed=4, layers=6))


def test_spaced_layers_keep_the_first_and_the_last() -> None:
    assert spaced_layers(30, 4) == [0, 10, 19, 29]
    assert spaced_layers(6, 1) == [0] and spaced_layers(6, 6) == list(range(6))


def test_the_full_student_is_the_target(target_dir: Path) -> None:
    """Every layer at the full width: the same logits as transformers' target, padded rows
    included (causal attention keeps the padding after a row's end out of it)."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = load_model(target_dir, CPU, torch.float32)
    student = new_student(target, target.config.hidden_size, target.config.num_layers)
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    ids[1, 7:] = 0  # the second row is 7 tokens long
    with torch.no_grad():
        ours = student.compute_logits(causal_hidden(student, ids))
        expected = theirs(ids).logits
        short = theirs(ids[1:, :7]).logits
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[1, :7], short[0], atol=1e-4, rtol=1e-4)


def test_a_narrow_student_saves_in_the_llama_layout(target_dir: Path, tmp_path: Path) -> None:
    """Half the width, two layers: saved in bf16, it loads in our runtime and transformers
    and computes what the student computes."""
    from transformers import AutoModelForCausalLM

    target = load_model(target_dir, CPU, torch.float32)
    student = new_student(target, 16, 2)
    with torch.no_grad():
        for p in student.parameters():
            p.copy_(p.bfloat16().float())  # what bf16 keeps, so the comparison is exact
    save_model(student, tmp_path / "draft", json.loads((target_dir / "config.json").read_text()))
    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["head_dim"]) == (16, 2, 8)
    loaded = load_model(tmp_path / "draft", CPU, torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "draft", dtype=torch.float32)
    ids = torch.arange(1, 11)[None]
    with torch.no_grad():
        want = student.compute_logits(causal_hidden(student, ids))
        torch.testing.assert_close(loaded.compute_logits(causal_hidden(loaded, ids)), want)
        torch.testing.assert_close(theirs(ids).logits, want, atol=1e-4, rtol=1e-4)


def test_a_student_wider_than_its_target_is_refused(target_dir: Path) -> None:
    target = load_model(target_dir, CPU, torch.float32)
    with pytest.raises(ValueError, match="residual coordinates"):
        new_student(target, 64, 2)
    with pytest.raises(ValueError, match="layers"):
        new_student(target, 16, 7)
