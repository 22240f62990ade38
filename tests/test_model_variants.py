"""Our Llama-family runtime against Hugging Face transformers on tiny random checkpoints.

Each variant is built with transformers, saved with `save_pretrained`, loaded with our
`load_model`, and must produce the same logits (fp32) on a prefill and on decode steps
through the paged KV cache, with blocks small enough that sequences span several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan, TorchAttention
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.llama import LlamaForCausalLM as OurLlama
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.rope import rope_cos_sin
from specmesh.shared.runner.model_runner import ModelRunner
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

CPU = torch.device("cpu")
VOCAB = 128
BLOCK_SIZE = 4
NUM_BLOCKS = 16
# Scrambled on purpose: the cache must follow the block table, not assume contiguous blocks.
BLOCK_TABLE = [9, 3, 14, 0, 6, 11, 1]
MAX_REL_ERR = 1e-4

HF_CLASSES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
}


@dataclass(frozen=True)
class Variant:
    family: str
    config: dict[str, Any] = field(default_factory=dict)
    shard: bool = False  # save with a small max_shard_size (model.safetensors.index.json)
    position_offset: int = 0  # first position id; large offsets exercise rope scaling
    legacy_config: dict[str, Any] | None = None  # rewrite config.json in transformers-4 form


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # With head_dim 16 and theta 1e4, wavelengths fall in all three llama3 regimes.
    "original_max_position_embeddings": 256,
}

VARIANTS = {
    "llama-gqa-untied": Variant("llama"),
    "llama-gqa-tied": Variant("llama", {"tie_word_embeddings": True}),
    "llama-mha": Variant("llama", {"num_key_value_heads": 4}),
    "llama-mqa": Variant("llama", {"num_key_value_heads": 1}),
    "llama-head-dim-32": Variant("llama", {"head_dim": 32}),
    "llama-sharded": Variant("llama", {"num_hidden_layers": 3}, shard=True),
    "qwen2-bias": Variant("qwen2"),
    "qwen2-bias-tied": Variant("qwen2", {"tie_word_embeddings": True}, shard=True),
    "mistral": Variant("mistral", {"num_hidden_layers": 3}),
    "llama-attention-and-mlp-bias": Variant("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-rope-linear": Variant(
        "llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, position_offset=300
    ),
    "llama-rope-llama3": Variant(
        "llama", {"rope_parameters": LLAMA3, "rope_theta": 10000.0}, position_offset=300
    ),
    "llama-rope-yarn": Variant(
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 128},
        position_offset=100,
    ),
    "llama-rope-yarn-options": Variant(
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 8.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "attention_factor": 1.2,
            },
        },
        position_offset=200,
    ),
    "llama-rope-yarn-mscale": Variant(
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "truncate": False,
            },
        },
        position_offset=200,
    ),
    # A transformers-4 style config.json: top-level rope_theta and rope_scaling with "type".
    "llama-rope-legacy-config": Variant(
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}},
        position_offset=100,
        legacy_config={"rope_theta": 5000.0, "rope_scaling": {"type": "linear", "factor": 2.0}},
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's init (tiny weights, unit norms, zero biases) with values large enough
    that attention is sharp and every tensor, norms and biases included, matters."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.25 * noise)


def build_hf(variant: Variant, out_dir: Path, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    """A tiny random HF model of `variant`, saved to `out_dir`; returns (model, dir)."""
    config_cls, model_cls = HF_CLASSES[variant.family]
    kwargs: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    kwargs.update(variant.config)
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**kwargs)).eval()
    _randomize(hf, seed)
    hf.save_pretrained(
        out_dir, safe_serialization=True, max_shard_size="40KB" if variant.shard else "1GB"
    )
    if variant.legacy_config is not None:
        cfg_path = out_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("rope_parameters")
        cfg.update(variant.legacy_config)
        cfg_path.write_text(json.dumps(cfg))
    return hf, out_dir


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, ids: list[int], offset: int) -> torch.Tensor:
    """Reference logits for every position of `ids` (no cache: recomputed from scratch)."""
    input_ids = torch.tensor([ids])
    position_ids = torch.arange(offset, offset + len(ids))[None]
    return hf(input_ids=input_ids, position_ids=position_ids).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert torch.isfinite(ours).all(), what
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err < MAX_REL_ERR, f"{what}: max relative error {err:.2e}"


def new_runner(path: Path, fused: bool = True) -> ModelRunner:
    """A runner whose few-row steps take the fused C++ decoder, or always the torch path."""
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, CPU, torch.float32))
    assert runner.fused is not None  # this machine builds the CPU kernel
    if not fused:
        runner.fused = None
    return runner


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers_prefill_and_decode(name: str, fused: bool, tmp_path: Path) -> None:
    variant = VARIANTS[name]
    hf, path = build_hf(variant, tmp_path / name)
    if variant.shard:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    runner = new_runner(path, fused)
    cfg = runner.model.config

    # The variant's distinguishing feature reached our config.
    hf_cfg = hf.config
    assert cfg.num_kv_heads == hf_cfg.num_key_value_heads
    hf_head_dim = (
        getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    )
    assert cfg.head_dim == hf_head_dim
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    attention_bias = getattr(hf_cfg, "attention_bias", False) is True
    assert cfg.qkv_bias == (variant.family == "qwen2" or attention_bias)
    assert cfg.o_proj_bias == (variant.family != "qwen2" and attention_bias)
    rope_type = hf_cfg.rope_parameters["rope_type"]
    if rope_type != "default":
        default_cos, _ = rope_cos_sin(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, None
        )
        assert not torch.allclose(runner.model.rope_cos, default_cos, atol=1e-3), "scaling ignored"
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"]

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, VOCAB, (11,), generator=gen).tolist()  # spans 3 blocks of 4
    off = variant.position_offset

    # Prefill: logits at every prompt position.
    n = len(prompt)
    logits, _ = runner.forward(
        [SequenceSpan(BLOCK_TABLE, 0, n)], prompt, list(range(off, off + n)), list(range(n))
    )
    ref = hf_logits(hf, prompt, off)
    assert_close(logits, ref, f"{name} prefill")

    # Decode: one token at a time through the paged cache, crossing block boundaries.
    ids = list(prompt)
    for step in range(6):
        ids.append(int(logits[-1].argmax()))
        pos = off + len(ids) - 1
        logits, _ = runner.forward(
            [SequenceSpan(BLOCK_TABLE, len(ids) - 1, 1)], [ids[-1]], [pos], [0]
        )
        ref = hf_logits(hf, ids, off)[-1:]
        assert_close(logits, ref, f"{name} decode step {step}")

    # Chunked extend over the cached prefix (a prefill split in two, or a verify chunk).
    extra = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    start = len(ids)
    ids += extra
    logits, _ = runner.forward(
        [SequenceSpan(BLOCK_TABLE, start, len(extra))],
        extra,
        list(range(off + start, off + len(ids))),
        list(range(len(extra))),
    )
    assert_close(logits, hf_logits(hf, ids, off)[start:], f"{name} extend")


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_batch_of_sequences_at_different_stages(fused: bool, tmp_path: Path) -> None:
    """Two decodes and a prefill in one forward, each in its own blocks, match HF one by one."""
    hf, path = build_hf(VARIANTS["qwen2-bias"], tmp_path / "m", seed=3)
    runner = new_runner(path, fused)
    gen = torch.Generator().manual_seed(7)
    a, b, c = (torch.randint(3, VOCAB, (k,), generator=gen).tolist() for k in (9, 6, 7))
    tables = [[4, 12, 1], [7, 2], [15, 0]]
    # Prefill a and b separately.
    for seq, table in ((a, tables[0]), (b, tables[1])):
        runner.forward(
            [SequenceSpan(table, 0, len(seq) - 1)], seq[:-1], list(range(len(seq) - 1)), [0]
        )
    # One step: decode last token of a and b, prefill all of c.
    spans = [
        SequenceSpan(tables[0], len(a) - 1, 1),
        SequenceSpan(tables[2], 0, len(c)),
        SequenceSpan(tables[1], len(b) - 1, 1),
    ]
    input_ids = [a[-1], *c, b[-1]]
    positions = [len(a) - 1, *range(len(c)), len(b) - 1]
    rows = [0, *range(1, 1 + len(c)), 1 + len(c)]
    logits, _ = runner.forward(spans, input_ids, positions, rows)
    ref = torch.cat([hf_logits(hf, a, 0)[-1:], hf_logits(hf, c, 0), hf_logits(hf, b, 0)[-1:]])
    assert_close(logits, ref, "mixed batch")


@pytest.mark.parametrize(
    ("logit_rows", "aux_layers"),
    [(list(range(8)), (2, 0)), ([0, 1, 2, 3, 4, 7], (1,))],
    ids=["all-rows", "last-row-of-extend"],
)
def test_fused_decoder_matches_torch_path_on_trees_and_aux_layers(
    logit_rows: list[int], aux_layers: tuple[int, ...], tmp_path: Path
) -> None:
    """One step mixing a decode, a draft tree (custom mask) and a causal extend: the fused
    kernel's logits, aux layers (in the order asked) and cache writes equal the torch path's,
    also where the extend's first rows want no logits (the last layer skips them)."""
    _, path = build_hf(VARIANTS["llama-sharded"], tmp_path / "m", seed=4)  # 3 layers
    runner = new_runner(path)
    gen = torch.Generator().manual_seed(3)
    tables = [[4, 12, 1], [7, 2, 9, 5], [15, 0]]
    for table in tables[:2]:  # 9 cached tokens each, through the torch path
        prompt = torch.randint(3, VOCAB, (9,), generator=gen).tolist()
        runner.forward([SequenceSpan(table, 0, 9)], prompt, list(range(9)), [8])
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    spans = [SequenceSpan(tables[0], 9, 1), SequenceSpan(tables[1], 9, 4, tree)]
    spans.append(SequenceSpan(tables[2], 0, 3))
    ids = torch.randint(3, VOCAB, (8,), generator=gen).tolist()
    positions = [9, 9, 10, 10, 11, 0, 1, 2]
    cache = runner.kv_cache.storage.clone()
    fused = runner.forward(spans, ids, positions, logit_rows, aux_layers)
    fused_cache = runner.kv_cache.storage.clone()
    runner.kv_cache.storage.copy_(cache)
    runner.fused = None
    plain = runner.forward(spans, ids, positions, logit_rows, aux_layers)
    assert_close(fused[0], plain[0], "logits")
    for i, (ours, ref) in enumerate(zip(fused[1], plain[1], strict=True)):
        assert_close(ours, ref, f"aux {i}")
    assert_close(fused_cache, runner.kv_cache.storage, "cache writes")


