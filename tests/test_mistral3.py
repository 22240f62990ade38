"""Mistral3 (Pixtral encoder + projector + Mistral text model) with image input, against
transformers' Mistral3ForConditionalGeneration.

A tiny random checkpoint written by transformers, SmolLM2's tokenizer with Pixtral's
`[IMG]`, `[IMG_BREAK]`, `[IMG_END]` added as special tokens: preprocessing as the
processor's, features and logits, greedy tokens through the engine (one image, two,
none; one by one and 8 at a time; chunked prefill splitting an image; NGRAM), prefix
caching keyed by image, and chat requests with image_url parts through `specmesh up`.
"""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from deployment import chat, specmesh_up
from PIL import Image
from safetensors.torch import load_file, save_file
from specmesh.shared.core.images import PromptImage
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan
from specmesh.shared.model.loader import load_model
from specmesh.shared.multimodal.data_url import image_bytes
from specmesh.shared.multimodal.preprocess import ImageProcessing, image_token_ids
from specmesh.shared.multimodal.prompt import ImagePrompts
from specmesh.shared.runner.model_runner import ModelRunner
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer
from test_model_variants import CPU, assert_close
from tokenizers import Tokenizer as HFTokenizer
from transformers import Mistral3Config, Mistral3ForConditionalGeneration
from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

VOCAB = 49160  # SmolLM2's 49152 and the three image tokens, rounded up
LONGEST_EDGE = 56  # the processor's resize limit here: larger images shrink
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LAYOUT = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def png(height: int, width: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def hf_config(image_token: int) -> Mistral3Config:
    return Mistral3Config(
        text_config={
            "model_type": "mistral",
            "vocab_size": VOCAB,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "max_position_embeddings": 1024,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "eos_token_id": 2,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": LONGEST_EDGE,
            "hidden_act": "silu",
        },
        image_token_index=image_token,
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )


@pytest.fixture(scope="module")
def m3(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(model dir, transformers' model, our tokenizer, image processing)."""
    path = tmp_path_factory.mktemp("mistral3")
    tok = HFTokenizer.from_file(str(smollm_dir / "tokenizer.json"))
    tok.add_special_tokens(list(LAYOUT))
    tok.save(str(path / "tokenizer.json"))
    shutil.copy(smollm_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    torch.manual_seed(0)
    hf = Mistral3ForConditionalGeneration(hf_config(tok.token_to_id("[IMG]"))).eval()
    with torch.no_grad():
        for p in hf.parameters():  # norms too, so that they matter
            p.normal_(0, 0.2)
    hf.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"longest_edge": LONGEST_EDGE}, "patch_size": {"height": 14}})
    )
    return path, hf, Tokenizer(path), ImageProcessing.from_model_dir(path, 28)


