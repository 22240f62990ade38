"""Qwen3-Next (Gated DeltaNet layers beside gated full attention, routed experts with a
shared expert) against transformers.

A tiny random checkpoint made with transformers: logits through the paged cache and the
per-block state slots (prefill, decode, extend, a batch of prompts in one step, a draft
tree), then, with SmolLM2's tokenizer, greedy tokens through the engine equal to
transformers' over 20 prompts, with chunked prefill, prefix-cache hits resuming from state
snapshots, NGRAM, an oracle drafter whose drafts go wrong at known places (the state must
follow the accepted path), and the services, where prefill hands the state to decode.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from deployment import chat_text, specmesh_up
from helpers import PROMPTS
from safetensors.torch import save_file
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.gated_deltanet import GatedDeltaNet
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.moe import MoE
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest, LocalDrafter
from specmesh.shared.tokenizer import Tokenizer
from test_model_variants import CPU, VOCAB, Variant, assert_close, build_hf, hf_logits
from test_qwen3 import GREEDY, MAX_TOKENS, assert_generates, chat_reference

NEXT = {
    "num_hidden_layers": 4,  # linear, linear, linear, full (full_attention_interval 4)
    "head_dim": 16,
    "partial_rotary_factor": 0.25,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,  # two value heads per key head
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [1],
    "norm_topk_prob": True,
}
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    return build_hf(Variant("qwen3_next", NEXT), tmp_path_factory.mktemp("qwen3-next"))


def runner_for(path: Path) -> ModelRunner:
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, CPU, torch.float32))
    assert runner.fused is None
    return runner


def test_logits_match_transformers_prefill_decode_extend(tiny: tuple) -> None:
    hf, path = tiny
    runner = runner_for(path)
    kinds = [isinstance(layer.linear_attn, GatedDeltaNet) for layer in runner.model.layers]
    assert kinds == [t == "linear_attention" for t in hf.config.layer_types] == [1, 1, 1, 0]
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (11,), generator=gen).tolist()
    table = [9, 3, 14, 0, 6, 11, 1]  # scrambled: states follow the block table
    logits, _ = runner.forward([SequenceSpan(table, 0, 11)], ids, list(range(11)), list(range(11)))
    assert_close(logits, hf_logits(hf, ids, 0), "prefill")
    for step in range(6):  # crosses a block boundary: the state moves to the next slot
        ids.append(int(logits[-1].argmax()))
        n = len(ids)
        logits, _ = runner.forward([SequenceSpan(table, n - 1, 1)], ids[-1:], [n - 1], [0])
        assert_close(logits, hf_logits(hf, ids, 0)[-1:], f"decode {step}")
    extra = torch.randint(3, VOCAB, (7,), generator=gen).tolist()
    start, ids = len(ids), ids + extra
    logits, _ = runner.forward(
        [SequenceSpan(table, start, 7)], extra, list(range(start, len(ids))), list(range(7))
    )
    assert_close(logits, hf_logits(hf, ids, 0)[start:], "extend")


def test_a_long_prompt_in_closed_form_matches_transformers(tiny: tuple) -> None:
    """A 150-token prompt in blocks of 128: segments of at most 64 rows, a kept state at
    the block end, then decode from it."""
    hf, path = tiny
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, 4, 128, CPU, torch.float32))
    ids = torch.randint(3, VOCAB, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    logits, _ = runner.forward([SequenceSpan([2, 0], 0, 150)], ids, list(range(150)), [127, 149])
    assert_close(logits, hf_logits(hf, ids, 0)[[127, 149]], "long prompt")
    ids.append(int(logits[-1].argmax()))
    logits, _ = runner.forward([SequenceSpan([2, 0], 150, 1)], ids[-1:], [150], [0])
    assert_close(logits, hf_logits(hf, ids, 0)[-1:], "decode after it")


def test_batch_of_8_prompts_and_a_draft_tree_in_one_step(tiny: tuple) -> None:
    """Eight prompts of different lengths in one forward; then each continues with a tree
    whose every node sees only its ancestors' state."""
    hf, path = tiny
    runner = runner_for(path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in range(3, 11)]
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(8)]
    spans = [SequenceSpan(t, 0, len(p)) for t, p in zip(tables, prompts, strict=True)]
    ids = [t for p in prompts for t in p]
    positions = [i for p in prompts for i in range(len(p))]
    logits, _ = runner.forward(spans, ids, positions, list(range(len(ids))))
    assert_close(logits, torch.cat([hf_logits(hf, p, 0) for p in prompts]), "batch of 8")
    # root r with children a, b; a has child c: rows r, a, b, c
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1])
    spans = [
        SequenceSpan(t, len(p), 4, tree.ancestor_mask())
        for t, p in zip(tables, prompts, strict=True)
    ]
    positions = [len(p) + d for p in prompts for d in tree.depths()]
    logits, _ = runner.forward(spans, tree.tokens * 8, positions, list(range(32)))
    ref = []
    for p in prompts:
        ref += [hf_logits(hf, p + tree.path_tokens(node), 0)[-1] for node in range(4)]
    assert_close(logits, torch.stack(ref), "draft trees")


