"""services/tokenizer/detokenizer.py alone: requests' token batches to text deltas."""

from __future__ import annotations

from pathlib import Path

import pytest
from specmesh.services.tokenizer.detokenizer import Detokenizer
from specmesh.shared.protocol import TokenBatch
from specmesh.shared.tokenizer import TextStream, Tokenizer

pytestmark = pytest.mark.unit

GATEWAY = "specmesh.gateway.g0.out"


@pytest.fixture(scope="module")
def tok(smollm_dir: Path) -> Tokenizer:
    return Tokenizer(smollm_dir)


def _opened(tok: Tokenizer, stop: list[str] | None = None) -> Detokenizer:
    detokenizer = Detokenizer(tok)
    prompt = tok.encode("Say it.")
    detokenizer.open("r1", TextStream(tok, prompt, stop), GATEWAY)
    return detokenizer


def _batch(ids: list[int], **fields: object) -> TokenBatch:
    return TokenBatch(request_id="r1", output_subject=GATEWAY, token_ids=ids, **fields)  # type: ignore[arg-type]


def test_batches_become_the_text_and_the_request_is_forgotten_when_it_ends(
    tok: Tokenizer,
) -> None:
    detokenizer = _opened(tok)
    ids = tok.encode(" Hello wörld, twice over.")
    first = detokenizer.push(_batch(ids[:3]))
    last = detokenizer.push(_batch(ids[3:], finish_reason="length"))
    assert first is not None and last is not None
    assert first.text + last.text == tok.decode(ids)
    assert (first.num_tokens, last.finish_reason) == (3, "length")
    assert len(detokenizer) == 0
    assert detokenizer.push(_batch(ids)) is None  # nothing more for a finished request
    # Its worker's goodbye may reach the gateway before this last text: it must not move.
    assert detokenizer.resume("r1", attempt=1) is None


def test_a_stop_string_ends_the_request_mid_batch(tok: Tokenizer) -> None:
    detokenizer = _opened(tok, stop=["STOP"])
    ids = tok.encode(" one two STOP three four")
    delta = detokenizer.push(_batch(ids))
    assert delta is not None
    assert (delta.text, delta.finish_reason) == (" one two ", "stop")
    assert delta.num_tokens < len(ids) and delta.token_ids == ids[: delta.num_tokens]
    assert len(detokenizer) == 0


def test_a_moved_request_resumes_and_its_old_placement_is_ignored(tok: Tokenizer) -> None:
    detokenizer = _opened(tok)
    ids = tok.encode(" alpha beta gamma")
    detokenizer.push(_batch(ids[:2]))
    assert detokenizer.resume("r1", attempt=1) == ids[:2]
    assert detokenizer.push(_batch(ids[2:], attempt=0)) is None  # the old worker's
    delta = detokenizer.push(_batch(ids[2:], attempt=1))
    assert delta is not None and delta.num_tokens == len(ids) - 2
    with pytest.raises(ValueError, match="not detokenized here"):
        detokenizer.resume("r2", attempt=1)


def test_logprobs_carry_each_token_text_and_its_alternatives(tok: Tokenizer) -> None:
    detokenizer = _opened(tok)
    ids = tok.encode(" yes")
    top = [[(ids[0], -0.1), (tok.encode(" no")[0], -2.5)]]
    delta = detokenizer.push(_batch(ids[:1], logprobs=[-0.1], top_logprobs=top))
    assert delta is not None and delta.logprobs is not None
    (entry,) = delta.logprobs
    assert (entry.text, entry.logprob) == (tok.decode(ids[:1]), -0.1)
    assert [t.text for t in entry.top] == [" yes", " no"]


def test_a_gone_gateway_or_an_abort_drops_its_requests(tok: Tokenizer) -> None:
    detokenizer = _opened(tok)
    detokenizer.open("r2", TextStream(tok, [], None), "specmesh.gateway.g1.out")
    detokenizer.drop_gateway(GATEWAY)
    assert list(detokenizer.outputs) == ["r2"]
    detokenizer.drop("r2")
    assert len(detokenizer) == 0
