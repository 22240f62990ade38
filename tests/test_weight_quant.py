"""Weight-only quantization of safetensors checkpoints: int8/int4 made at load, AWQ and GPTQ
int4 checkpoints read into Q4_1 blocks, fp8, quantized drafters, and the inputs refused
before serving. Each quantized model is held to the same weights dequantized, served on the
fp32 path: logits within tolerance, greedy tokens the same."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import GREEDY, PROMPTS, tiny_llama
from safetensors.torch import load_file, save_file
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.awq_gptq import Int4Layout, q4_1
from specmesh.shared.model.fp8 import fp8_weight
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.loader import load_model
from specmesh.shared.model.quantize import quantize_linears
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.speculative.config import HEADS_DIR, SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer
from test_quantized import MAX_REL_ERR, greedy, runner
from transformers import LlamaConfig, LlamaForCausalLM

CPU = torch.device("cpu")
CUDA = torch.cuda.is_available()
Q = gguf.GGMLQuantizationType
# Untied, so that the LM head's blocks change no embedding row; every input count a
# multiple of 128, so that groups of 32 to 128 fit; weights 5x transformers' default, so
# that its logits are peaked enough to have no near-ties for rounding to flip.
TINY = LlamaConfig(
    vocab_size=128,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    initializer_range=0.1,
)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AWQ/GPTQ: the activations' int16 error (MAX_REL_ERR) plus Q4_1's m = -s z rounded to fp16
# (at most s/128 a weight, the same for a block's 32 weights): 2-3e-3 measured on TINY.
INT4_REL_ERR = 5e-3
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble j holds column 8c + order[j]


def tiny_state(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.contiguous() for k, v in LlamaForCausalLM(TINY).state_dict().items()}


def write(path: Path, tensors: dict[str, torch.Tensor], quant: dict | None = None) -> Path:
    """A Hugging Face directory of TINY holding `tensors`, declaring `quant` if given."""
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY.to_dict(), "architectures": ["LlamaForCausalLM"]}
    if quant is not None:
        config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, path / "model.safetensors")
    return path


def is_projection(name: str) -> bool:
    return name.split(".")[-2] in PROJECTIONS or name == "lm_head.weight"


def same_model(ours: list[ModelRunner], ref: ModelRunner, max_err: float) -> None:
    """Prefill logits within `max_err` of the reference's largest, greedy tokens the same
    on every prompt, for each runner in `ours`."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        prompt = torch.randint(3, TINY.vocab_size, (12,), generator=gen).tolist()
        ref_tokens, ref_logits = greedy(ref, prompt, 6)
        for r in ours:
            tokens, logits = greedy(r, prompt, 6)
            err = (logits - ref_logits).abs().max() / ref_logits.abs().max()
            assert err < max_err, err.item()
            assert tokens == ref_tokens


# Per method: (the projections' block type, the LM head's).
AT_LOAD = {"int8": (Q.Q8_0, Q.Q8_0), "int4": (Q.Q4_1, Q.Q8_0), "bf16": (Q.BF16, Q.BF16)}


def expand(weight: torch.Tensor, kind: Q) -> torch.Tensor:
    """What blocks of `kind` made from `weight` hold, in fp32 (gguf-py's codecs)."""
    if kind == Q.BF16:
        return weight.bfloat16().float()
    return torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), kind), kind)
    )


@pytest.mark.parametrize("method", list(AT_LOAD))
def test_quantized_at_load_matches_its_dequantized_weights(method: str, tmp_path: Path) -> None:
    """int8 (Q8_0), int4 (Q4_1, the LM head Q8_0) and bf16 made at load, on the fused
    decoder and the torch path, against a checkpoint of the same blocks expanded."""
    state = tiny_state()
    kind, head_kind = AT_LOAD[method]
    kinds = {n: head_kind if n == "lm_head.weight" else kind for n in state}
    expanded = {n: expand(t, kinds[n]) if is_projection(n) else t for n, t in state.items()}
    path = write(tmp_path / "full", state)
    ours = [runner(path, method), runner(path, method, fused=False)]
    model = ours[0].model
    assert model.layers[1].mlp.down_proj.block_type == int(kind)
    assert model.lm_head.block_type == int(head_kind)
    same_model(ours, runner(write(tmp_path / "ref", expanded), None), MAX_REL_ERR)


