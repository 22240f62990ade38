"""Tokenizer with the model's chat template, and UTF-8-safe incremental detokenization.

Built on the `tokenizers` library (its DecodeStream detokenizes) and a sandboxed
Jinja environment set up as transformers sets up its own (loop controls, `tojson`
that keeps non-ASCII text, the `generation` block), so templates render exactly as
transformers renders them and services need not import transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from specmesh.shared.parsers import held_back
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: unlike Jinja's, it keeps non-ASCII text and key order."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training
    masks in transformers; rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def chat_template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f))
    return env


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def _tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_chat_template(model_dir: Path, override: str | Path | None = None) -> str | None:
    """The chat template: `override`'s file, else the model's own (chat_template.jinja or
    tokenizer_config.json), None if it has none."""
    path = Path(override or model_dir / "chat_template.jinja")
    if path.is_file():
        return path.read_text()
    return _tokenizer_config(model_dir).get("chat_template")


class Tokenizer:
    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None) -> None:
        """`chat_template`: a Jinja file that replaces the model's own template."""
        model_dir = Path(model_dir)
        self._tok = HFTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _tokenizer_config(model_dir)
        template = read_chat_template(model_dir, chat_template)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self._template = chat_template_environment().from_string(template) if template else None
        self.template_source = template or ""

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` tokenizer underneath."""
        return self._tok

    @functools.cached_property
    def special_tokens(self) -> dict[int, str]:
        """Id -> text of the special tokens (those `skip_special_tokens` drops)."""
        added = self._tok.get_added_tokens_decoder()
        return {i: token.content for i, token in added.items() if token.special}

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest text a token stands for: n tokens hold at most n times this."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)))

    def check_fits(self, prompt: str | list[int], max_tokens: int | None) -> None:
        """ValueError if `prompt` (ids, or a text) is surely longer than `max_tokens` tokens;
        a text is measured by its length, before the time and memory encoding it takes."""
        if max_tokens is None:
            return
        text = isinstance(prompt, str)
        if len(prompt) > max_tokens * (self.max_token_chars if text else 1):
            raise ValueError(
                f"the prompt ({len(prompt)} {'characters' if text else 'tokens'}) is longer "
                f"than the model's context of {max_tokens} tokens can hold"
            )

    def check_ids(self, ids: list[int]) -> None:
        """ValueError unless every id is in the vocabulary."""
        if not all(0 <= i < self.vocab_size for i in ids):
            raise ValueError(f"token ids must be in [0, {self.vocab_size})")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template; use the completions API")
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **template_kwargs,
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        # The template already writes any special tokens it wants as text.
        return self.encode(self.apply_chat_template(messages, **kwargs))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas: `tokenizers`' DecodeStream,
    primed with the prompt's last tokens so that the first word is spaced as in the whole
    text; a partial UTF-8 character waits for the token that completes it. Special tokens
    are dropped, except those whose text is in `keep` (markers an output parser reads)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int] | None = None,
        keep: Collection[str] = (),
    ) -> None:
        self.backend = tokenizer.backend
        special = tokenizer.special_tokens
        kept = {i for i, text in special.items() if text in keep}
        # Only when some are kept does decoding see special tokens, less those dropped here.
        self.dropped = frozenset(special.keys() - kept) if kept else frozenset()
        self.stream = DecodeStream(ids=list(prompt_ids or [])[-6:], skip_special_tokens=not kept)

    def add(self, token_ids: list[int]) -> str:
        if self.dropped:
            token_ids = [i for i in token_ids if i not in self.dropped]
        if not token_ids:
            return ""
        return self.stream.step(self.backend, token_ids) or ""


class TextStream:
    """Detokenizes a request's output and applies its stop strings.

    Text that could be the start of a stop string is held back until it is
    clear, so a stop string never reaches the client, streamed or not.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: list[int],
        stop: list[str] | None = None,
        keep_special: list[str] | None = None,
    ) -> None:
        """`keep_special`: special tokens whose text the output keeps (IncrementalDetokenizer)."""
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, keep_special or [])
        self.stop = [s for s in (stop or []) if s]
        self.text = ""  # everything decoded so far
        self.sent = 0  # chars of self.text already emitted
        self.stopped = False

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to emit."""
        if self.stopped:
            return ""
        self.text += self.detokenizer.add(token_ids)
        hold = 0
        if self.stop:
            window = max(len(s) for s in self.stop)
            search_from = max(0, self.sent - window)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
            else:
                hold = held_back(self.text, self.stop)
        return self._emit(len(self.text) - hold)

    def flush(self) -> str:
        """At the end of generation: emit whatever was held back."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta
