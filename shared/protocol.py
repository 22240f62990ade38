"""Every message the services exchange, and the subjects they travel on.

Messages are msgspec structs, built by keyword, packed with msgpack inside an envelope
`[version, type name, fields]` (`pack`). Unpacking validates every field against its type (and
the bounds of `TokenId`), so a malformed message fails alone, on receipt. No pickle: a
peer can only make us build the types listed here. Large tensors never ride in
messages: KV blocks go through the KV transport and messages carry their keys.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.sampling.params import INT32_MAX, SamplingParams

PROTOCOL_VERSION = 4

# Subjects. `{id}` is an instance id; the queue groups share work among instances.
TOKENIZE = "specmesh.tokenizer.tokenize"  # queue group "tokenizer"
ENCODE = "specmesh.tokenizer.encode"  # queue group "tokenizer": text to ids, nothing kept
DETOKENIZE = "specmesh.tokenizer.detokenize"  # queue group "tokenizer": ids to text, nothing kept
PREFILL = "specmesh.prefill"  # queue group "prefill"
ABORT = "specmesh.abort"  # broadcast: every service drops the request
HEARTBEAT = "specmesh.heartbeat.{kind}"  # kind: a kind of service
GATEWAY_HEARTBEAT = HEARTBEAT.format(kind="gateway")


def detok_subject(tokenizer_id: str) -> str:
    return f"specmesh.tokenizer.{tokenizer_id}.detok"


def resume_subject(tokenizer_id: str) -> str:
    return f"specmesh.tokenizer.{tokenizer_id}.resume"


def decode_subject(decode_id: str) -> str:
    return f"specmesh.decode.{decode_id}.admit"


def drafter_subject(drafter_id: str) -> str:
    return f"specmesh.drafter.{drafter_id}"


# Online learning: drafters send what they served, the learner announces the pool's head.
LEARN_EXAMPLES = "specmesh.learner.examples"  # queue group "learner"
HEAD_VERSION = "specmesh.learner.head"  # broadcast: the head every drafter should draft with
HEAD_REFUSED = "specmesh.learner.refused"  # a drafter could not take an announced version


def flush_subject(instance_id: str) -> str:
    """A prefill or decode instance's: drop its prefix cache."""
    return f"specmesh.cache.{instance_id}.flush"


# KV-aware routing: decode workers say which prefix-cache blocks they gain and lose.
CACHE_EVENTS = "specmesh.cache.events"  # broadcast


def cache_snapshot_subject(instance_id: str) -> str:
    """A decode worker's: every block hash its prefix cache holds."""
    return f"specmesh.cache.{instance_id}.snapshot"


def gateway_subject(gateway_id: str) -> str:
    return f"specmesh.gateway.{gateway_id}.out"


def inbox_prefix(user: str) -> str:
    """Where replies to `user`'s requests come back: its own, so no other user may read them."""
    return f"_INBOX.{user}"


# What each service may publish and subscribe to, beyond its own heartbeat and inbox and
# replies to the requests it serves: with one NATS user per kind of service, a leaked
# password reaches only that service's subjects. `*` stands for any instance.
_ALLOWED: dict[str, tuple[list[str], list[str]]] = {
    "gateway": (
        [
            *(TOKENIZE, ENCODE, DETOKENIZE, PREFILL, ABORT),
            *(decode_subject("*"), resume_subject("*"), flush_subject("*")),
            cache_snapshot_subject("*"),
        ],
        [gateway_subject("*"), HEARTBEAT.format(kind="*"), CACHE_EVENTS],
    ),
    "tokenizer": (
        [gateway_subject("*"), ABORT],
        [
            *(TOKENIZE, ENCODE, DETOKENIZE, ABORT, GATEWAY_HEARTBEAT),
            *(detok_subject("*"), resume_subject("*")),
        ],
    ),
    "prefill": ([], [PREFILL, ABORT, flush_subject("*")]),
    "decode": (
        [detok_subject("*"), drafter_subject("*"), CACHE_EVENTS],
        [
            *(decode_subject("*"), flush_subject("*"), cache_snapshot_subject("*")),
            *(ABORT, GATEWAY_HEARTBEAT),
        ],
    ),
    "drafter": ([LEARN_EXAMPLES, HEAD_REFUSED], [drafter_subject("*"), ABORT, HEAD_VERSION]),
    "learner": ([HEAD_VERSION], [LEARN_EXAMPLES, HEAD_REFUSED]),
    "specmesh-up": ([], [HEARTBEAT.format(kind="*")]),  # the launcher sees services start
}
SERVICE_USERS = tuple(_ALLOWED)


