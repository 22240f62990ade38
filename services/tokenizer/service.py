"""The tokenizer service.

Tokenizing is stateless work shared by a queue group. Detokenizing is not: the
instance that tokenized a request keeps its text stream (incremental UTF-8-safe
decoding, stop strings), and decode workers send that request's tokens to it.
A matched stop string ends the request everywhere with an Abort broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import model_option
from shared.model.fetch import resolve_model
from shared.protocol import (
    ABORT,
    TOKENIZE,
    Abort,
    TextDelta,
    TokenBatch,
    TokenizeReply,
    TokenizeRequest,
    detok_subject,
)
from shared.service import Service, ServiceConfig
from shared.telemetry import ACTIVE_REQUESTS
from shared.tokenizer import TextStream, Tokenizer


@dataclass
class TokenizerConfig:
    model: str | None = model_option()


class TokenizerService(Service):
    kind = "tokenizer"

    def __init__(self, cfg: ServiceConfig, tcfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        self.tokenizer = Tokenizer(resolve_model(tcfg.model))
        self.streams: dict[str, TextStream] = {}

    async def start(self) -> None:
        await self.bus.serve(TOKENIZE, self.tokenize, queue="tokenizer")
        await self.bus.serve(detok_subject(self.instance_id), self.detokenize)
        await self.bus.serve(ABORT, self.abort)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        if req.messages is not None:
            try:
                ids = self.tokenizer.encode_chat(req.messages, **(req.chat_template_kwargs or {}))
            except Exception as exc:  # template errors come from the caller's messages
                raise ValueError(f"cannot apply the chat template: {exc}") from exc
        elif req.prompt is not None:
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=True)
        elif req.prompt_ids is not None:
            ids = list(req.prompt_ids)
        else:
            raise ValueError("nothing to tokenize: give messages, a prompt or prompt ids")
        self.streams[req.request_id] = TextStream(self.tokenizer, ids, req.stop)
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))
        return TokenizeReply(ids, self.instance_id)

    async def detokenize(self, batch: TokenBatch) -> None:
        stream = self.streams.get(batch.request_id)
        if stream is None:  # aborted meanwhile
            return
        text, logprobs, used = "", [], 0
        for i, token in enumerate(batch.token_ids):
            text += stream.push([token])
            used += 1
            if batch.logprobs is not None:
                top = batch.top_logprobs[i] if batch.top_logprobs else []
                logprobs.append(self._logprob_entry(token, batch.logprobs[i], top))
            if stream.stopped:
                break
        finish = "stop" if stream.stopped else batch.finish_reason
        if finish is not None:
            text += stream.flush()
            del self.streams[batch.request_id]
            ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))
            if batch.finish_reason is None:  # a stop string: the decode worker is still going
                await self.bus.publish(ABORT, Abort(batch.request_id))
        delta = TextDelta(
            batch.request_id,
            text,
            used,
            logprobs if batch.logprobs is not None else None,
            finish,
            batch.num_prompt_tokens,
            batch.num_cached_tokens,
            batch.spec,
            batch.error,
        )
        await self.bus.publish(batch.output_subject, delta)

    async def abort(self, msg: Abort) -> None:
        self.streams.pop(msg.request_id, None)

    def _logprob_entry(
        self, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> dict[str, Any]:
        def item(token_id: int, lp: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        return {**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in top]}
