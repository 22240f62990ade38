"""Which drafter a speculative config names, and which target features it reads.

Above the drafters, so that the interface module (`drafter.py`) imports none of them.
"""

from __future__ import annotations

from pathlib import Path

from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.dflash import DFlashDrafter, read_dflash_spec
from specmesh.shared.speculative.drafter import Drafter
from specmesh.shared.speculative.eagle import EagleDrafter, read_head_spec
from specmesh.shared.speculative.ngram import NgramDrafter
from specmesh.shared.speculative.standalone import DraftModelDrafter


def drafter_target_features(cfg: SpeculativeConfig, model_dir: str) -> tuple[tuple[int, ...], bool]:
    """The target layers the drafter of `cfg` (resolved) reads from the target in
    `model_dir`; checks that an EAGLE head or DFLASH draft fits that target (ValueError
    otherwise) from the configs and tensor names alone, without loading any weights."""
    algo = cfg.speculative_algorithm
    if algo not in ("EAGLE", "EAGLE3", "NEXTN", "DFLASH"):
        return (), False
    target = ModelConfig.from_file(Path(model_dir) / "config.json")
    path = Path(cfg.speculative_draft_model_path or "")
    if algo == "DFLASH":
        return read_dflash_spec(path, target).target_layers, False
    return read_head_spec(path, algo, target).target_features


def make_drafter(cfg: SpeculativeConfig, target: LlamaForCausalLM | None) -> Drafter:
    """The drafter `cfg` names; model drafters need the target (NGRAM does not)."""
    algo = cfg.speculative_algorithm
    if algo == "NGRAM":
        return NgramDrafter(cfg)
    assert target is not None
    if algo == "STANDALONE":
        return DraftModelDrafter(cfg, target)
    if algo == "DFLASH":
        return DFlashDrafter(cfg, target)
    return EagleDrafter(cfg, target)