def nats_users(passwords: dict[str, str]) -> list[dict[str, Any]]:
    """nats-server's `authorization.users` for these users (of SERVICE_USERS) and passwords."""
    return [
        {"user": user, "password": password, "permissions": _permissions(user)}
        for user, password in passwords.items()
    ]


def _permissions(user: str) -> dict[str, Any]:
    publish, subscribe = _ALLOWED[user]
    return {
        "publish": {"allow": [*publish, HEARTBEAT.format(kind=user)]},
        "subscribe": {"allow": [*subscribe, f"{inbox_prefix(user)}.>"]},
        "allow_responses": True,
    }


class ProtocolError(ValueError):
    """A value no message can carry; `status` is the HTTP status it answers."""

    status = 400


class PayloadTooLarge(ProtocolError):
    """An encoded message over the bus's largest payload."""

    status = 413


TokenId = Annotated[int, msgspec.Meta(ge=0, le=INT32_MAX)]
Count = Annotated[int, msgspec.Meta(ge=0)]
BlockHash = Annotated[int, msgspec.Meta(ge=0)]  # shared.kvcache's block_hash: 64 bits


class Message(msgspec.Struct):
    """Base of every message. Each is built by keyword (`kw_only`, which msgspec applies
    per class); fields a peer does not know are ignored, missing ones with a default
    take it (an older peer)."""


class ErrorReply(Message, kw_only=True):
    """A request failed; `status` follows HTTP (400 bad input, 503 no capacity)."""

    message: str
    status: int = 500


class ImageData(Message, kw_only=True):
    """An image resized for the encoder (shared.multimodal.preprocess): uint8 pixels
    [3, height, width] row-major; the encoder rescales and normalizes them."""

    pixels: bytes
    height: Count
    width: Count
    mean: list[float]
    std: list[float]
    rescale: float


class TokenizeRequest(Message, kw_only=True):
    request_id: str
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the chat template
    prompt: str | None = None  # completions: plain text
    prompt_ids: list[TokenId] | None = None  # already tokenized
    chat_template_kwargs: dict[str, Any] | None = None
    stop: list[str] | None = None  # the tokenizer instance keeps them for detokenizing
    tools: list[dict[str, Any]] | None = None  # OpenAI tool definitions, for the template
    tool_parser: str | None = None  # the call format, for templates that do not take tools
    # special tokens whose text the output keeps (its parsers read them); others are dropped
    keep_special: list[str] | None = None
    output_subject: str = ""  # the gateway's: its requests end if it goes away
    # Encoded images (PNG, JPEG, WebP), one per image placeholder in `messages`, in order.
    images: list[bytes] | None = None
    max_tokens: Count | None = None  # the context: a longer prompt is refused, early if it can


class TokenizeReply(Message, kw_only=True):
    prompt_ids: list[TokenId]
    tokenizer_id: str  # detokenizes this request's output (it holds its stop strings)
    prompt_text: str  # the prompt as the model sees it (completions echo it)
    images: list[ImageData] | None = None  # the prompt's images, in its image tokens' order


class EncodeRequest(Message, kw_only=True):
    """Texts to token ids (the /tokenize endpoint): no request state is kept."""

    texts: list[str]
    add_special_tokens: bool = True


class EncodeReply(Message, kw_only=True):
    token_ids: list[list[TokenId]]


class DetokenizeRequest(Message, kw_only=True):
    """Token ids to texts (the /detokenize endpoint); ids outside the vocabulary fail."""

    token_ids: list[list[TokenId]]
    skip_special_tokens: bool = True


class DetokenizeReply(Message, kw_only=True):
    texts: list[str]


class FlushCache(Message, kw_only=True):
    """Drop the prefix cache: the blocks no running request holds, here and in the store."""


class CacheFlushed(Message, kw_only=True):
    blocks: Count  # cached blocks this instance forgot


class CacheEvents(Message, kw_only=True):
    """A numbered batch of what an instance's prefix cache gained and lost (see
    shared/kvcache/events.py); a gap in the numbers calls for a snapshot."""

    instance_id: str
    incarnation: str  # the process's (its numbers start over when it restarts)
    seq: Count
    block_size: Count
    stored: list[BlockHash]
    removed: list[BlockHash]


