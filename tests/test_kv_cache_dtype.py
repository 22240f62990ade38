"""`--kv-cache-dtype` (K/V stored narrower than the model computes, read back in its dtype)
and `--mem-fraction-static` (the KV cache sized as SGLang sizes it on a GPU), on a tiny
random fp32 model."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import tiny_llama
from specmesh.services import cli
from specmesh.services.launcher import Configs
from specmesh.shared.config import add_dataclass_args, dataclass_from_args, resolve_kv_cache_dtype
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.exchange import KVExchange, kv_description, model_fingerprint
from specmesh.shared.kvcache.kv_cache import KVCache, blocks_for_mem_fraction
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.transport.shm import ShmTransport

CPU = torch.device("cpu")
VOCAB = 128
BLOCK = 4
GIB = 2**30
KV_MEMORY_GB = 2**-9  # 2 MiB: whole blocks of every dtype, so block counts compare exactly
# Worst relative logit error against fp32 K/V over a prefill and decode steps on the tiny
# model, whose random weights make attention sharp (measured over 4 prompts: bf16 8e-3,
# float16 1e-3, fp8_e4m3 0.12, fp8_e5m2 0.36), with room to spare.
TOLERANCE = {"bf16": 2e-2, "float16": 5e-3, "fp8_e4m3": 0.25, "fp8_e5m2": 0.6}
PROMPT = 11


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("kvdtype") / "m", VOCAB, seed=0, hidden=64, layers=2)


def engine(model: str, kv_cache_dtype: str = "auto", **options: Any) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=model,
            kv_cache_gb=KV_MEMORY_GB,
            block_size=BLOCK,
            kv_cache_dtype=kv_cache_dtype,
            **options,
        )
    )


def cache_of(model: torch.nn.Module, dtype: torch.dtype, blocks: int = 8) -> KVCache:
    return KVCache(model.config, blocks, BLOCK, CPU, dtype)


def logits_of(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits of a PROMPT-token prefill, then of the rest of `ids` one decode step each (the
    fused decoder's size), over the paged cache."""
    table = list(range(len(ids) // BLOCK + 1))
    first = [SequenceSpan(table, 0, PROMPT)], ids[:PROMPT], list(range(PROMPT)), [PROMPT - 1]
    rows = [eng.runner.forward(*first)[0]]
    for pos in range(PROMPT, len(ids)):
        rows.append(eng.runner.forward([SequenceSpan(table, pos, 1)], [ids[pos]], [pos], [0])[0])
    return torch.cat(rows)


def test_the_cache_holds_the_chosen_dtype_and_its_size_counts(tiny: str) -> None:
    full = engine(tiny)
    assert full.kv_cache.dtype == torch.float32  # auto: the model's
    assert full.runner.fused is not None  # fp32 K/V: few-row steps take the C++ decoder
    for name, dtype in [
        ("bf16", torch.bfloat16),
        ("bfloat16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp8_e4m3", torch.float8_e4m3fn),
        ("fp8_e5m2", torch.float8_e5m2),
    ]:
        narrow = engine(tiny, name)
        assert narrow.kv_cache.dtype == dtype
        assert all(t.dtype == dtype for kv in narrow.kv_cache.layers for t in kv)
        # The same memory holds proportionally more blocks.
        assert narrow.kv_cache.num_blocks == full.kv_cache.num_blocks * 4 // dtype.itemsize
        # The fused decoder reads fp32 caches in place: these steps go the torch way.
        assert narrow.runner.fused is None


@pytest.mark.parametrize("name", list(TOLERANCE))
def test_logits_stay_close_to_fp32_kv(tiny: str, name: str) -> None:
    ids = torch.randint(3, VOCAB, (PROMPT + 6,), generator=torch.Generator().manual_seed(1))
    full, narrow = engine(tiny), engine(tiny, name)
    full.runner.fused = None  # the path narrow K/V take: only the K/V dtype differs
    ref, ours = logits_of(full, ids.tolist()), logits_of(narrow, ids.tolist())
    assert torch.isfinite(ours).all()
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert 0 < err < TOLERANCE[name], f"{name}: max relative logit error {err:.2e}"
    # The first layer's K/V are computed alike; the cache holds them cast to its dtype.
    first = full.kv_cache.storage[0, :, : len(ids)].to(narrow.kv_cache.dtype)
    assert torch.equal(first.float(), narrow.kv_cache.storage[0, :, : len(ids)].float())


def test_fp8_kv_serves_requests(tiny: str) -> None:
    """The whole engine (chunked prefill, batched decode) on an fp8 cache."""
    eng = engine(tiny, "fp8_e4m3", max_num_batched_tokens=8)
    prompts = [[5, 9, 17, 33, 2, 71, 40, 8, 8, 12], [100, 3, 64]]
    outputs = eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))
    assert [len(out) for out in outputs] == [6, 6]
    assert all(0 <= token < VOCAB for out in outputs for token in out)


def test_the_fingerprint_names_the_kv_dtype(tiny: str) -> None:
    model = engine(tiny).model
    dtypes = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    prints = {model_fingerprint(model, cache_of(model, dtype)) for dtype in dtypes}
    assert len(prints) == len(dtypes)  # other bytes, other keys
    bf16 = cache_of(model, torch.bfloat16)
    assert "float32, KV bfloat16, block size 4" in kv_description("m", model, bf16)


@pytest.fixture
def transport() -> Iterator[ShmTransport]:
    store = ShmTransport(f"test-{uuid.uuid4().hex[:8]}")
    yield store
    store.remove_all()