def rtn_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, ...]:
    """Round-to-nearest asymmetric int4 per group of inputs, as AWQ and GPTQ store it (how
    their calibration picks s and z does not matter here): q [N, K], z and fp16 s
    [K/G, N], w ~ s (q - z). Zeros from 1: GPTQ's v1 format stores z - 1."""
    n, k = weight.shape
    groups = weight.reshape(n, k // group, group)
    lo, hi = groups.amin(-1), groups.amax(-1)
    s = ((hi - lo) / 15).half()
    z = (-lo / s.float()).round().clamp(1, 15)
    q = (groups / s.float()[..., None] + z[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).int(), z.T.int().contiguous(), s.T.contiguous()


GPTQ_ORDER = tuple(range(8))  # GPTQ packs in order


def pack(values: torch.Tensor, order: tuple[int, ...] = GPTQ_ORDER) -> torch.Tensor:
    """int [R, C] 4-bit values -> int32 [R, C/8]: nibble j of word c holds column 8c + order[j]
    (the loops of AutoGPTQ's and AutoAWQ's packers)."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for j, column in enumerate(order):
        words |= (values[:, column::8].long() & 15) << (4 * j)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def int4_parts(method: str, weight: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    """A projection as an AWQ or GPTQ checkpoint holds it, and s (q - z) in fp32."""
    q, z, s = rtn_int4(weight, weight.shape[1] if group == -1 else group)
    per_group = weight.shape[1] // len(s)
    s_k, z_k = (t.repeat_interleave(per_group, 0) for t in (s.float(), z))  # [K, N]
    expanded = (s_k * (q.T - z_k)).T.contiguous()
    if method == "awq":
        return {
            "qweight": pack(q.T, AWQ_ORDER),
            "qzeros": pack(z, AWQ_ORDER),
            "scales": s,
        }, expanded
    g_idx = (torch.arange(weight.shape[1]) // per_group).int()
    parts = {"qweight": pack(q).T.contiguous(), "qzeros": pack(z - 1), "scales": s, "g_idx": g_idx}
    return parts, expanded


def int4_config(method: str, group: int) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False}


def write_int4(tmp_path: Path, method: str, group: int) -> tuple[Path, Path]:
    """TINY as an AWQ or GPTQ checkpoint (its LM head left unquantized, as theirs are), and
    the same weights expanded to fp32 as a plain one."""
    state, quantized, expanded = tiny_state(), {}, {}
    for name, tensor in state.items():
        if name.split(".")[-2] not in PROJECTIONS:
            quantized[name] = expanded[name] = tensor
            continue
        parts, expanded[name] = int4_parts(method, tensor, group)
        quantized |= {f"{name.removesuffix('.weight')}.{p}": t for p, t in parts.items()}
    path = write(tmp_path / method, quantized, int4_config(method, group))
    return path, write(tmp_path / "expanded", expanded)


@pytest.mark.parametrize(
    ("method", "group"), [("awq", 32), ("awq", 128), ("gptq", 64), ("gptq", -1)]
)
def test_awq_and_gptq_checkpoints_match_their_dequantized_weights(
    method: str, group: int, tmp_path: Path
) -> None:
    """Read from config.json (no --quantization) and named: within INT4_REL_ERR of s (q - z)
    served in fp32, greedy tokens the same, on both paths."""
    path, expanded = write_int4(tmp_path, method, group)
    ours = [runner(path, None), runner(path, method, fused=False)]
    assert ours[0].model.layers[0].self_attn.qkv_proj.block_type == int(Q.Q4_1)
    assert ours[0].model.lm_head.block_type == 0  # unquantized in the checkpoint
    same_model(ours, runner(expanded, None), INT4_REL_ERR)


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_int4_groups_become_q4_1_blocks_exactly(method: str) -> None:
    """The Q4_1 bytes, expanded by gguf-py, are the weight the loader fills (d q + m), which
    is s (q - z) up to m's fp16 rounding: at most a 128th of the group's scale."""
    torch.manual_seed(0)
    weight = torch.randn(40, 256) * 0.05
    parts, expanded = int4_parts(method, weight, 64)
    layout = Int4Layout.from_config(method, int4_config(method, 64))
    blocks, ours = q4_1("p", *layout.unpacked("p", parts))
    assert blocks.shape == (40, 256 // 32 * 20)
    assert np.array_equal(gguf.quants.dequantize(blocks.numpy(), Q.Q4_1), ours.numpy())
    step = parts["scales"].float().repeat_interleave(64, 0).T
    assert ((ours - expanded).abs() <= step / 128 + 1e-7).all()


def fp8_expanded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each projection's weight as its e4m3 rows give it, scale * w8 (the LM
    head kept, as fp8 keeps it)."""
    expanded = dict(state)
    for name, tensor in state.items():
        if is_projection(name) and name != "lm_head.weight":
            w8, scale = fp8_weight(tensor)
            expanded[name] = w8.float() * scale[:, None]
    return expanded


def plain_runner(path: Path, device: torch.device, dtype: torch.dtype) -> ModelRunner:
    model = load_model(path, device, dtype)
    return ModelRunner(model, KVCache(model.config, 16, 4, device, dtype))


def test_fp8_weights_match_their_dequantized_weights(tmp_path: Path) -> None:
    """e4m3 rows with per-row scales: each weight within 2^-4 of itself (3 mantissa bits);
    a tiny model on them serves what the same weights expanded to fp32 do. Run on CPU past
    the loader's refusal: the torch ops are the ones CUDA runs."""
    torch.manual_seed(0)
    weight = torch.randn(48, 64)
    w8, scale = fp8_weight(weight)
    assert w8.dtype == torch.float8_e4m3fn
    assert ((w8.float() * scale[:, None] - weight).abs() <= weight.abs() / 16 + 1e-6).all()
    state = tiny_state()
    path = write(tmp_path / "full", state)
    model = load_model(path, CPU, torch.float32)
    quantize_linears(model, "fp8")
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32
    ours = ModelRunner(model, KVCache(model.config, 16, 4, CPU, torch.float32))
    same_model([ours], runner(write(tmp_path / "ref", fp8_expanded(state)), None), 1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fp8_on_cuda_matches_its_dequantized_weights(tmp_path: Path) -> None:
    """--quantization fp8 through the loader on CUDA in bf16, against the e4m3 rows expanded
    and served in bf16: logits within bf16's rounding of the expanded weights (2^-8 each).
    The weights are bf16 to start with (as a bf16 checkpoint's are): the loader rounds to
    the model's dtype before quantizing, and e4m3 rows made from other values differ."""
    state = {name: t.bfloat16().float() for name, t in tiny_state().items()}
    cuda = torch.device("cuda")
    model = load_model(write(tmp_path / "full", state), cuda, torch.bfloat16, quantization="fp8")
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    ours = ModelRunner(model, KVCache(model.config, 16, 4, cuda, torch.bfloat16))
    ref = plain_runner(write(tmp_path / "ref", fp8_expanded(state)), cuda, torch.bfloat16)
    prompt = list(range(3, 15))
    logits, want = (greedy(r, prompt, 1)[1].float() for r in (ours, ref))
    assert ((logits - want).abs().max() / want.abs().max()).item() < 3e-2


def spec_engine(model: str, **spec: object) -> LLMEngine:
    cfg = SpeculativeConfig(speculative_adaptive=False, **spec)  # type: ignore[arg-type]
    return LLMEngine(EngineConfig(model=model, kv_cache_gb=0.1), cfg)


@pytest.fixture(scope="module")
def smollm_greedy(smollm_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """Chat prompts for SmolLM2-135M and its greedy answers without drafting."""
    tok = Tokenizer(smollm_dir)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:3]]
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.1))
    return prompts, plain.generate(prompts, GREEDY)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "DFLASH", "STANDALONE"])
