"""`specmesh bench speculative`: the sweep measures every shape and checks its output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import tiny_llama
from specmesh.services.draft_sweep import DraftSweepConfig, sweep


def test_the_sweep_measures_every_shape_against_plain_decoding(
    tmp_path: Path, smollm_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = Path(tiny_llama(tmp_path / "target", vocab=49152, seed=0, hidden=64, layers=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, target / name)
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps({"copy": ["Repeat: one two three one two three"], "chat": ["Hi"]})
    )
    cfg = DraftSweepConfig(
        model=str(target),
        algorithms="NGRAM",
        num_draft_tokens="2,4",
        workloads=f"mixed={prompts}",
        max_tokens=12,
        output=str(tmp_path / "results.json"),
    )
    results = sweep(cfg)
    assert [(r.workload, r.algorithm, r.shape) for r in results] == [
        ("mixed", "none", None),
        ("mixed", "NGRAM", (1, 1, 2)),
        ("mixed", "NGRAM", (3, 1, 4)),
    ]
    assert all(r.tokens_per_s > 0 and r.acceptance_length >= 1 for r in results)
    assert "mixed: fastest NGRAM" in capsys.readouterr().out
    assert len(json.loads((tmp_path / "results.json").read_text())) == 3


def test_shapes_follow_each_algorithm_and_bad_options_fail_clearly(tmp_path: Path) -> None:
    cfg = DraftSweepConfig(num_steps="2,3", topk="1,2", num_draft_tokens="4,8")
    assert cfg.grid("DFLASH") == [(3, 1, 4), (7, 1, 8)]  # chain only: blocks
    # a tree keeps its best 3 drafts, or all it grew
    trees = [(2, 1, 3), (2, 2, 4), (2, 2, 5), (3, 1, 4), (3, 2, 4), (3, 2, 7)]
    assert cfg.grid("EAGLE3") == cfg.grid("NEXTN") == trees
    with pytest.raises(ValueError, match="comma-separated integers"):
        DraftSweepConfig(num_steps="two").grid("EAGLE3")
    with pytest.raises(ValueError, match="--workloads chat"):
        DraftSweepConfig(workloads=f"chat={tmp_path / 'missing.json'}").prompt_sets()
    with pytest.raises(ValueError, match="one algorithm"):
        sweep(DraftSweepConfig(algorithms="NGRAM,EAGLE3", speculative_draft_model_path="x"))