@pytest.mark.parametrize(
    ("cached", "new", "heads", "kv_heads", "dim", "spread"),
    [(0, 8, 4, 2, 16, 1.0), (100, 40, 9, 3, 64, 1.0), (300, 333, 6, 1, 48, 30.0)],
)
def test_tiled_causal_attention_matches_sdpa(
    cached: int, new: int, heads: int, kv_heads: int, dim: int, spread: float
) -> None:
    """attention.cpp over scattered cache slots, grouped heads, a head size that is not a
    whole number of 16-column blocks, and scores large enough that the running max moves
    from tile to tile, equals SDPA with the causal mask over the gathered context."""
    from specmesh.kernels.cpu import load

    gen = torch.Generator().manual_seed(cached + new)
    total = cached + new
    slots = torch.randperm(total + 20, generator=gen)[:total]
    k_cache, v_cache = (torch.randn(total + 20, kv_heads, dim, generator=gen) for _ in "kv")
    q = torch.randn(new, heads, dim, generator=gen) * spread
    out = load().causal_attention(q, k_cache, v_cache, slots, cached)
    group = heads // kv_heads
    k, v = (c[slots].repeat_interleave(group, 1).transpose(0, 1) for c in (k_cache, v_cache))
    mask = torch.ones(new, total, dtype=torch.bool).tril(cached)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    assert_close(out, ref.transpose(0, 1).reshape(new, heads * dim), "attention")