def test_quantized_drafters_keep_their_acceptance(
    algorithm: str, smollm_dir: Path, smollm_greedy: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The drafters that ship for SmolLM2 (an EAGLE-3 head, a DFLASH draft, a small LM),
    int4 with their LM heads int8: the output is still the target's own (verification is
    unchanged), and at least 70% of the unquantized drafter's acceptance: int4 costs up to
    ~10% here (STANDALONE), a broken drafter nearly all of it, and another CPU's rounding
    moves it a little."""
    prompts, want = smollm_greedy
    rates = []
    for method in (None, "int4"):
        engine = spec_engine(
            str(smollm_dir),
            speculative_algorithm=algorithm,
            speculative_draft_model_path=str(HEADS_DIR / f"SmolLM2-135M-Instruct-{algorithm}"),
            speculative_draft_model_quantization=method,
        )
        drafter = engine.speculator.drafter
        module = getattr(drafter, "head", None) or getattr(drafter, "draft", None)
        types = {
            m.block_type
            for m in (module or drafter.runner.model).modules()
            if isinstance(m, Linear)
        }
        assert (int(Q.Q4_1) in types) == (method == "int4")
        assert engine.generate(prompts, GREEDY) == want
        rates.append(engine.speculator.stats.acceptance_rate)
    assert rates[1] > 0.7 * rates[0] > 0


def with_config(path: Path, **changes: object) -> Path:
    """`path`'s checkpoint with its quantization_config changed."""
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= changes
    (path / "config.json").write_text(json.dumps(config))
    return path


