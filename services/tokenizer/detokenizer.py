"""Detokenizing: each request's output tokens to the text its client sees.

A request's text stream lives where it was tokenized (incremental UTF-8-safe decoding,
stop strings). Decode workers send its tokens there step by step; each batch of them
becomes one `TextDelta` for the gateway. A request that moved to another decode worker
is resumed from the tokens this side already has, and tokens of its older placement
are dropped. A request that finished here lately is known as such: its worker's goodbye
can reach the gateway before its last text does, and it must not move then.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.shared.core.recent import RecentIds
from specmesh.shared.protocol import TextDelta, TokenBatch, TokenLogprob
from specmesh.shared.tokenizer import TextStream, Tokenizer


@dataclass
class Output:
    """A request's output as its detokenizer has it."""

    stream: TextStream
    gateway_subject: str  # where its text goes
    token_ids: list[int] = field(default_factory=list)
    attempt: int = 0  # its decode placement; tokens of an older one (it moved) are stale


class Detokenizer:
    """The text streams of the requests this tokenizer instance tokenized."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.outputs: dict[str, Output] = {}
        self.finished = RecentIds()

    def __len__(self) -> int:
        return len(self.outputs)

    def open(self, request_id: str, stream: TextStream, gateway_subject: str) -> None:
        self.outputs[request_id] = Output(stream, gateway_subject)

    def drop(self, request_id: str) -> None:
        self.outputs.pop(request_id, None)

    def drop_gateway(self, gateway_subject: str) -> None:
        """Forget the requests of a gateway that went away."""
        for request_id, output in list(self.outputs.items()):
            if output.gateway_subject == gateway_subject:
                del self.outputs[request_id]

    def resume(self, request_id: str, attempt: int) -> list[int] | None:
        """The tokens so far of a request that moved to its `attempt`-th placement; None if
        it finished here (its last text is on its way)."""
        output = self.outputs.get(request_id)
        if output is None:
            if request_id in self.finished:
                return None
            raise ValueError(f"request {request_id} is not detokenized here")
        output.attempt = attempt
        return output.token_ids

    def push(self, batch: TokenBatch) -> TextDelta | None:
        """The text of a batch of a request's tokens, up to a stop string if one matched;
        None for a request aborted or moved meanwhile. A finished request is forgotten."""
        output = self.outputs.get(batch.request_id)
        if output is None or batch.attempt < output.attempt:
            return None
        stream = output.stream
        text, logprobs, used = "", [], 0
        for i, token in enumerate(batch.token_ids):
            text += stream.push([token])
            output.token_ids.append(token)
            used += 1
            if batch.logprobs is not None:
                top = batch.top_logprobs[i] if batch.top_logprobs else []
                logprobs.append(self._logprob_entry(token, batch.logprobs[i], top))
            if stream.stopped:
                break
        finish = "stop" if stream.stopped else batch.finish_reason
        if finish is not None:
            text += stream.flush()
            del self.outputs[batch.request_id]
            self.finished.add(batch.request_id)
        return TextDelta(
            request_id=batch.request_id,
            text=text,
            num_tokens=used,
            token_ids=batch.token_ids[:used],
            logprobs=logprobs if batch.logprobs is not None else None,
            finish_reason=finish,
            num_prompt_tokens=batch.num_prompt_tokens,
            num_cached_tokens=batch.num_cached_tokens,
            spec=batch.spec,
            error=batch.error,
        )

    def _logprob_entry(
        self, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        def item(token_id: int, lp: float) -> TokenLogprob:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return TokenLogprob(token_id=token_id, text=text, logprob=lp)

        entry = item(token, logprob)
        entry.top = [item(t, lp) for t, lp in top]
        return entry