def test_fused_prefill_in_chunks_matches_torch_path(tmp_path: Path) -> None:
    """A 300-token prompt prefilled in two chunks (the second over 130 cached tokens, past
    several key tiles and query blocks) through the fused decoder: the cache it wrote and
    the second chunk's logits at every position equal the torch path's (the first chunk,
    as the engine's, wants no logits)."""
    _, path = build_hf(VARIANTS["llama-sharded"], tmp_path / "m", seed=6)
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, 80, BLOCK_SIZE, CPU, torch.float32))
    assert runner.fused is not None
    table = torch.randperm(80, generator=torch.Generator().manual_seed(0)).tolist()
    ids = torch.randint(3, VOCAB, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def prefill() -> torch.Tensor:
        runner.kv_cache.storage.zero_()
        return torch.cat(
            [
                runner.forward(
                    [SequenceSpan(table, start, end - start)],
                    ids[start:end],
                    list(range(start, end)),
                    list(range(end - start)) if end == 300 else [],
                )[0]
                for start, end in ((0, 130), (130, 300))
            ]
        )

    fused = prefill()
    fused_cache = runner.kv_cache.storage.clone()
    runner.fused = None
    assert_close(fused, prefill(), "logits")
    assert_close(fused_cache, runner.kv_cache.storage, "cache writes")


@torch.no_grad()
def test_aux_hidden_states_match_hf_output_hidden_states(tmp_path: Path) -> None:
    hf, path = build_hf(VARIANTS["llama-sharded"], tmp_path / "m", seed=5)  # 3 layers
    model = load_model(path, CPU, torch.float32)
    cache = KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, CPU, torch.float32)
    ids = torch.randint(3, VOCAB, (10,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(10)
    meta = TorchAttention().prepare([SequenceSpan(BLOCK_TABLE, 0, 10)], BLOCK_SIZE, CPU)
    hidden, aux = model(ids, pos, cache.layers, meta, aux_layers=(0, 1, 2))

    out = hf(input_ids=ids[None], position_ids=pos[None], output_hidden_states=True)
    hs = [h[0] for h in out.hidden_states]
    assert len(hs) == 4 and len(aux) == 3
    # hidden_states[i + 1] is the output of layer i; the last one is after the final norm.
    assert_close(aux[0], hs[1], "aux layer 0")
    assert_close(aux[1], hs[2], "aux layer 1")
    assert_close(model.norm(aux[2]), hs[3], "normed last layer")
    assert_close(hidden, hs[3], "final hidden")
    assert_close(model.compute_logits(hidden), out.logits[0], "logits")
    # Only the requested layers are returned, in layer order.
    _, aux01 = model(ids, pos, cache.layers, meta, aux_layers=(0, 1))
    assert len(aux01) == 2
    assert_close(aux01[1], hs[2], "aux (0, 1) layer 1")


def _hf_config_dict(**overrides: Any) -> dict[str, Any]:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ).to_dict()
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "MixtralForCausalLM", "Qwen2MoeForCausalLM"])
def test_unsupported_architecture_is_rejected(arch: str, tmp_path: Path) -> None:
    cfg = _hf_config_dict(architectures=[arch])
    with pytest.raises(ValueError, match=f"unsupported architecture '{arch}'"):
        ModelConfig.from_hf(cfg)
    # Through the loader too, before any weights are read.
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=arch):
        load_model(tmp_path, CPU, torch.float32)