def with_tensor(path: Path, name: str, change: object) -> Path:
    """`path`'s checkpoint with tensor `name` changed in place by `change`."""
    tensors = load_file(path / "model.safetensors")
    change(tensors[name])
    save_file(tensors, path / "model.safetensors")
    return path


def refused(path: Path, message: str, quantization: str | None = None, **kw: object) -> None:
    with pytest.raises(ValueError, match=message):
        load_model(
            path, kw.get("device", CPU), kw.get("dtype", torch.float32), quantization=quantization
        )


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")  # the NaN weight
def test_refused_before_serving(tmp_path: Path) -> None:
    """Unknown methods, methods the checkpoint contradicts or the device cannot run, groups
    not a multiple of 32, act-order GPTQ, other bit widths and layouts, non-finite scales
    or weights: each a ValueError naming the cause, before anything serves."""
    full = write(tmp_path / "full", tiny_state())
    refused(full, "unknown --quantization 'int3'", "int3")
    refused(full, "runs on CPU with fp32 activations", "int4", dtype=torch.bfloat16)
    refused(full, "reads a AWQ checkpoint, and .* declares no quantization_config", "awq")
    if not CUDA:
        with pytest.raises(ValueError, match="--quantization fp8 needs a CUDA GPU"):
            LLMEngine(EngineConfig(model=str(full), device="cpu", quantization="fp8"))
    awq, _ = write_int4(tmp_path / "a", "awq", 32)
    refused(awq, "holds awq weights, so --quantization int8 does not apply", "int8")
    refused(with_config(awq, group_size=48), "group_size 48 is not served")
    refused(with_config(awq, bits=8, group_size=32), "8-bit weights: only 4-bit")
    refused(with_config(awq, bits=4, version="gemv"), "AWQ version 'gemv'")
    refused(with_config(awq, quant_method="fp8"), "holds fp8-quantized weights")
    gptq, _ = write_int4(tmp_path / "g", "gptq", 32)
    refused(with_config(gptq, desc_act=True), "act-order GPTQ")
    g_idx = "model.layers.1.mlp.down_proj.g_idx"
    refused(
        with_config(with_tensor(gptq, g_idx, lambda t: t.copy_(t.flip(0))), desc_act=False),
        "g_idx reorders the inputs",
    )
    scales = "model.layers.0.mlp.up_proj.scales"
    awq, _ = write_int4(tmp_path / "b", "awq", 32)
    refused(
        with_tensor(awq, scales, lambda t: t.view(-1)[3].fill_(float("inf"))),
        "up_proj.scales has non-finite",
    )
    nan = with_tensor(
        full, "model.layers.0.self_attn.o_proj.weight", lambda t: t[2, 5].fill_(float("nan"))
    )
    refused(nan, "o_proj.weight has non-finite values", "int8")


@pytest.mark.parametrize(
    ("algorithm", "method", "message"),
    [
        ("EAGLE3", "awq", "EAGLE3 drafters are quantized at load"),
        ("DFLASH", "gguf", "DFLASH drafters are quantized at load"),
        ("NGRAM", "int8", "no draft model to quantize"),
    ],
)
def test_draft_quantization_is_checked_with_the_options(
    algorithm: str, method: str, message: str
) -> None:
    draft = None if algorithm == "NGRAM" else str(HEADS_DIR / f"SmolLM2-135M-Instruct-{algorithm}")
    spec = SpeculativeConfig(
        speculative_algorithm=algorithm,
        speculative_draft_model_path=draft,
        speculative_draft_model_quantization=method,
    )
    with pytest.raises(ValueError, match=message):
        spec.resolved()


@pytest.mark.skipif(CUDA, reason="checks the refusal where there is no CUDA")
def test_fp8_draft_refused_off_cuda(tmp_path: Path) -> None:
    target = tiny_llama(tmp_path / "tiny", vocab=256, seed=0, hidden=64)
    with pytest.raises(
        ValueError, match="--speculative-draft-model-quantization fp8 needs a CUDA GPU"
    ):
        spec_engine(
            target,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=target,
            speculative_draft_model_quantization="fp8",
        )
