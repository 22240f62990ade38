"""The wire format: every message survives a round trip; nothing else gets in."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from specmesh.shared.protocol import (
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
    pack,
    unpack,
)
from specmesh.shared.sampling.params import SamplingParams

pytestmark = pytest.mark.unit


def _raw(name: str, fields: Any, version: int = PROTOCOL_VERSION) -> bytes:
    """A message as a peer could craft it."""
    return msgspec.msgpack.encode([version, name, fields])


def _prefill(**changes: Any) -> dict[str, Any]:
    return {
        "first_token": 7,
        "logprob": None,
        "top_logprobs": None,
        "kv_keys": ["k0"],
        "num_computed_tokens": 3,
        "kv_fingerprint": "f0",
        "kv_description": "a model, float32, block size 16",
        **changes,
    }


def test_nested_messages_round_trip() -> None:
    prefill = PrefillReply(
        first_token=7,
        logprob=-0.5,
        top_logprobs=[(7, -0.5), (9, -1.25)],
        kv_keys=["k0", "k1"],
        num_computed_tokens=12,
        kv_fingerprint="f0",
        kv_description="a model, float32, block size 16",
    )
    admit = AdmitRequest(
        request_id="r1",
        prompt_ids=[1, 2, 3],
        params=SamplingParams(temperature=0.7, seed=3),
        prefill=prefill,
        drafter_id="d0",
        detok_subject="a",
        output_subject="b",
    )
    again = unpack(pack(admit), AdmitRequest)
    assert again == admit
    assert isinstance(again.params, SamplingParams) and again.prefill.top_logprobs == [
        (7, -0.5),
        (9, -1.25),
    ]
    item = DraftItem(
        request_id="r1",
        new_tokens=[5],
        max_drafts=4,
        features=b"\x00" * 8,
        feature_shape=[1, 2],
        feature_position=3,
    )
    step = DraftStep(items=[item])
    assert unpack(pack(step)) == step
    reply = DraftReply(trees=[DraftTreeMsg(tokens=[5, 6], parents=[-1, 0])])
    assert unpack(pack(reply), DraftReply) == reply
    batch = TokenBatch(
        request_id="r1",
        output_subject="out",
        token_ids=[5, 6],
        logprobs=[-0.5, -1.0],
        top_logprobs=[[(5, -0.5)], [(6, -1.0), (2, -3.0)]],
    )
    tokens = TokenBatches(batches=[batch])
    assert unpack(pack(tokens), TokenBatches) == tokens
    deltas = TextDeltas(
        deltas=[
            TextDelta(request_id="r1", text="Hi", num_tokens=2),
            TextDelta(request_id="r2", text="", num_tokens=0, finish_reason="stop"),
        ]
    )
    assert unpack(pack(deltas), TextDeltas) == deltas


def test_messages_are_built_by_keyword() -> None:
    with pytest.raises(TypeError):
        Heartbeat("decode", "d0")  # type: ignore[misc]


def test_defaults_fill_fields_an_older_peer_did_not_send() -> None:
    beat = unpack(_raw("Heartbeat", {"kind": "decode", "instance_id": "d0"}), Heartbeat)
    assert beat.active_requests == 0 and not beat.leaving
    newer = _raw("Heartbeat", {"kind": "decode", "instance_id": "d0", "gpu": "h100"})
    assert unpack(newer, Heartbeat).instance_id == "d0"  # unknown fields are ignored


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode({"v": 2}), "malformed"),
        (_raw("Abort", {"request_id": "r"}, PROTOCOL_VERSION + 1), "version"),
        (_raw("os.system", {}), "unknown message"),
        (_raw("Abort", {}), "bad Abort.*request_id"),
        (_raw("Abort", 7), "bad Abort"),
        (_raw("Abort", {"request_id": 7}), "bad Abort.*request_id"),
        # a nested message that is not a field map
        (_raw("TokenBatches", {"batches": [5]}), "bad TokenBatches"),
        # crafted values: token ids out of range or of the wrong type, negative counts
        (_raw("PrefillReply", _prefill(first_token=-1)), "bad PrefillReply.*first_token"),
        (_raw("PrefillReply", _prefill(first_token=2**40)), "bad PrefillReply"),
        (_raw("PrefillReply", _prefill(first_token="7")), "bad PrefillReply"),
        (_raw("PrefillReply", _prefill(num_computed_tokens=-3)), "bad PrefillReply"),
        (_raw("PrefillReply", _prefill(kv_keys=[1, 2])), "bad PrefillReply.*kv_keys"),
        (_raw("DraftReply", {"trees": [{"tokens": [5], "parents": [-2]}]}), "bad DraftReply"),
        (
            _raw(
                "DraftStep", {"items": [{"request_id": "r", "new_tokens": [1], "max_drafts": -1}]}
            ),
            "bad DraftStep",
        ),
        (
            _raw(
                "PrefillRequest",
                {"request_id": "r", "prompt_ids": [1], "params": {"max_tokens": "many"}},
            ),
            "bad PrefillRequest.*max_tokens",
        ),
    ],
)
def test_bad_messages_are_rejected(raw: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        unpack(raw)


def test_an_error_reply_raises_with_its_status() -> None:
    with pytest.raises(RemoteError, match="too long") as info:
        unpack(pack(ErrorReply(message="prompt too long", status=400)), TokenBatches)
    assert info.value.status == 400
    with pytest.raises(ProtocolError, match="expected TokenBatches"):
        unpack(pack(Heartbeat(kind="decode", instance_id="d0")), TokenBatches)


def test_only_protocol_messages_pack() -> None:
    with pytest.raises(ProtocolError):
        pack(SamplingParams())
    with pytest.raises(ProtocolError):  # a step's tokens travel only in a TokenBatches
        pack(TokenBatch(request_id="r1", output_subject="out", token_ids=[5]))
    with pytest.raises(ProtocolError, match="cannot pack"):
        pack(ErrorReply(message="x", status=2**70))