def test_blocks_travel_in_the_kv_dtype(tiny: str, transport: ShmTransport) -> None:
    model = engine(tiny).model
    src, dst = cache_of(model, torch.float8_e4m3fn), cache_of(model, torch.float8_e4m3fn)
    src.storage.copy_(torch.randn(src.storage.shape).to(src.dtype))
    prefill = KVExchange(src, transport, "fp", 60, "prefill")
    keys = prefill.keys(list(range(2 * BLOCK - 1)))
    prefill.export([3, 5], keys)  # a full block and one of 3 tokens
    assert transport.bytes_written == src.storage[:, :, : 2 * BLOCK - 1].numel()  # 1 byte each
    KVExchange(dst, transport, "fp", 60, "decode").load([6, 1], keys, 0)
    for s, d, n in ((3, 6, BLOCK), (5, 1, BLOCK - 1)):
        sent = src.storage[:, :, s * BLOCK : s * BLOCK + n].view(torch.uint8)
        assert torch.equal(sent, dst.storage[:, :, d * BLOCK : d * BLOCK + n].view(torch.uint8))
    # A block of another KV dtype is other bytes: computed again, never misread.
    bf16 = KVExchange(cache_of(model, torch.bfloat16), transport, "fp", 60, "decode")
    with pytest.raises(KeyError, match="bytes"):
        bf16.load([0, 1], keys, 0)


def test_features_travel_in_the_model_dtype_beside_narrow_kv(
    tiny: str, transport: ShmTransport
) -> None:
    model = engine(tiny).model
    exchange = KVExchange(cache_of(model, torch.bfloat16), transport, "fp", 60, "prefill")
    keys = exchange.keys(list(range(2 * BLOCK)))
    rows = torch.randn(2 * BLOCK, 64)
    exchange.export_features(keys, "0", rows, first_block=0)
    start, loaded = exchange.load_features(keys, "0", torch.float32)
    assert start == 0 and torch.equal(loaded, rows)


def test_mem_fraction_sizing() -> None:
    # 80 GiB free at start, 16 GiB of weights, 0.9 of it static: 56 GiB of 1 MiB blocks.
    assert blocks_for_mem_fraction(0.9, 80 * GIB, 64 * GIB, 2**20) == 56 * 1024
    assert blocks_for_mem_fraction(0.5, 80 * GIB, 64 * GIB, 2**20) == 24 * 1024
    # Partial blocks do not count; exactly one sequence's worth is enough.
    assert blocks_for_mem_fraction(0.25, 4 * GIB, 4 * GIB, GIB // 2 + 1) == 1
    assert blocks_for_mem_fraction(0.25, 4 * GIB, 4 * GIB, GIB // 4, min_blocks=4) == 4
    with pytest.raises(ValueError, match="one sequence needs 5"):
        blocks_for_mem_fraction(0.25, 4 * GIB, 4 * GIB, GIB // 4, min_blocks=5)
    # The weights alone take more than the fraction: no room at all.
    with pytest.raises(ValueError, match=r"16\.00 GiB of weights, leaves 0\.00 GiB"):
        blocks_for_mem_fraction(0.1, 80 * GIB, 64 * GIB, 2**20)
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match="must be in"):
            blocks_for_mem_fraction(bad, 80 * GIB, 64 * GIB, 2**20)


def test_mem_fraction_leaves_a_cpu_cache_to_kv_cache_gb(tiny: str) -> None:
    sized = engine(tiny, mem_fraction_static=0.01)
    assert sized.kv_cache.num_blocks == engine(tiny).kv_cache.num_blocks


def _up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    for cls in cli._UP_CONFIGS.values():
        add_dataclass_args(parser, cls)
    return parser


def test_bad_kv_dtypes_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("fp4_e2m1", "int8", "fp8"):
        with pytest.raises(SystemExit):
            _up_parser().parse_args(["--kv-cache-dtype", bad])
        assert f"invalid choice: '{bad}'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype 'int8'"):
        resolve_kv_cache_dtype("int8", torch.float32, CPU)


def test_backends_that_read_kv_in_the_model_dtype_refuse_others(tiny: str) -> None:
    with pytest.raises(ValueError, match="bf16 needs --attention-backend torch"):
        engine(tiny, "bf16", attention_backend="triton")


def test_fp8_where_the_device_cannot_is_an_error_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fp8(self: torch.Tensor, *args: object) -> torch.Tensor:
        raise NotImplementedError(f'"index_select" not implemented for {self.dtype}')

    monkeypatch.setattr(torch.Tensor, "index_select", no_fp8)
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported on cpu"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32, CPU)


def test_up_shows_the_options_and_hands_them_to_prefill_and_decode(
    tiny: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["up", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "--kv-cache-dtype {auto,bfloat16,bf16,float16,fp8_e4m3,fp8_e5m2}" in shown
    assert "--mem-fraction-static" in shown
    argv = ["--model", tiny, "--kv-cache-dtype", "fp8_e4m3", "--mem-fraction-static", "0.4"]
    args = _up_parser().parse_args(argv)
    configs = Configs(**{n: dataclass_from_args(c, args) for n, c in cli._UP_CONFIGS.items()})
    for kind in ("prefill", "decode"):  # each parses its own command line back
        service = argparse.ArgumentParser()
        for config in configs.service_configs(kind):
            add_dataclass_args(service, type(config))
        got = dataclass_from_args(EngineConfig, service.parse_args(configs.service_argv(kind)))
        assert (got.kv_cache_dtype, got.mem_fraction_static) == ("fp8_e4m3", 0.4)
