"""DFLASH: z-lab's checkpoint layout, the block forward against an independent reading of
z-lab's model, lossless drafting in the engine, and the errors before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import GREEDY, PROMPTS
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.dflash import load_dflash
from specmesh.shared.speculative.drafter import DraftRequest
from specmesh.shared.speculative.factory import drafter_target_features
from specmesh.shared.tokenizer import Tokenizer
from test_speculative import spec_engine, write_eagle_head

BLOCK = 8


def write_dflash_draft(
    path: Path, layers: int = 2, block: int = BLOCK, seed: int = 0, target_layers: int = 30
) -> Path:
    """A DFlash draft for SmolLM2-135M in z-lab's published layout, random weights."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    hidden, heads, kv_heads, head_dim, ffn = 576, 9, 3, 64, 512
    ids = [1, 27] if layers == 2 else list(range(1, 1 + layers))
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": block,
        "dflash_config": {"mask_token_id": 0, "target_layer_ids": ids},
        "num_target_layers": target_layers,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention"] * layers,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "torch_dtype": "bfloat16",
    }
    shapes = {
        "self_attn.q_proj.weight": (heads * head_dim, hidden),
        "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "self_attn.o_proj.weight": (hidden, heads * head_dim),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    w = {"fc.weight": torch.randn(hidden, len(ids) * hidden) * 0.02}
    for norm in ("hidden_norm.weight", "norm.weight"):
        w[norm] = 1 + 0.1 * torch.randn(hidden)
    for i in range(layers):
        w |= {f"layers.{i}.{n}": torch.randn(s) * 0.05 for n, s in shapes.items()}
        for norm, size in (
            ("input_layernorm", hidden),
            ("post_attention_layernorm", hidden),
            ("self_attn.q_norm", head_dim),
            ("self_attn.k_norm", head_dim),
        ):
            w[f"layers.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(size)
    save_file({k: v.to(torch.bfloat16) for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def reference_block(path: Path, ctx: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """z-lab's DFlashDraftModel.forward as published (transformers' Qwen3 pieces): target
    features `ctx` [C, K*H] at positions 0..C-1 and block embeddings [N, H] after them,
    K/V from [context; block], no mask -> normed hidden states [N, H]."""
    from safetensors.torch import load_file
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import (
        Qwen3RMSNorm,
        Qwen3RotaryEmbedding,
        rotate_half,
    )

    raw = json.loads((path / "config.json").read_text())
    cfg = Qwen3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    w = {k: v.float() for k, v in load_file(path / "model.safetensors").items()}
    eps, d = cfg.rms_norm_eps, cfg.head_dim

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        n = Qwen3RMSNorm(x.shape[-1], eps)
        n.weight.data = w[name]
        return n(x)

    c, n = len(ctx), len(block)
    positions = torch.arange(c + n)[None]  # context, then block
    cos, sin = Qwen3RotaryEmbedding(cfg)(block[None], positions)
    target = norm(ctx @ w["fc.weight"].T, "hidden_norm.weight")
    x = block
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        h = norm(x, p + "input_layernorm.weight")
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, -1, d)
        kv_in = torch.cat([target, h])
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(c + n, -1, d)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(c + n, -1, d)
        q = norm(q, p + "self_attn.q_norm.weight").transpose(0, 1)
        k = norm(k, p + "self_attn.k_norm.weight").transpose(0, 1)
        q = q * cos[0, -n:] + rotate_half(q) * sin[0, -n:]
        k = k * cos[0] + rotate_half(k) * sin[0]
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.transpose(0, 1).repeat_interleave(group, 0)
        attn = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1) @ v
        x = x + attn.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, p + "post_attention_layernorm.weight")
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(x, "norm.weight")


def test_block_forward_matches_z_labs_model(smollm_dir: Path, tmp_path: Path) -> None:
    path = write_dflash_draft(tmp_path / "draft")
    draft = load_dflash(path, ModelConfig.from_file(smollm_dir / "config.json")).float()
    torch.manual_seed(1)
    ctx, block = torch.randn(11, 2 * 576), torch.randn(BLOCK, 576)
    context = [(k[None], v[None]) for k, v in draft.context(ctx, torch.arange(11))]
    mask = torch.ones(1, BLOCK, 11 + BLOCK, dtype=torch.bool)
    with torch.no_grad():
        ours = draft(block, torch.arange(11, 11 + BLOCK), context, mask)
        want = reference_block(path, ctx, block)
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=2e-4)


@pytest.fixture(scope="module")
def random_dflash(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_dflash_draft(tmp_path_factory.mktemp("dflash")))


@pytest.fixture(scope="module")
def prompt_ids(smollm_dir: Path) -> list[list[int]]:
    tok = Tokenizer(smollm_dir)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def test_dflash_drafts_a_block_losslessly(
    smollm_dir: Path, random_dflash: str, prompt_ids: list[list[int]]
) -> None:
    prompt_ids = prompt_ids[:8]  # one batch of them, and each alone
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    reference = [plain.generate([ids], GREEDY)[0] for ids in prompt_ids]
    engine = spec_engine(
        smollm_dir,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=random_dflash,
        speculative_dflash_draft_window_size=24,
        speculative_adaptive=False,
    )
    drafter = engine.speculator.drafter
    assert drafter.target_features == ((1, 27), False) and drafter.block_size == BLOCK
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids] == reference
    assert engine.generate(prompt_ids, GREEDY) == reference
    stats = engine.speculator.stats
    # One block per step: every step verified block - 1 drafts (but a request's last).
    assert stats.steps > 0 and stats.draft_tokens > (BLOCK - 2) * stats.steps
    assert engine.block_manager.num_free == engine.kv_cache.num_blocks
    drafter.open("probe", prompt_ids[0])
    features = torch.randn(len(prompt_ids[0]) - 1, 2 * 576)
    tree = drafter.propose([DraftRequest("probe", [], 3, features, 0)])[0]
    assert len(tree) == 4 and tree.parents == [-1, 0, 1, 2]  # a chain, cut to the budget
    assert all(len(k) == 24 for k, _ in drafter.contexts["probe"].layers)  # the window