def test_unservable_configs_are_refused_clearly(tiny: tuple) -> None:
    _, path = tiny
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_hf({**cfg, "linear_num_value_heads": 3})


# --- the engine, with a real tokenizer ---------------------------------------------------


@pytest.fixture(scope="module")
def family(
    smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """(model dir with SmolLM2's tokenizer, chat prompt ids, transformers' greedy tokens)."""
    variant = Variant("qwen3_next", {**NEXT, "vocab_size": 49152})
    hf, path = build_hf(variant, tmp_path_factory.mktemp("qwen3-next-chat"), seed=7)
    return path, *chat_reference(hf, path, smollm_dir)


def engine_for(
    path: Path,
    spec: SpeculativeConfig | None = None,
    drafter: LocalDrafter | None = None,
    **cfg: object,
) -> LLMEngine:
    config = EngineConfig(model=str(path), kv_cache_gb=0.02, block_size=BLOCK_SIZE, **cfg)  # type: ignore[arg-type]
    return LLMEngine(config, spec, drafter)


def test_greedy_tokens_match_transformers_with_prefix_hits(family: tuple) -> None:
    path, prompts, ref = family
    engine = engine_for(path)
    assert_generates(engine, prompts, ref)
    # The later passes resumed from the state snapshots of cached blocks.
    reused = engine.block_manager.reused_tokens
    assert engine.generate(prompts[:1], GREEDY) == ref[:1]
    assert engine.block_manager.reused_tokens - reused >= 16


def test_a_prompt_extending_a_cached_one_resumes_from_its_snapshot(family: tuple) -> None:
    """A second turn: the first turn's prompt and answer are cached; only the rest is computed."""
    path, prompts, ref = family
    engine = engine_for(path)
    first = prompts[0] + ref[0]
    engine.generate([first], GREEDY)
    longer = first + prompts[1][-9:]
    reused = engine.block_manager.reused_tokens
    fresh = engine_for(path)
    assert engine.generate([longer], GREEDY) == fresh.generate([longer], GREEDY)
    assert engine.block_manager.reused_tokens - reused >= len(first) // BLOCK_SIZE * BLOCK_SIZE - 4


def test_chunked_prefill_matches_transformers(family: tuple) -> None:
    path, prompts, ref = family
    engine = engine_for(path, max_num_batched_tokens=7)
    assert engine.generate(prompts[:8], GREEDY) == ref[:8]


def test_ngram_speculation_is_lossless(family: tuple) -> None:
    path, prompts, ref = family
    engine = engine_for(path, SpeculativeConfig("NGRAM"))
    assert_generates(engine, prompts, ref)
    assert engine.speculator.stats.draft_tokens > 0


class OracleDrafter(LocalDrafter):
    """Knows each prompt's greedy continuation and drafts it as a tree in which a wrong
    sibling comes before every right node and, at known steps, the right node itself is
    wrong: acceptance is partial, and the accepted nodes are never at their path's rows."""

    target_features = ((), False)

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        self.continuations = continuations
        self.seen: dict[str, list[int]] = {}
        self.full: dict[str, list[int]] = {}
        self.calls = 0

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.seen[request_id] = list(prompt_ids)
        self.full[request_id] = list(prompt_ids) + self.continuations[tuple(prompt_ids)]

    def close(self, request_id: str) -> None:
        self.seen.pop(request_id, None)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        return [self._tree(r) for r in requests]

    def _tree(self, r: DraftRequest) -> DraftTree:
        self.calls += 1
        seen = self.seen[r.request_id]
        seen += r.new_tokens
        right = self.full[r.request_id][len(seen) : len(seen) + 3]
        tokens, parents, prev = [seen[-1]], [-1], 0
        for depth, token in enumerate(right):
            if len(tokens) + 2 > r.max_drafts + 1:
                break
            tokens.append(token ^ 1)  # a wrong sibling (in the vocabulary: it is even)
            parents.append(prev)
            wrong_here = (self.calls + depth) % 3 == 2
            tokens.append(token ^ 2 if wrong_here else token)
            parents.append(prev)
            prev = len(tokens) - 1
        return DraftTree(tokens, parents)


def test_state_follows_the_accepted_path_of_an_oracle_tree(family: tuple) -> None:
    path, prompts, ref = family
    drafter = OracleDrafter({tuple(p): r for p, r in zip(prompts, ref, strict=True)})
    spec = SpeculativeConfig("NGRAM", speculative_num_draft_tokens=8)
    engine = engine_for(path, spec, drafter=drafter)
    assert_generates(engine, prompts, ref)
    stats = engine.speculator.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens / 2  # partial, at the known places


def _write_mtp(path: Path) -> None:
    """Give the checkpoint a random MTP module in Qwen3-Next's layout (`mtp.*`, beside the
    model's tensors): fc, the two pre-fc norms, one full-attention layer, the final norm."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    cfg = Qwen3NextConfig.from_pretrained(path)
    hidden = cfg.hidden_size
    layer = Qwen3NextDecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention"))
    gen = torch.Generator().manual_seed(3)
    tensors = {f"mtp.layers.0.{k}": v for k, v in layer.state_dict().items()}
    tensors["mtp.fc.weight"] = torch.empty(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.empty(hidden)
    for name, value in tensors.items():
        scale = 0.2 if "norm" in name else 0.25
        tensors[name] = (scale * torch.randn(value.shape, generator=gen)).contiguous()
    save_file(tensors, path / "mtp.safetensors")


def test_nextn_drafts_from_the_mtp_layer_losslessly(family: tuple, tmp_path: Path) -> None:
    """NEXTN reads the checkpoint's own `mtp.*` (gated attention, routed and shared
    experts); its drafts are verified against the hybrid target, output unchanged."""
    path, prompts, ref = family
    target = tmp_path / "with-mtp"
    shutil.copytree(path, target)
    _write_mtp(target)
    spec = SpeculativeConfig("NEXTN", speculative_num_steps=3, speculative_num_draft_tokens=4)
    engine = engine_for(target, spec)
    assert isinstance(engine.speculator.drafter.head.mlp, MoE)
    assert engine.speculator.drafter.head.self_attn.gate_size > 0
    assert_generates(engine, prompts[:8], ref[:8])
    assert engine.speculator.stats.draft_tokens > 0


def test_specmesh_up_hands_the_state_from_prefill_to_decode(family: tuple, tmp_path: Path) -> None:
    """Prefill, decode and an NGRAM drafter as separate processes: transformers' text, with
    decode resuming from the K/V and state prefill stored (it logs any prompt it computes)."""
    path, _, ref = family
    tok, log = Tokenizer(path), tmp_path / "up.log"
    with specmesh_up(path, "--speculative-algorithm", "NGRAM", log=log) as url:
        for prompt, tokens in list(zip(PROMPTS, ref, strict=True))[:3]:
            text = chat_text(url, prompt, temperature=0, max_tokens=MAX_TOKENS)
            assert text == tok.decode(tokens)
    assert "decode-0" in log.read_text()
    assert "computing its prompt here" not in log.read_text()