class CacheSnapshotRequest(Message, kw_only=True):
    """Every block hash the prefix cache holds now."""


class CacheSnapshot(Message, kw_only=True):
    incarnation: str
    next_seq: Count  # the number of the next CacheEvents batch, which may repeat some of these
    block_size: Count
    hashes: list[BlockHash]


class PrefillRequest(Message, kw_only=True):
    request_id: str
    prompt_ids: list[TokenId]
    params: SamplingParams
    images: list[ImageData] | None = None


class PrefillReply(Message, kw_only=True):
    """The first token and where the prompt's K/V now is."""

    first_token: TokenId
    logprob: float | None
    top_logprobs: list[tuple[TokenId, float]] | None
    kv_keys: list[str]  # transport keys of the prompt's blocks, the last one maybe partial
    num_computed_tokens: Count  # prompt tokens prefill computed (the rest were reused)
    # What the K/V is for (model, dtype, block size): decode refuses any other's. The hash
    # is model_fingerprint's, the words kv_description's (for the error that refuses it).
    kv_fingerprint: str
    kv_description: str
    kv_source: str | None = None  # the direct store to pull kv_keys from; None: shared store


class AdmitRequest(Message, kw_only=True):
    """Hand a prefilled request to a decode worker; it streams the tokens from here on."""

    request_id: str
    prompt_ids: list[TokenId]
    params: SamplingParams
    prefill: PrefillReply | None  # None: computed here (its prefix cache holds most of it)
    drafter_id: str | None  # None: no speculation
    detok_subject: str  # where TokenBatch messages go
    output_subject: str  # passed along for the detokenizer's TextDelta messages
    attempt: Count = 0  # how many times the request moved to another decode worker
    # The prompt's images: their digests key decode's prefix cache, and a prompt whose K/V
    # did not arrive is computed with them.
    images: list[ImageData] | None = None


class Admitted(Message, kw_only=True):
    decode_id: str


class TokenBatch(Message, kw_only=True):
    """Tokens a decode step produced for one request (travels in a TokenBatches)."""

    request_id: str
    output_subject: str
    token_ids: list[TokenId]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[TokenId, float]]] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0  # prompt tokens served from a prefix cache
    spec: SpecStats | None = None  # speculation totals, on the last batch
    error: str | None = None  # with finish_reason "error"
    attempt: Count = 0  # the AdmitRequest's: a moved request's old worker is ignored


class TokenBatches(Message, kw_only=True):
    """One decode step's output for the requests one detokenizer serves: a message per
    step, not per request."""

    batches: list[TokenBatch]


class TokenLogprob(Message, kw_only=True):
    """A token's log-probability, as id and text; `top`: the most likely alternatives."""

    token_id: TokenId
    text: str
    logprob: float
    top: list[TokenLogprob] = []


class TextDelta(Message, kw_only=True):
    """Detokenized output for the gateway; `finish_reason` set on the last one."""

    request_id: str
    text: str
    num_tokens: Count
    token_ids: list[TokenId] = []  # the tokens of this delta (num_tokens of them)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0
    spec: SpecStats | None = None
    error: str | None = None  # with finish_reason "error"


class TextDeltas(Message, kw_only=True):
    """The TextDelta of each request one gateway serves, from one TokenBatches."""

    deltas: list[TextDelta]


class ResumeRequest(Message, kw_only=True):
    """A request's decode worker is gone: its detokenizer takes tokens of `attempt` (the
    next worker's) only from now on, and says which tokens the request has."""

    request_id: str
    attempt: Count


class ResumeReply(Message, kw_only=True):
    token_ids: list[TokenId]
    finished: bool = False  # it finished before it could move: its last text is on its way


class Abort(Message, kw_only=True):
    request_id: str


class DraftOpen(Message, kw_only=True):
    request_id: str
    token_ids: list[TokenId]


class DraftClose(Message, kw_only=True):
    request_id: str


class DraftItem(Message, kw_only=True):
    request_id: str
    new_tokens: list[TokenId]
    max_drafts: Count
    # EAGLE: the target's features for positions feature_position.. (float32, row-major).
    features: bytes | None = None
    feature_shape: list[Count] | None = None
    feature_position: Count = 0


class DraftStep(Message, kw_only=True):
    items: list[DraftItem]


class DraftTreeMsg(Message, kw_only=True):
    tokens: list[TokenId]
    parents: list[Annotated[int, msgspec.Meta(ge=-1)]]  # -1: the root