def test_bad_dflash_options_fail_before_loading(
    smollm_dir: Path, random_dflash: str, tmp_path: Path
) -> None:
    def resolved(**options: object) -> SpeculativeConfig:
        return SpeculativeConfig(  # type: ignore[arg-type]
            speculative_algorithm="DFLASH", speculative_draft_model_path=random_dflash, **options
        ).resolved(str(smollm_dir))

    cfg = resolved()
    assert (cfg.speculative_num_steps, cfg.speculative_num_draft_tokens) == (BLOCK - 1, BLOCK)
    assert resolved(speculative_num_draft_tokens=4).speculative_num_steps == 3
    with pytest.raises(ValueError, match="block-size 16 exceeds the block .* trained for \\(8\\)"):
        resolved(speculative_num_draft_tokens=16)
    with pytest.raises(ValueError, match="DFLASH drafts a chain"):
        resolved(speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="window-size is >= 1, for DFLASH only"):
        SpeculativeConfig("NGRAM", speculative_dflash_draft_window_size=8).resolved()
    eagle = tmp_path / "eagle"
    eagle.mkdir()
    cfg = SpeculativeConfig("DFLASH", write_eagle_head(eagle, eagle3=True)).resolved()
    with pytest.raises(ValueError, match="not a DFlash checkpoint"):
        drafter_target_features(cfg, str(smollm_dir))
    other = write_dflash_draft(tmp_path / "other", target_layers=32)
    cfg = SpeculativeConfig("DFLASH", str(other)).resolved()
    with pytest.raises(ValueError, match="target of 32 layers"):
        drafter_target_features(cfg, str(smollm_dir))