def test_supported_architectures_are_accepted() -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"):
        assert ModelConfig.from_hf(_hf_config_dict(architectures=[arch])).architecture == arch


def _drop_tensor(path: Path, key: str) -> None:
    weights = path / "model.safetensors"
    state = load_file(weights)
    del state[key]
    save_file(state, weights)


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.k_proj.weight",  # part of a fused qkv projection
        "model.layers.1.mlp.up_proj.weight",  # part of a fused gate/up projection
        "model.layers.0.self_attn.v_proj.bias",
    ],
)
def test_missing_tensor_is_named(key: str, tmp_path: Path) -> None:
    _, path = build_hf(VARIANTS["qwen2-bias"], tmp_path / "m")
    _drop_tensor(path, key)
    with pytest.raises(ValueError, match="lacks") as err:
        load_model(path, CPU, torch.float32)
    assert key.removeprefix("model.") in str(err.value)


def test_tied_lm_head_uses_the_embedding(tmp_path: Path) -> None:
    # The checkpoint has no lm_head.weight; the head must take the embedding's values
    # (storage may or may not be shared: a CPU layout can give the head its own copy).
    _, tied = build_hf(VARIANTS["llama-gqa-tied"], tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tied / "model.safetensors")
    model = load_model(tied, CPU, torch.float32)
    assert torch.equal(model.lm_head.weight, model.embed_tokens.weight)

    _, untied = build_hf(VARIANTS["llama-gqa-untied"], tmp_path / "untied")
    model = load_model(untied, CPU, torch.float32)
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_wrong_tensor_shape_is_rejected(tmp_path: Path) -> None:
    """A config that disagrees with its weights (e.g. a resized vocabulary) must not load."""
    _, path = build_hf(VARIANTS["llama-gqa-untied"], tmp_path / "m")
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["vocab_size"] = VOCAB + 16
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"(embed_tokens|lm_head)\.weight.*\(128, 64\)"):
        load_model(path, CPU, torch.float32)


def test_unexpected_tensor_is_rejected(tmp_path: Path) -> None:
    _, path = build_hf(VARIANTS["llama-gqa-untied"], tmp_path / "m")
    weights = path / "model.safetensors"
    state = load_file(weights)
    state["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(state, weights)
    with pytest.raises(ValueError, match="o_proj.bias"):
        load_model(path, CPU, torch.float32)


def test_rope_tables_live_with_the_weights() -> None:
    """A model built on the meta device and given storage elsewhere (as the loader does for
    CUDA) keeps its rope tables there too: indexing CPU tables with device positions fails."""
    with torch.device("meta"):
        model = OurLlama(ModelConfig.from_hf(_hf_config_dict()), TorchAttention())
    model.materialize(torch.device("meta"), torch.bfloat16)
    assert model.rope_cos.device.type == model.rope_sin.device.type == "meta"
    assert model.rope_cos.dtype == torch.bfloat16
