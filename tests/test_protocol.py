"""The wire format: every message survives a round trip; nothing else gets in."""

from __future__ import annotations

import msgpack
import pytest

from shared.protocol import (
    PROTOCOL_VERSION,
    AdmitRequest,
    DraftItem,
    DraftReply,
    DraftStep,
    DraftTreeMsg,
    ErrorReply,
    Heartbeat,
    PrefillReply,
    ProtocolError,
    RemoteError,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenBatches,
    decode,
    encode,
)
from shared.sampling.params import SamplingParams


def test_nested_messages_round_trip() -> None:
    prefill = PrefillReply(7, -0.5, [(7, -0.5), (9, -1.25)], ["k0", "k1"], 12)
    admit = AdmitRequest(
        "r1", [1, 2, 3], SamplingParams(temperature=0.7, seed=3), prefill, "d0", "a", "b"
    )
    again = decode(encode(admit), AdmitRequest)
    assert again == admit
    assert isinstance(again.params, SamplingParams) and again.prefill.top_logprobs == [
        (7, -0.5),
        (9, -1.25),
    ]
    step = DraftStep([DraftItem("r1", [5], 4, b"\x00" * 8, [1, 2], 3)])
    assert decode(encode(step)) == step
    reply = DraftReply([DraftTreeMsg([5, 6], [-1, 0])])
    assert decode(encode(reply), DraftReply) == reply
    tokens = TokenBatches(
        [TokenBatch("r1", "out", [5, 6], [-0.5, -1.0], [[(5, -0.5)], [(6, -1.0), (2, -3.0)]])]
    )
    assert decode(encode(tokens), TokenBatches) == tokens
    deltas = TextDeltas([TextDelta("r1", "Hi", 2), TextDelta("r2", "", 0, finish_reason="stop")])
    assert decode(encode(deltas), TextDeltas) == deltas


def test_defaults_fill_fields_an_older_peer_did_not_send() -> None:
    raw = msgpack.packb({"v": PROTOCOL_VERSION, "t": "Heartbeat", "f": {"kind": "decode",
                         "instance_id": "d0"}})  # fmt: skip
    beat = decode(raw, Heartbeat)
    assert beat.active_requests == 0 and not beat.leaving


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "malformed"),
        (msgpack.packb({"v": PROTOCOL_VERSION + 1, "t": "Abort", "f": {}}), "version"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "os.system", "f": {}}), "unknown message"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "Abort", "f": {}}), "bad Abort"),
        (msgpack.packb({"v": PROTOCOL_VERSION, "t": "Abort", "f": 7}), "bad Abort"),
        # a nested message that is not a field map
        (
            msgpack.packb({"v": PROTOCOL_VERSION, "t": "TokenBatches", "f": {"batches": [5]}}),
            "bad TokenBatches",
        ),
    ],
)
def test_bad_messages_are_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode(raw)


def test_an_error_reply_raises_with_its_status() -> None:
    with pytest.raises(RemoteError, match="too long") as info:
        decode(encode(ErrorReply("prompt too long", 400)), TokenBatches)
    assert info.value.status == 400
    with pytest.raises(ProtocolError, match="expected TokenBatches"):
        decode(encode(Heartbeat("decode", "d0")), TokenBatches)


def test_only_protocol_messages_encode() -> None:
    with pytest.raises(ProtocolError):
        encode(SamplingParams())
    with pytest.raises(ProtocolError):  # a step's tokens travel only in a TokenBatches
        encode(TokenBatch("r1", "out", [5]))