def hf_pixels(images: list[PromptImage]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values [N, 3, Hmax, Wmax] (zero-padded, as the processor batches) and sizes."""
    h = max(i.pixels.shape[1] for i in images)
    w = max(i.pixels.shape[2] for i in images)
    out = torch.zeros(len(images), 3, h, w)
    for n, image in enumerate(images):
        mean = torch.tensor(image.mean)[:, None, None]
        std = torch.tensor(image.std)[:, None, None]
        _, ih, iw = image.pixels.shape
        out[n, :, :ih, :iw] = (image.pixels.double() * image.rescale - mean) / std
    return out, torch.tensor([list(i.pixels.shape[1:]) for i in images])


def prompt(m3: tuple, text: str, images: list[bytes]) -> tuple[list[int], list[PromptImage]]:
    """A user message of `text` with `[IMG]` where each image goes, as the tokenizer
    service makes it: the chat template, then each placeholder expanded."""
    path, _, tok, _ = m3
    ids = tok.encode_chat([{"role": "user", "content": text}])
    if not images:
        return ids, []
    return ImagePrompts(path, tok).expand(ids, images)


def hf_generate(hf: Mistral3ForConditionalGeneration, ids: list[int], images: list) -> list[int]:
    kwargs = {}
    if images:
        kwargs["pixel_values"], kwargs["image_sizes"] = hf_pixels(images)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, **kwargs)
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def cases(m3: tuple) -> list[tuple[list[int], list[PromptImage], list[int]]]:
    """(prompt ids, images, transformers' greedy tokens): one image, two of different
    sizes, text only, an image resized to fit, several of each."""
    specs = [
        ("What is in [IMG]?", [png(28, 42, 0)]),
        ("Compare [IMG] with [IMG] please.", [png(28, 42, 1), png(42, 28, 2)]),
        ("Say something about the sea.", []),
        ("[IMG] Describe it.", [png(100, 60, 3)]),
        ("Tell me: [IMG]", [png(30, 30, 4)]),
        ("Two: [IMG][IMG]", [png(56, 56, 5), png(28, 28, 6)]),
        ("A short poem about rivers.", []),
        ("What colour is [IMG]?", [png(28, 42, 7)]),
    ]
    hf = m3[1]
    out = []
    for text, images in specs:
        ids, prepared = prompt(m3, text, images)
        out.append((ids, prepared, hf_generate(hf, ids, prepared)))
    return out


def run(engine: LLMEngine, batch: list[tuple[list[int], list[PromptImage]]]) -> list[list[int]]:
    """Greedy tokens of each (prompt ids, images), all added before the first step."""
    ids = [f"r{i}-{len(engine.sequences)}-{engine.stats.steps}" for i in range(len(batch))]
    for rid, (prompt_ids, images) in zip(ids, batch, strict=True):
        engine.add_request(rid, prompt_ids, GREEDY, images=images or None)
    results: dict[str, list[int]] = {rid: [] for rid in ids}
    while any(rid in engine.sequences for rid in ids):
        for o in engine.step():
            results[o.request_id].append(o.token_id)
    return [results[rid] for rid in ids]


def engine_for(path: Path, spec: SpeculativeConfig | None = None, **cfg: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), kv_cache_gb=0.05, **cfg), spec)  # type: ignore[arg-type]


# --- preprocessing and the model ----------------------------------------------------------


@pytest.mark.parametrize("size", [(28, 42), (100, 60), (13, 70), (56, 56)])
def test_preprocessing_matches_the_processor(m3: tuple, size: tuple[int, int]) -> None:
    processing = m3[3]
    data = png(*size, seed=9)
    image = processing.prepare(data)
    ref = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": 28, "width": 28}
    )(images=[Image.open(io.BytesIO(data))], return_tensors="pt")
    assert list(image.pixels.shape[1:]) == ref["image_sizes"][0].tolist()
    pixels, _ = hf_pixels([image])
    assert_close(pixels, ref["pixel_values"], "normalized pixels")


def test_image_token_layout() -> None:
    """Rows of [IMG] each closed by [IMG_BREAK], the last by [IMG_END]."""
    image = PromptImage(torch.zeros(3, 56, 84, dtype=torch.uint8), (0.5,) * 3, (0.5,) * 3, 1.0)
    assert image_token_ids(image, 28, (1, 2, 3)) == [1, 1, 1, 2, 1, 1, 1, 3]


def test_features_and_logits_match_transformers(m3: tuple, cases: list) -> None:
    path, hf, _, _ = m3
    model = load_model(path, CPU, torch.float32)
    runner = ModelRunner(model, KVCache(model.config, 64, 16, CPU, torch.float32))
    for ids, images, _ in cases[:2]:
        pixel_values, sizes = hf_pixels(images)
        with torch.no_grad():
            ref_features = hf.model.get_image_features(pixel_values=pixel_values, image_sizes=sizes)
            ref = hf(input_ids=torch.tensor([ids]), pixel_values=pixel_values, image_sizes=sizes)
        features = model.vision.encode(images)
        assert_close(features, torch.cat(ref_features.pooler_output), "image features")
        token = model.config.vision.image_token_id
        rows = torch.tensor([i for i, t in enumerate(ids) if t == token])
        n = len(ids)
        span = SequenceSpan(list(range(-(-n // 16))), 0, n)
        logits, _ = runner.forward(
            [span], ids, list(range(n)), list(range(n)), (), (rows, features)
        )
        assert_close(logits, ref.logits[0], "logits")


def test_loads_both_checkpoint_layouts(m3: tuple, tmp_path: Path) -> None:
    """transformers writes `language_model.model.*` or `model.language_model.*` (newer)."""
    path = m3[0]
    state = load_file(path / "model.safetensors")
    renamed = {}
    for key, value in state.items():
        for old, new in (
            ("language_model.model.", "model.language_model."),
            ("language_model.lm_head.", "lm_head."),
            ("vision_tower.", "model.vision_tower."),
            ("multi_modal_projector.", "model.multi_modal_projector."),
        ):
            if key.startswith(old):
                key = new + key.removeprefix(old)
                break
        renamed[key] = value
    assert renamed.keys() != state.keys()
    other = tmp_path / "renamed"
    other.mkdir()
    for f in path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, other / f.name)
    save_file(renamed, other / "model.safetensors")
    a = load_model(path, CPU, torch.float32).state_dict()
    b = load_model(other, CPU, torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- the engine -----------------------------------------------------------------------------


def test_greedy_tokens_match_transformers(m3: tuple, cases: list) -> None:
    """One by one (one image, two, none, one resized), then 8 at a time (images and
    text-only prompts in one batch)."""
    engine = engine_for(m3[0])
    batch = [(ids, images) for ids, images, _ in cases]
    ref = [tokens for _, _, tokens in cases]
    assert [run(engine, [item])[0] for item in batch[:4]] == ref[:4]
    assert run(engine, batch) == ref
    assert engine.block_manager.num_free == engine.kv_cache.num_blocks


def test_chunked_prefill_splits_an_image(m3: tuple, cases: list) -> None:
    """A prompt alone whose first chunk ends after its first image token (the image's
    features serve two chunks); then all prompts at once in steps of 7 tokens."""
    ids, images, ref = cases[1]
    first_chunk = ids.index(m3[1].config.image_token_index) + 1
    engine = engine_for(m3[0], max_num_batched_tokens=first_chunk)
    assert run(engine, [(ids, images)]) == [ref]
    engine = engine_for(m3[0], max_num_batched_tokens=7)
    assert run(engine, [(ids, images) for ids, images, _ in cases]) == [t for *_, t in cases]


def test_prefix_cache_is_keyed_by_image(m3: tuple) -> None:
    """Same text and image: the prompt's blocks are reused. Same text, another image of
    the same size (the same token ids): nothing from the image's block on is reused, and
    the output is that image's."""
    text = (
        "Look at [IMG] and describe it in detail: the colours, the shapes, the light, and "
        "anything else you notice, in three short sentences of plain English."
    )
    first, second = png(28, 42, 20), png(28, 42, 21)
    ids_a, images_a = prompt(m3, text, [first])
    ids_b, images_b = prompt(m3, text, [second])
    assert ids_a == ids_b
    ref_b = hf_generate(m3[1], ids_b, images_b)
    engine = engine_for(m3[0])
    bs = engine.block_manager.block_size
    run(engine, [(ids_a, images_a)])
    reused = engine.block_manager.reused_tokens
    assert run(engine, [(ids_b, images_b)]) == [ref_b]
    image_block = ids_a.index(engine.model.config.vision.image_token_id) // bs
    assert image_block < (len(ids_a) - 1) // bs - 1  # full blocks after the image's
    assert engine.block_manager.reused_tokens - reused == image_block * bs
    reused = engine.block_manager.reused_tokens
    assert run(engine, [(ids_b, images_b)]) == [ref_b]
    assert engine.block_manager.reused_tokens - reused == (len(ids_b) - 1) // bs * bs


def test_ngram_speculation_is_lossless_with_images(m3: tuple, cases: list) -> None:
    engine = engine_for(m3[0], SpeculativeConfig("NGRAM"))
    batch = [(ids, images) for ids, images, _ in cases]
    assert [run(engine, [item])[0] for item in batch[:4]] == [t for *_, t in cases[:4]]
    assert engine.speculator.stats.draft_tokens > 0


def test_images_are_refused_where_they_cannot_go(m3: tuple, smollm_dir: Path) -> None:
    ids, images = prompt(m3, "[IMG]", [png(28, 28, 0)])
    engine = engine_for(m3[0])
    image_token = engine.model.config.vision.image_token_id
    with pytest.raises(ValueError, match="image tokens"):
        engine.add_request("too-few", [t for t in ids if t != image_token], GREEDY, images=images)
    with pytest.raises(ValueError, match="no vision encoder"):
        ImagePrompts(smollm_dir, Tokenizer(smollm_dir)).expand([1, 2], [png(28, 28, 0)])
    with pytest.raises(ValueError, match="cannot be decoded"):
        m3[3].prepare(b"not an image")
    with pytest.raises(ValueError, match="not fetched"):
        image_bytes("https://example.com/cat.png")


# --- over HTTP ------------------------------------------------------------------------------


def test_specmesh_up_serves_images(m3: tuple, cases: list) -> None:
    """Prefill, decode and an NGRAM drafter as separate processes: transformers' text for
    chat requests with images; bad images are 400s with OpenAI's error JSON."""
    path, _, tok, _ = m3
    image = png(28, 42, 0)
    content = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": data_url(image)}},
        {"type": "text", "text": "?"},
    ]
    bad = {
        "malformed base64": "data:image/png;base64,@@not base64@@",
        "not an image": data_url(b"just some text, no image"),
        "http URL": "http://example.com/cat.png",
        "oversized": data_url(png(120, 120, 1)),
    }
    args = ("--speculative-algorithm", "NGRAM", "--max-image-pixels", "10000")
    with specmesh_up(path, *args) as url:
        response = chat(url, content, temperature=0, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == tok.decode(cases[0][2])
        # the same text with another image: prefill's cache and the KV store miss it
        other = png(28, 42, 30)
        ids, images = prompt(m3, "What is in [IMG]?", [other])
        content[1] = {"type": "image_url", "image_url": {"url": data_url(other)}}
        response = chat(url, content, temperature=0, max_tokens=MAX_TOKENS)  # type: ignore[arg-type]
        text = response.json()["choices"][0]["message"]["content"]
        assert text == tok.decode(hf_generate(m3[1], ids, images))
        for name, image_url in bad.items():
            parts = [{"type": "image_url", "image_url": {"url": image_url}}]
            response = chat(url, parts, max_tokens=2)  # type: ignore[arg-type]
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"], name
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 200
