"""shared/tokenizer.py against the real SmolLM2 tokenizer and transformers' chat templating."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from specmesh.shared.tokenizer import IncrementalDetokenizer, TextStream, Tokenizer

MULTIBYTE_TEXT = (
    "Héllo wörld! 你好，世界 🎉🚀 naïve café — ½ 12345  spaces\n\ttab "
    "👩‍👩‍👧 Ünïcödé 日本語のテキスト Ελληνικά русский 🇫🇷 end."
)

CONVERSATIONS = {
    "user-only": [{"role": "user", "content": "Hi there!"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi-turn": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one,\nplease 🙂"},
    ],
    "system-multi-turn": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Bonjour ! Ça va ?"},
        {"role": "user", "content": "  spaced   out  "},
    ],
}


@pytest.fixture(scope="module")
def tok(smollm_dir: Path) -> Tokenizer:
    return Tokenizer(smollm_dir)


@pytest.fixture(scope="module")
def hf_tok(smollm_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_dir)


def _ids(result: Any) -> list[int]:
    """transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True)."""
    return list(result if isinstance(result, list) else result["input_ids"])


# --- encode / decode ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        " leading space and trailing space ",
        "line one\nline two\n\n\ttabbed",
        MULTIBYTE_TEXT,
        "def f(x):\n    return x ** 2  # 1234567890",
    ],
)
def test_encode_decode_round_trip(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert ids == hf_tok.encode(text, add_special_tokens=False)


def test_special_tokens_and_digits(tok: Tokenizer) -> None:
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.vocab_size == 49152
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"  # specials skipped by default
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    # SmolLM2 splits every digit into its own token.
    assert len(tok.encode("12345")) == 5


# --- chat template ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_encode_chat_matches_transformers(tok: Tokenizer, hf_tok: Any, name: str) -> None:
    messages = CONVERSATIONS[name]
    ours = tok.encode_chat(messages)
    ref = _ids(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    assert ours == ref
    assert tok.decode(ours, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    has_system = messages[0]["role"] == "system"
    default_system = "You are a helpful AI assistant named SmolLM"
    assert (default_system in tok.apply_chat_template(messages)) != has_system


@pytest.mark.parametrize("name", ["user-only", "multi-turn"])
def test_chat_template_without_generation_prompt(tok: Tokenizer, hf_tok: Any, name: str) -> None:
    messages = CONVERSATIONS[name]
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert text == hf_tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert not text.endswith("<|im_start|>assistant\n")


# Templates using what transformers' Jinja environment adds: loop controls, its `tojson`
# (non-ASCII kept, indent), the `generation` block; each against transformers' rendering.
FEATURE_TEMPLATES = [
    "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
    "{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m | tojson }}{% endfor %}{{ tools | tojson(indent=2) }}",
    "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content }}{% endgeneration %}{% else %}[{{ m.content }}]{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", FEATURE_TEMPLATES)
def test_template_features_render_as_in_transformers(
    smollm_dir: Path, hf_tok: Any, tmp_path: Path, template: str
) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    ours = Tokenizer(smollm_dir, chat_template=path)
    messages = CONVERSATIONS["system-multi-turn"]
    tools = [{"name": "météo", "parameters": {"ville": "Zürich"}}]
    text = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=False)
    reference = hf_tok.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False
    )
    assert text == reference and text


# --- incremental detokenization ---------------------------------------------------------------


def _stream_deltas(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    return [detok.add([i]) for i in ids]


def test_incremental_detokenization_of_multibyte_text(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT)
    # The text really does split characters across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    deltas = _stream_deltas(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE_TEXT
    # Whole characters are released as soon as they are complete.
    for n in range(1, len(ids) + 1):
        so_far = "".join(deltas[:n])
        full = tok.decode(ids[:n])
        if not full.endswith("\ufffd"):
            assert so_far == full


def test_incremental_detokenization_after_a_prompt(tok: Tokenizer) -> None:
    prompt = tok.encode("Tell me about 東京 and")
    out = tok.encode(" the weather in 🌧️ Paris, s'il vous plaît.")
    deltas = _stream_deltas(tok, out, prompt)
    assert all("\ufffd" not in d for d in deltas)
    # The first word keeps its leading space; nothing of the prompt is repeated.
    assert deltas[0].startswith(" ")
    assert "".join(deltas) == tok.decode(prompt + out)[len(tok.decode(prompt)) :]


def test_incremental_detokenization_in_chunks_and_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(ids[i : i + 3]) for i in range(0, len(ids), 3)]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE_TEXT  # the EOS token adds no text


def test_special_tokens_a_parser_reads_are_kept_and_others_dropped(tok: Tokenizer) -> None:
    """As Mistral's [TOOL_CALLS] or [THINK]: special tokens named in `keep` stay in the text
    (a parser reads them), every other special token is still dropped."""
    start, end = "<|im_start|>", "<|im_end|>"
    assert {start, end} <= set(tok.special_tokens.values())
    ids = tok.encode(f"Hi{start}there{end} you") + [tok.eos_token_id]
    for keep, text in (([], "Hithere you"), ([start], f"Hi{start}there you")):
        stream = TextStream(tok, tok.encode("Say"), keep_special=keep)
        assert "".join(stream.push([i]) for i in ids) + stream.flush() == text


# --- stop strings -----------------------------------------------------------------------------


def _longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    return max(
        (k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])),
        default=0,
    )


def _run_stream(
    tok: Tokenizer, ids: list[int], stops: list[str], prompt: list[int] | None = None
) -> tuple[TextStream, list[str]]:
    """Feed `ids` one at a time, checking after every token that exactly the safe text is out."""
    stream = TextStream(tok, prompt or [], stops)
    base = tok.decode(prompt or [])
    deltas: list[str] = []
    for n, token in enumerate(ids, 1):
        deltas.append(stream.push([token]))
        emitted = "".join(deltas)
        full = tok.decode((prompt or []) + ids[:n])[len(base) :]
        hits = [full.find(s) for s in stops if s in full]
        if hits:
            assert stream.stopped
            assert emitted == full[: min(hits)]
            break
        assert not stream.stopped
        visible = full.rstrip("\ufffd")
        safe = visible[: len(visible) - _longest_stop_prefix_suffix(visible, stops)]
        # Never ahead of what is safe; exactly that once no character is half-decoded.
        assert safe.startswith(emitted)
        if not full.endswith("\ufffd"):
            assert emitted == safe, (n, emitted, safe)
    return stream, deltas


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("The answer is 42. Done. More text after.", "42. Done"),  # spans 5 tokens
        ("Thought: think\nObservation: result\nThought: more", "\nObservation:"),
        ("Say 你好，世界 to everyone 🎉 now", "好，世"),  # multi-byte, split inside tokens
        ("emoji stop 🎉🚀 then more", "🚀"),
        ("Go go go go gone away", "go go gone"),  # partial matches that overlap and restart
    ],
)
def test_stop_string_is_never_emitted(tok: Tokenizer, text: str, stop: str) -> None:
    ids = tok.encode(text)
    # The stop string is not inside any single token: it is assembled across boundaries.
    assert not any(stop in tok.decode([i]) for i in ids)
    stream, deltas = _run_stream(tok, ids, [stop])
    assert stream.stopped
    out = "".join(deltas)
    assert out == text[: text.index(stop)]
    assert "\ufffd" not in out
    # Nothing more once stopped, neither from push nor from flush.
    assert stream.push(tok.encode(" more")) == ""
    assert stream.flush() == ""


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    text = "alpha beta\n\ngamma END delta"
    stream, deltas = _run_stream(tok, tok.encode(text), ["END", "\n\n", "zzz"])
    assert stream.stopped
    assert "".join(deltas) == "alpha beta"


def test_stop_inside_a_multi_token_push(tok: Tokenizer) -> None:
    """Speculative decoding accepts several tokens per step; text after the stop is dropped."""
    ids = tok.encode("one two three STOP four five")
    stream = TextStream(tok, [], ["STOP"])
    out = stream.push(ids[:2]) + stream.push(ids[2:])
    assert stream.stopped
    assert out + stream.flush() == "one two three "


def test_stop_string_in_prompt_is_ignored(tok: Tokenizer) -> None:
    prompt = tok.encode("Reply, then write DONE.")
    text = " Sure thing, here it is"
    stream, deltas = _run_stream(tok, tok.encode(text), ["DONE"], prompt)
    assert not stream.stopped
    assert "".join(deltas) + stream.flush() == text


def test_flush_releases_held_back_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hello wor")
    stream, deltas = _run_stream(tok, ids, ["world!", "\n\n"])
    assert not stream.stopped
    # " wor" could begin "world!": held until the end of generation.
    assert "".join(deltas) == "Hello "
    assert stream.flush() == "wor"
    assert stream.flush() == ""


def test_no_stop_strings_streams_everything(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT)
    stream, deltas = _run_stream(tok, ids, [])
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert stream.flush() == ""
    # Empty stop strings are ignored rather than stopping at once.
    stream = TextStream(tok, [], [""])
    assert stream.push(ids[:3]) == tok.decode(ids[:3])
    assert not stream.stopped
