"""Attention backends against the torch one, and the GPU options' behaviour where there is no GPU.

Without a GPU the triton backend runs under Triton's interpreter, on a tiny random GQA Llama
(4 query heads, 2 KV heads): prefill chunks, decode rows and a draft tree in mixed steps must
give the torch backend's logits (fp32) and greedy tokens, through the runner and the engine
(with NGRAM drafts verified). The flashinfer backend, CUDA graphs and torch.compile
have tests that run only on a CUDA device; here they must refuse clearly (flashinfer) or do
nothing (the CUDA-graph options), and FlashInfer's page lists and mask are checked against
the torch backend's slots and masks.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging

import pytest
import torch
from helpers import tiny_llama
from specmesh.shared.config import add_dataclass_args, dataclass_from_args
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan, TorchAttention, context_slots
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.page_table import custom_mask, page_table
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig

BLOCK_SIZE = 4
NUM_BLOCKS = 32
# Scrambled block tables: the kernels must follow them.
TABLES = ([5, 2, 9, 0, 12, 7, 20, 15], [3, 11, 1, 8, 14, 30, 6, 25])
PROMPTS = ([7, 3, 11, 2, 9, 40, 5, 18, 33], [21, 4, 4, 60, 12, 1])
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # of the largest logit
CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

Step = list[tuple[int, int, list[int], DraftTree | None]]  # (sequence, cached, tokens, tree)


@pytest.fixture(scope="module")
def dev() -> str:
    """cuda where there is a GPU, else cpu with Triton's interpreter on: before any kernel
    module is imported."""
    if not HAS_TRITON:
        return "cuda" if CUDA else "cpu"
    from specmesh.kernels.check.suite import device

    return device()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """head_dim 8: 4 query heads, 2 KV heads."""
    return tiny_llama(tmp_path_factory.mktemp("tiny"), vocab=64, seed=1, layers=2)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> str:
    """head_dim 64, one FlashInfer compiles for: 4 query heads, 2 KV heads."""
    return tiny_llama(tmp_path_factory.mktemp("wide"), vocab=64, seed=1, hidden=256, layers=2)


def model_for(backend: str, request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("wide" if backend == "flashinfer" else "tiny")


def make_runner(path: str, backend: str, dev: str, dtype: torch.dtype) -> ModelRunner:
    device = torch.device(dev)
    model = load_model(path, device, dtype, backend)
    return ModelRunner(model, KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, device, dtype))


def forward(runner: ModelRunner, step: Step) -> torch.Tensor:
    """Logits at every row of one step."""
    spans, ids, positions = [], [], []
    for seq, cached, tokens, tree in step:
        mask = None if tree is None else tree.ancestor_mask()
        spans.append(SequenceSpan(TABLES[seq], cached, len(tokens), mask))
        ids += tokens
        depths = range(len(tokens)) if tree is None else tree.depths()
        positions += [cached + d for d in depths]
    logits, _ = runner.forward(spans, ids, positions, list(range(len(ids))))
    return logits.float().cpu()


def scripted(runner: ModelRunner) -> tuple[list[int], list[torch.Tensor]]:
    """Two sequences through a prefill chunk beside a whole prompt, the chunk's rest beside a
    decode row, a decode step, a draft tree beside a decode row, and a decode step after the
    tree (its root accepted). Greedy tokens of each sequence and every step's logits."""
    a, b = PROMPTS
    steps = []
    logits = forward(runner, [(0, 0, a[:5], None), (1, 0, b, None)])
    steps.append(logits)
    tok_b = [int(logits[-1].argmax())]
    logits = forward(runner, [(0, 5, a[5:], None), (1, 6, tok_b[-1:], None)])
    steps.append(logits)
    tok_a = [int(logits[3].argmax())]
    tok_b.append(int(logits[4].argmax()))
    logits = forward(runner, [(0, 9, tok_a[-1:], None), (1, 7, tok_b[-1:], None)])
    steps.append(logits)
    tok_a.append(int(logits[0].argmax()))
    tok_b.append(int(logits[1].argmax()))
    tree = DraftTree([tok_a[-1], 17, 29, 3, 50], [-1, 0, 0, 1, 2])
    logits = forward(runner, [(0, 10, tree.tokens, tree), (1, 8, tok_b[-1:], None)])
    steps.append(logits)
    tok_a.append(int(logits[0].argmax()))  # the root's next token
    tok_b.append(int(logits[5].argmax()))
    logits = forward(runner, [(0, 11, tok_a[-1:], None), (1, 9, tok_b[-1:], None)])
    steps.append(logits)
    return tok_a + [int(logits[0].argmax())] + tok_b + [int(logits[1].argmax())], steps


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    err = ((out - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOLERANCE[dtype], f"max error {err:.2e} of the largest logit"


BACKEND_CASES = [
    pytest.param("triton", torch.float32, marks=needs_triton, id="triton-fp32"),
    pytest.param("triton", torch.bfloat16, marks=[needs_triton, needs_cuda], id="triton-bf16"),
    pytest.param(
        "flashinfer",
        torch.bfloat16,
        marks=[needs_cuda, pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")],
        id="flashinfer-bf16",
    ),
]


@pytest.mark.parametrize(("backend", "dtype"), BACKEND_CASES)
def test_backend_matches_torch_through_prefill_decode_and_a_tree(
    dev: str, backend: str, dtype: torch.dtype, request: pytest.FixtureRequest
) -> None:
    path = model_for(backend, request)
    tokens, steps = scripted(make_runner(path, "torch", dev, dtype))
    ours, our_steps = scripted(make_runner(path, backend, dev, dtype))
    assert ours == tokens
    for out, ref in zip(our_steps, steps, strict=True):
        assert_close(out, ref, dtype)


def engine(path: str, dev: str, **options: object) -> LLMEngine:
    cfg = EngineConfig(
        model=path, device=dev, dtype="float32", block_size=BLOCK_SIZE, kv_cache_gb=0.001, **options
    )
    return LLMEngine(cfg, SpeculativeConfig(speculative_algorithm="NGRAM").resolved())


@needs_triton
def test_triton_engine_generates_the_torch_engines_tokens(dev: str, tiny: str) -> None:
    prompts = [list(PROMPTS[0]) * 2, list(PROMPTS[1])]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = engine(tiny, dev).generate(prompts, params)
    triton = engine(tiny, dev, attention_backend="triton")
    assert triton.runner.fused is None  # the chosen backend runs every step
    assert triton.generate(prompts, params) == reference
    assert triton.speculator.stats.steps > 0  # NGRAM drafts were verified


@needs_triton
def test_static_decode_step_matches_eager(dev: str, tiny: str) -> None:
    """The forward a CUDA graph records (fixed buffers, batch padded by its last row) gives
    the eager step's logits and leaves the same K/V."""
    from specmesh.shared.runner.cuda_graph import StaticStep

    eager, static = (make_runner(tiny, "triton", dev, torch.float32) for _ in range(2))
    prefill = [(0, 0, list(PROMPTS[0]), None), (1, 0, list(PROMPTS[1]), None)]
    decode = [(0, 9, [5], None), (1, 6, [8], None)]
    forward(eager, prefill)
    forward(static, prefill)
    ref = forward(eager, decode)
    model, cache = static.model, static.kv_cache
    attention = model.layers[0].self_attn.backend.static_decode(
        4, 10, BLOCK_SIZE, cache.storage.device
    )
    step = StaticStep(model.forward, cache, attention, 4, ())
    spans = [SequenceSpan(TABLES[seq], cached, 1) for seq, cached, _, _ in decode]
    ids = torch.tensor([5, 8], device=dev)
    with torch.inference_mode():  # as the runner steps
        step.load(spans, ids, torch.tensor([9, 6], device=dev))
        hidden, _ = step.forward()
        logits = model.compute_logits(hidden[:2])
    assert hidden.shape[0] == 4
    assert_close(logits.float().cpu(), ref, torch.float32)
    assert torch.allclose(static.kv_cache.storage, eager.kv_cache.storage, atol=1e-6)


@pytest.mark.unit
def test_capture_sizes() -> None:
    from specmesh.shared.runner.cuda_graph import capture_sizes

    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


@pytest.mark.unit
def test_flashinfer_page_lists_and_mask_are_the_torch_backends_slots_and_masks() -> None:
    tree = DraftTree([1, 2, 3, 4, 5], [-1, 0, 0, 1, 1]).ancestor_mask()
    spans = [
        SequenceSpan([5, 2, 9], 7, 3),  # a chunk after cached tokens, ending inside a block
        SequenceSpan([1, 4], 4, 1),  # a decode row opening a new block
        SequenceSpan([8, 3, 6], 2, 5, tree),
    ]
    table = page_table(spans, BLOCK_SIZE)
    ref = TorchAttention().prepare(spans, BLOCK_SIZE, torch.device("cpu"))
    assert table.qo_indptr.tolist() == [0, 3, 4, 9]
    assert torch.equal(table.slot_mapping, ref.slot_mapping)
    for i, span in enumerate(spans):
        pages = table.kv_indices[table.kv_indptr[i] : table.kv_indptr[i + 1]].long()
        slots = (pages[:, None] * BLOCK_SIZE + torch.arange(BLOCK_SIZE)).flatten()
        length = (len(pages) - 1) * BLOCK_SIZE + int(table.last_page_len[i])
        total = span.num_cached + span.num_new
        assert torch.equal(slots[:length], context_slots(span.block_table, total, BLOCK_SIZE))
    masks = custom_mask(spans).split([s.num_new * (s.num_cached + s.num_new) for s in spans])
    extends = [mask for _, _, _, mask in ref.extends]  # the chunk's and the tree's
    assert extends[0] is None  # causal over its prefix: on CPU, attended without a mask
    assert torch.equal(masks[0].view(3, 10), torch.ones(3, 10, dtype=torch.bool).tril(7))
    assert masks[1].all()  # a decode row sees its whole context
    assert torch.equal(masks[2].view(5, 7), extends[1])


@pytest.mark.skipif(CUDA, reason="checks the refusal where there is no CUDA")
def test_flashinfer_refuses_to_start_without_cuda(tiny: str) -> None:
    with pytest.raises(ValueError, match="flashinfer needs a CUDA device"):
        LLMEngine(EngineConfig(model=tiny, attention_backend="flashinfer"))


@needs_triton
@pytest.mark.skipif(CUDA, reason="checks the refusal where there is no CUDA")
def test_triton_refuses_cpu_outside_the_interpreter(
    dev: str, tiny: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specmesh.shared.model.triton_attention  # noqa: F401  (its kernels defined for the interpreter)

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        LLMEngine(EngineConfig(model=tiny, attention_backend="triton"))


def test_a_narrower_kv_cache_needs_the_torch_backend(tiny: str) -> None:
    cfg = EngineConfig(
        model=tiny, attention_backend="triton", dtype="float32", kv_cache_dtype="bf16"
    )
    with pytest.raises(ValueError, match="needs --attention-backend torch"):
        LLMEngine(cfg)


@pytest.mark.unit
def test_gpu_options_parse_and_show_in_specmesh_up_help(capsys: pytest.CaptureFixture) -> None:
    from specmesh.services.cli import _UP_CONFIGS, main

    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig)
    args = ["--cuda-graph-max-bs", "8", "--disable-cuda-graph", "--enable-torch-compile"]
    cfg = dataclass_from_args(EngineConfig, parser.parse_args(args))
    assert (cfg.cuda_graph_max_bs, cfg.disable_cuda_graph, cfg.enable_torch_compile) == (
        8,
        True,
        True,
    )
    fields = [f for cls in _UP_CONFIGS.values() for f in cls.__dataclass_fields__]
    assert fields.count("cuda_graph_max_bs") == 1  # defined once, where the engine reads it
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--cuda-graph-max-bs", "--disable-cuda-graph", "--enable-torch-compile"):
        assert flag in help_text
    assert "{torch,triton,flashinfer}" in help_text


@pytest.mark.skipif(CUDA, reason="checks CPU behaviour")
def test_gpu_options_change_nothing_on_cpu(tiny: str, caplog: pytest.LogCaptureFixture) -> None:
    prompts = [list(PROMPTS[0]), list(PROMPTS[1])]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = LLMEngine(EngineConfig(model=tiny))
    with caplog.at_level(logging.WARNING):
        gpu = LLMEngine(EngineConfig(model=tiny, cuda_graph_max_bs=2, enable_torch_compile=True))
    assert "--enable-torch-compile is ignored on CPU" in caplog.text
    assert gpu.runner.graphs is None
    assert gpu.runner.fused is not None and plain.runner.fused is not None
    assert gpu.generate(prompts, params) == plain.generate(prompts, params)


@needs_cuda
@pytest.mark.parametrize(
    ("backend", "options"),
    [
        pytest.param("triton", {}, marks=needs_triton, id="triton"),
        pytest.param(
            # fp32: compiled kernels round bf16 differently, which parts greedy paths
            "triton",
            {"enable_torch_compile": True, "dtype": "float32"},
            marks=needs_triton,
            id="compiled",
        ),
        pytest.param(
            "flashinfer",
            {"dtype": "bfloat16"},
            marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer"),
            id="flashinfer",
        ),
    ],
)
def test_cuda_graph_decode_gives_the_eager_tokens(
    backend: str, options: dict[str, object], request: pytest.FixtureRequest
) -> None:
    path = model_for(backend, request)
    prompts = [list(PROMPTS[0]), list(PROMPTS[1]), [9, 9, 2]]  # 3 rows: padded to 4
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def cuda_engine(**more: object) -> LLMEngine:
        cfg = EngineConfig(model=path, device="cuda", attention_backend=backend, **options, **more)
        return LLMEngine(cfg)

    graphed = cuda_engine(cuda_graph_max_bs=4)
    assert graphed.generate(prompts, params) == cuda_engine(disable_cuda_graph=True).generate(
        prompts, params
    )
    assert graphed.runner.graphs.steps  # decode steps replayed graphs
