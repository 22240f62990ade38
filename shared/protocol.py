"""Every message the services exchange, and the subjects they travel on.

Messages are typed dataclasses packed with msgpack as `{"v": version, "t": type,
"f": fields}`; a nested dataclass field travels as its own field map. No pickle:
a peer can only make us build the types listed here. Large tensors never ride
in messages: KV blocks go through the KV transport and messages carry their keys.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack

from shared.sampling.params import SamplingParams

PROTOCOL_VERSION = 1

# Subjects. `{id}` is an instance id; the queue groups share work among instances.
TOKENIZE = "specmesh.tokenizer.tokenize"  # queue group "tokenizer"
PREFILL = "specmesh.prefill"  # queue group "prefill"
ABORT = "specmesh.abort"  # broadcast: every service drops the request
HEARTBEAT = "specmesh.heartbeat.{kind}"  # kind: decode | drafter


def detok_subject(tokenizer_id: str) -> str:
    return f"specmesh.tokenizer.{tokenizer_id}.detok"


def decode_subject(decode_id: str) -> str:
    return f"specmesh.decode.{decode_id}.admit"


def drafter_subject(drafter_id: str) -> str:
    return f"specmesh.drafter.{drafter_id}"


def gateway_subject(gateway_id: str) -> str:
    return f"specmesh.gateway.{gateway_id}.out"


class ProtocolError(ValueError):
    pass


@dataclass
class ErrorReply:
    """A request failed; `status` follows HTTP (400 bad input, 503 no capacity)."""

    message: str
    status: int = 500


@dataclass
class TokenizeRequest:
    request_id: str
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    prompt: str | None = None  # completions: plain text
    prompt_ids: list[int] | None = None  # already tokenized
    chat_template_kwargs: dict[str, Any] | None = None
    stop: list[str] | None = None  # the tokenizer instance keeps them for detokenizing
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the template
    tool_parser: str | None = None  # the call format, for templates that do not take tools
    assistant_prefix: str = ""  # appended after the generation prompt (forces a tool call)


@dataclass
class TokenizeReply:
    prompt_ids: list[int]
    tokenizer_id: str  # detokenizes this request's output (it holds its stop strings)
    prompt_text: str  # the prompt as the model sees it (completions echo it)


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class PrefillReply:
    """The first token and where the prompt's K/V now is."""

    first_token: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None
    kv_keys: list[str]  # transport keys of the prompt's blocks, the last one maybe partial
    num_computed_tokens: int  # prompt tokens prefill computed (the rest were reused)


@dataclass
class AdmitRequest:
    """Hand a prefilled request to a decode worker; it streams the tokens from here on."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prefill: PrefillReply
    drafter_id: str | None  # None: no speculation
    detok_subject: str  # where TokenBatch messages go
    output_subject: str  # passed along for the detokenizer's TextDelta messages


@dataclass
class Admitted:
    decode_id: str


@dataclass
class TokenBatch:
    """Tokens a decode step produced for one request (travels in a TokenBatches)."""

    request_id: str
    output_subject: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache
    spec: dict[str, int] | None = None  # speculation totals, on the last batch
    error: str | None = None  # with finish_reason "error"


@dataclass
class TokenBatches:
    """One decode step's output for the requests one detokenizer serves: a message per
    step, not per request."""

    batches: list[TokenBatch]


@dataclass
class TextDelta:
    """Detokenized output for the gateway; `finish_reason` set on the last one."""

    request_id: str
    text: str
    num_tokens: int
    logprobs: list[dict[str, Any]] | None = None  # OpenAI chat logprob entries
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: dict[str, int] | None = None
    error: str | None = None  # with finish_reason "error"


@dataclass
class TextDeltas:
    """The TextDelta of each request one gateway serves, from one TokenBatches."""

    deltas: list[TextDelta]


@dataclass
class Abort:
    request_id: str


@dataclass
class DraftOpen:
    request_id: str
    token_ids: list[int]


@dataclass
class DraftClose:
    request_id: str


@dataclass
class DraftItem:
    request_id: str
    new_tokens: list[int]
    max_drafts: int
    # EAGLE: the target's features for positions feature_position.. (float32, row-major).
    features: bytes | None = None
    feature_shape: list[int] | None = None
    feature_position: int = 0


@dataclass
class DraftStep:
    items: list[DraftItem]


@dataclass
class DraftTreeMsg:
    tokens: list[int]
    parents: list[int]


@dataclass
class DraftReply:
    trees: list[DraftTreeMsg]


@dataclass
class Heartbeat:
    """An instance's liveness and load; `leaving` says goodbye on a clean shutdown."""

    kind: str
    instance_id: str
    metrics_url: str | None = None
    active_requests: int = 0
    waiting_requests: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    leaving: bool = False
    algorithm: str | None = None  # decode and drafters: the speculative algorithm
    max_model_len: int = 0  # decode: the longest prompt + output it runs
    incarnation: str = ""  # new each process start: a restart under one id is news


_MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        ErrorReply,
        TokenizeRequest,
        TokenizeReply,
        PrefillRequest,
        PrefillReply,
        AdmitRequest,
        Admitted,
        TokenBatches,
        TextDeltas,
        Abort,
        DraftOpen,
        DraftClose,
        DraftStep,
        DraftReply,
        Heartbeat,
    )
}
_NESTED = {SamplingParams, PrefillReply, TokenBatch, TextDelta, DraftItem, DraftTreeMsg}

M = TypeVar("M")


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if _MESSAGES.get(name) is not type(msg):
        raise ProtocolError(f"{name} is not a protocol message")
    try:
        return msgpack.packb({"v": PROTOCOL_VERSION, "t": name, "f": _pack(type(msg))(msg)})
    except (OverflowError, TypeError, ValueError) as exc:  # e.g. an int beyond 64 bits
        raise ProtocolError(f"cannot encode {name}: {exc}") from exc


def decode(data: bytes, expect: type[M] | None = None) -> M:
    """Unpack a message; with `expect`, anything else (an ErrorReply too) raises."""
    try:
        raw = msgpack.unpackb(data)
        version, name, values = raw["v"], raw["t"], raw["f"]
    except Exception as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, expected {PROTOCOL_VERSION}")
    cls = _MESSAGES.get(name)
    if cls is None:
        raise ProtocolError(f"unknown message type {name!r}")
    try:
        msg = _unpack(cls)(values)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ProtocolError(f"bad {name}: {exc}") from exc
    if expect is not None and not isinstance(msg, expect):
        if isinstance(msg, ErrorReply):
            raise RemoteError(msg.message, msg.status)
        raise ProtocolError(f"expected {expect.__name__}, got {name}")
    return msg


class RemoteError(RuntimeError):
    """The peer answered with an ErrorReply."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


# Converters between dataclasses and what msgpack carries, made once per type from
# its hints: a value that needs none (numbers, strings, lists of them) is passed
# through as is, which is most of a step's tokens.
_Convert = typing.Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


def _fields_of(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _optional(convert: _Convert) -> _Convert:
    return lambda value: None if value is None else convert(value)


def _not_none(kind: Any) -> Any:
    """X for `X | None`."""
    if isinstance(kind, types.UnionType):
        return next(a for a in typing.get_args(kind) if a is not type(None))
    return kind


def _each(kind: Any, converter: typing.Callable[[Any], _Convert]) -> _Convert:
    """For `list[X]`: X's converter over the items (none if X needs none)."""
    args = typing.get_args(kind)
    item = converter(args[0]) if typing.get_origin(kind) is list and args else _identity
    if item is _identity:
        return _identity
    return _optional(lambda value: [item(v) for v in value])


@functools.cache
def _pack(kind: Any) -> _Convert:
    """Dataclasses (nested too) to field maps."""
    kind = _not_none(kind)
    if dataclasses.is_dataclass(kind):
        fields = [(name, _pack(hint)) for name, hint in _fields_of(kind)]
        return _optional(lambda obj: {name: pack(getattr(obj, name)) for name, pack in fields})
    return _each(kind, _pack)


@functools.cache
def _unpack(kind: Any) -> _Convert:
    """Field maps back to dataclasses, and lists back to tuples, as the hints say."""
    kind = _not_none(kind)
    if kind in _NESTED or kind in _MESSAGES.values():
        fields = [(name, _unpack(hint)) for name, hint in _fields_of(kind)]
        return _optional(lambda values: kind(**{n: u(values[n]) for n, u in fields if n in values}))
    if typing.get_origin(kind) is tuple:
        return _optional(tuple)
    return _each(kind, _unpack)
