"""Per-request sampling parameters (OpenAI / vLLM semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # OpenAI caps top_logprobs at 20
# Bounds on what one request may ask for, so that no request costs others much:
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string (each is searched for after every token)
MAX_STOP_TOKEN_IDS = 1024
INT32_MAX = 2**31 - 1  # token ids and top_k; the engine checks them against the vocabulary


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "ebnf", "lark")
# Constrained JSON as json.dumps writes it, on one line: the layout models know best, in
# few tokens (llguidance's JSON options; also inside Lark grammars' %json rules).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: any JSON object, a JSON schema (its JSON text),
    a regex, an EBNF grammar (SGLang's GBNF dialect) or a Lark grammar (llguidance's)."""

    kind: str
    source: str = ""


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None: none; k: chosen token's logprob + top k alternatives
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)  # added to the token's logit
    min_tokens: int = 0  # no EOS or stop token before this many output tokens
    grammar: Grammar | None = None  # constrained decoding (shared/sampling/grammar.py)
    # The prompt's last tokens that are output already (a request that moved to another
    # decode worker): the grammar has followed them.
    grammar_prefix: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError naming the first out-of-range field.

        Comparisons are written as `not (lo <= x <= hi)` so NaN is rejected too.
        """
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= -1):
            raise ValueError(f"top_k must be an integer >= -1 (-1 or 0 disables), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (-2.0 <= value <= 2.0):
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(
                f"logprobs must be None or in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}"
            )
        if any(not -100.0 <= bias <= 100.0 for bias in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if not (isinstance(self.grammar_prefix, int) and self.grammar_prefix >= 0):
            raise ValueError(f"grammar_prefix must be >= 0, got {self.grammar_prefix}")
        if self.grammar is not None and self.grammar.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")
