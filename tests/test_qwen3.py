"""Qwen3 (q/k norms) and Qwen3-MoE (top-k routed experts) against transformers.

Tiny random checkpoints made with transformers: logits through the paged cache (prefill,
decode, extend, a batch of 8 prompts in one step), then, with SmolLM2's tokenizer, greedy
tokens through the engine equal to transformers' over 20 prompts, one by one and 8 at a
time, with chunked prefill, a prefix-cache hit and lossless speculation.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deployment import chat_text, specmesh_up
from helpers import PROMPTS, write_eagle_head
from safetensors.torch import load_file, save_file
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.moe import MoE
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer
from test_model_variants import BLOCK_SIZE, CPU, VOCAB, Variant, assert_close, build_hf, hf_logits

QWEN3 = {"head_dim": 32}  # 4 heads of 32: q is 128 wide over a hidden size of 64
MOE = {
    **QWEN3,
    "num_hidden_layers": 3,
    "mlp_only_layers": [1],  # layers 0 and 2 routed, 1 dense
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}
VARIANTS = {
    "qwen3": Variant("qwen3", QWEN3),
    "qwen3-bias-tied": Variant(
        "qwen3", {"head_dim": 16, "attention_bias": True, "tie_word_embeddings": True}
    ),
    "qwen3-moe": Variant("qwen3_moe", MOE),
    "qwen3-moe-sparse-step": Variant(
        "qwen3_moe",
        {**MOE, "mlp_only_layers": [], "decoder_sparse_step": 2, "norm_topk_prob": False},
    ),
}
FAMILIES = {"qwen3": VARIANTS["qwen3"], "qwen3-moe": VARIANTS["qwen3-moe"]}
NUM_BLOCKS = 64
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def runner_for(path: Path) -> ModelRunner:
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, CPU, torch.float32))
    assert runner.fused is None  # the C++ decoder computes plain Llama layers only
    return runner


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers_prefill_decode_extend(name: str, tmp_path: Path) -> None:
    hf, path = build_hf(VARIANTS[name], tmp_path / name)
    runner = runner_for(path)
    cfg = runner.model.config
    assert cfg.qk_norm and cfg.head_dim == hf.config.head_dim
    moe = [isinstance(layer.mlp, MoE) for layer in runner.model.layers]
    assert moe == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (11,), generator=gen).tolist()
    table = list(range(10))
    logits, _ = runner.forward([SequenceSpan(table, 0, 11)], ids, list(range(11)), list(range(11)))
    assert_close(logits, hf_logits(hf, ids, 0), f"{name} prefill")
    for step in range(4):
        ids.append(int(logits[-1].argmax()))
        n = len(ids)
        logits, _ = runner.forward([SequenceSpan(table, n - 1, 1)], ids[-1:], [n - 1], [0])
        assert_close(logits, hf_logits(hf, ids, 0)[-1:], f"{name} decode {step}")
    extra = torch.randint(3, VOCAB, (5,), generator=gen).tolist()
    start, ids = len(ids), ids + extra
    logits, _ = runner.forward(
        [SequenceSpan(table, start, 5)], extra, list(range(start, len(ids))), list(range(5))
    )
    assert_close(logits, hf_logits(hf, ids, 0)[start:], f"{name} extend")


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_batch_of_8_prompts_in_one_step(name: str, tmp_path: Path) -> None:
    """Eight prompts of different lengths prefilled in one forward match HF one by one."""
    hf, path = build_hf(VARIANTS[name], tmp_path / name, seed=2)
    runner = runner_for(path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in range(3, 11)]
    spans = [SequenceSpan([3 * i, 3 * i + 1, 3 * i + 2], 0, len(p)) for i, p in enumerate(prompts)]
    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    logits, _ = runner.forward(spans, ids, positions, list(range(len(ids))))
    ref = torch.cat([hf_logits(hf, p, 0) for p in prompts])
    assert_close(logits, ref, f"{name} batch of 8")


MOE_LAYERS, EXPERTS = (0, 2), 8  # of MOE


def _stacked(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors (the Hub's layout) stacked as transformers holds them."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for layer in MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts."
        out[f"{p}gate_up_proj"] = torch.stack(
            [
                torch.cat([state[f"{p}{e}.{w}_proj.weight"] for w in ("gate", "up")])
                for e in range(EXPERTS)
            ]
        )
        out[f"{p}down_proj"] = torch.stack(
            [state[f"{p}{e}.down_proj.weight"] for e in range(EXPERTS)]
        )
    return out


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Stacked expert tensors split into one per expert and projection (the Hub's layout)."""
    out = {k: v for k, v in state.items() if ".experts." not in k}
    for layer in MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts."
        for e in range(EXPERTS):
            gate, up = state[f"{p}gate_up_proj"][e].chunk(2)
            out |= {f"{p}{e}.gate_proj.weight": gate, f"{p}{e}.up_proj.weight": up}
            out[f"{p}{e}.down_proj.weight"] = state[f"{p}down_proj"][e]
    return out


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")


def test_moe_loads_per_expert_and_stacked_checkpoints(tmp_path: Path) -> None:
    """Experts load as the Hub stores them (one tensor per expert and projection) and as
    transformers holds them (stacked [E, 2I, H] and [E, H, I]); a missing expert is named."""
    _, path = build_hf(VARIANTS["qwen3-moe"], tmp_path / "m")
    state = load_file(path / "model.safetensors")
    if "model.layers.0.mlp.experts.3.up_proj.weight" in state:
        per_expert, stacked = state, _stacked(state)
    else:
        per_expert, stacked = _per_expert(state), state
    loaded = []
    for layout in (per_expert, stacked):
        _save(layout, path)
        loaded.append(load_model(path, CPU, torch.float32).state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])

    dropped = "model.layers.2.mlp.experts.5.down_proj.weight"
    _save({k: v for k, v in per_expert.items() if k != dropped}, path)
    with pytest.raises(ValueError, match="lacks") as err:
        load_model(path, CPU, torch.float32)
    assert dropped.removeprefix("model.") in str(err.value)


def test_unserved_variants_are_refused(tmp_path: Path) -> None:
    _, path = build_hf(VARIANTS["qwen3"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="sliding-window"):
        ModelConfig.from_hf({**cfg, "use_sliding_window": True})
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen2MoeForCausalLM'"):
        ModelConfig.from_hf({**cfg, "architectures": ["Qwen2MoeForCausalLM"]})


# --- the engine, with a real tokenizer ---------------------------------------------------


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(
    request: pytest.FixtureRequest, smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, list[list[int]], list[list[int]]]:
    """(family, model dir with SmolLM2's tokenizer, chat prompt ids, HF greedy tokens)."""
    name = request.param
    variant = FAMILIES[name]
    variant = Variant(variant.family, {**variant.config, "vocab_size": 49152})
    hf, path = build_hf(variant, tmp_path_factory.mktemp(name), seed=7)
    return name, path, *chat_reference(hf, path, smollm_dir)


def chat_reference(
    hf: torch.nn.Module, path: Path, smollm_dir: Path
) -> tuple[list[list[int]], list[list[int]]]:
    """Give the checkpoint at `path` SmolLM2's tokenizer: (the test prompts as chat prompt
    ids, transformers' greedy tokens for each)."""
    for f in TOKENIZER_FILES:
        shutil.copy(smollm_dir / f, path / f)
    tok = Tokenizer(path)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    with torch.no_grad():
        ref = [
            hf.generate(
                torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2
            )[0, len(ids) :].tolist()
            for ids in prompts
        ]
    return prompts, ref


def engine_for(path: Path, spec: SpeculativeConfig | None = None, **cfg: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), kv_cache_gb=0.02, **cfg), spec)  # type: ignore[arg-type]


def assert_generates(engine: LLMEngine, prompts: list[list[int]], ref: list[list[int]]) -> None:
    """One by one, then 8 at a time; nothing leaked."""
    assert [engine.generate([ids], GREEDY)[0] for ids in prompts] == ref
    for i in range(0, len(prompts), 8):
        assert engine.generate(prompts[i : i + 8], GREEDY) == ref[i : i + 8]
    assert engine.block_manager.num_free == engine.kv_cache.num_blocks


def test_greedy_tokens_match_transformers_with_prefix_hits(family: tuple) -> None:
    _, path, prompts, ref = family
    engine = engine_for(path)
    assert_generates(engine, prompts, ref)
    # The second pass over the prompts reused their cached blocks.
    reused = engine.block_manager.reused_tokens
    assert engine.generate(prompts[:1], GREEDY) == ref[:1]
    assert engine.block_manager.reused_tokens - reused >= 16


def test_chunked_prefill_matches_transformers(family: tuple) -> None:
    _, path, prompts, ref = family
    engine = engine_for(path, max_num_batched_tokens=7)
    assert engine.generate(prompts[:8], GREEDY) == ref[:8]


def test_ngram_speculation_is_lossless(family: tuple) -> None:
    _, path, prompts, ref = family
    engine = engine_for(path, SpeculativeConfig("NGRAM"))
    assert_generates(engine, prompts, ref)
    assert engine.speculator.stats.draft_tokens > 0


def test_eagle3_speculation_is_lossless(family: tuple, tmp_path: Path) -> None:
    _, path, prompts, ref = family
    shape = json.loads((path / "config.json").read_text())
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    head_shape = {k: shape[k] for k in (*keys, "head_dim", "vocab_size")}
    head = write_eagle_head(tmp_path, eagle3=True, shape=head_shape, aux_layers=[0, 1, 1])
    spec = SpeculativeConfig(
        "EAGLE3",
        speculative_draft_model_path=head,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    )
    engine = engine_for(path, spec)
    assert_generates(engine, prompts, ref)
    assert engine.speculator.stats.draft_tokens > 0


def test_specmesh_up_serves_the_family(family: tuple) -> None:
    """Prefill, decode and an NGRAM drafter as separate processes: transformers' text."""
    _, path, _, ref = family
    tok = Tokenizer(path)
    with specmesh_up(path, "--speculative-algorithm", "NGRAM") as url:
        for prompt, tokens in list(zip(PROMPTS, ref, strict=True))[:3]:
            text = chat_text(url, prompt, temperature=0, max_tokens=MAX_TOKENS)
            assert text == tok.decode(tokens)