class DraftReply(Message, kw_only=True):
    trees: list[DraftTreeMsg]


class VersionAcceptance(Message, kw_only=True):
    """Live acceptance of a head version: verification steps that had its drafts, and the
    tokens those steps emitted (accepted drafts + the bonus token)."""

    version: Count
    steps: Count
    tokens: Count


class ServedExample(Message, kw_only=True):
    """A finished request a drafter served: its tokens (prompt, then output), the target
    features it was sent for positions `feature_position`.. (float16, [rows, feature_dim]
    row-major; feature_dim 0: a drafter that reads none, STANDALONE, sends no rows), and
    the live acceptance it counted since its last example, per version."""

    token_ids: list[TokenId]
    prompt_len: Count
    features: bytes
    feature_position: Count
    feature_dim: Count
    acceptance: list[VersionAcceptance] = []


class HeadVersion(Message, kw_only=True):
    """The learner's word on the head a pool drafts with: version `version` of
    `algorithm`'s head is the weights file under `key` in the KV store (its sha256
    `sha256`) with this config.json."""

    algorithm: str
    version: Count
    key: str
    sha256: str
    config: str
    source: str | None = None  # the direct store holding `key`; None: the shared store


class HeadRefused(Message, kw_only=True):
    instance_id: str
    version: Count
    reason: str


class Heartbeat(Message, kw_only=True):
    """An instance's liveness and load; `leaving` says goodbye on a clean shutdown."""

    kind: str
    instance_id: str
    metrics_url: str | None = None
    active_requests: Count = 0
    waiting_requests: Count = 0
    kv_blocks_free: Count = 0
    kv_blocks_total: Count = 0
    leaving: bool = False
    draining: bool = False  # stopping: finishing its requests, taking no new ones
    algorithm: str | None = None  # decode and drafters: the speculative algorithm
    head_version: Count | None = None  # drafters learning online: the head version in use
    max_model_len: Count = 0  # decode: the longest prompt + output it runs
    incarnation: str = ""  # new each process start: a restart under one id is news


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    type: str
    fields: msgspec.Raw


_MESSAGES: dict[str, type[Message]] = {
    cls.__name__: cls
    for cls in (
        ErrorReply,
        TokenizeRequest,
        TokenizeReply,
        EncodeRequest,
        EncodeReply,
        DetokenizeRequest,
        DetokenizeReply,
        FlushCache,
        CacheFlushed,
        CacheEvents,
        CacheSnapshotRequest,
        CacheSnapshot,
        PrefillRequest,
        PrefillReply,
        AdmitRequest,
        Admitted,
        TokenBatches,
        TextDeltas,
        ResumeRequest,
        ResumeReply,
        Abort,
        DraftOpen,
        DraftClose,
        DraftStep,
        DraftReply,
        ServedExample,
        HeadVersion,
        HeadRefused,
        Heartbeat,
    )
}
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_DECODERS = {name: msgspec.msgpack.Decoder(cls) for name, cls in _MESSAGES.items()}

M = TypeVar("M")


def pack(msg: Any) -> bytes:
    name = type(msg).__name__
    if _MESSAGES.get(name) is not type(msg):
        raise ProtocolError(f"{name} is not a protocol message")
    try:
        fields = msgspec.Raw(_ENCODER.encode(msg))
        return _ENCODER.encode(_Envelope(PROTOCOL_VERSION, name, fields))
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as exc:
        raise ProtocolError(f"cannot pack {name}: {exc}") from exc


def unpack(data: bytes, expect: type[M] | None = None) -> M:
    """Unpack and validate a message; with `expect`, anything else (an ErrorReply too)
    raises."""
    try:
        envelope = _ENVELOPE.decode(data)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    if envelope.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {envelope.version}, expected {PROTOCOL_VERSION}")
    decoder = _DECODERS.get(envelope.type)
    if decoder is None:
        raise ProtocolError(f"unknown message type {envelope.type!r}")
    try:
        msg = decoder.decode(envelope.fields)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"bad {envelope.type}: {exc}") from exc
    if expect is not None and not isinstance(msg, expect):
        if isinstance(msg, ErrorReply):
            raise RemoteError(msg.message, msg.status)
        raise ProtocolError(f"expected {expect.__name__}, got {envelope.type}")
    return msg


class RemoteError(RuntimeError):
    """The peer answered with an ErrorReply."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status
