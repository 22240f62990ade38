"""The tokenizer service.

Tokenizing is stateless work shared by a queue group. Detokenizing is not: the
instance that tokenized a request keeps its text stream (incremental UTF-8-safe
decoding, stop strings), and decode workers send that request's tokens to it.
A matched stop string ends the request everywhere with an Abort broadcast.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.shared.bus import Outbox
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.multimodal.prompt import ImagePrompts
from specmesh.shared.multimodal.wire import to_wire
from specmesh.shared.parsers.tools import ToolParser, make_tool_parser
from specmesh.shared.protocol import (
    ABORT,
    DECODE,
    ENCODE,
    TOKENIZE,
    Abort,
    DecodeReply,
    DecodeRequest,
    EncodeReply,
    EncodeRequest,
    ResumeReply,
    ResumeRequest,
    TextDelta,
    TextDeltas,
    TokenBatch,
    TokenBatches,
    TokenizeReply,
    TokenizeRequest,
    TokenLogprob,
    detok_subject,
    gateway_subject,
    resume_subject,
)
from specmesh.shared.service import Service, ServiceConfig
from specmesh.shared.telemetry import ACTIVE_REQUESTS
from specmesh.shared.tokenizer import TextStream, Tokenizer


@dataclass
class Output:
    """A request's output as its detokenizer has it."""

    stream: TextStream
    gateway_subject: str  # where its text goes
    token_ids: list[int] = field(default_factory=list)
    attempt: int = 0  # its decode placement; tokens of an older one (it moved) are stale


class TokenizerService(Service):
    kind = "tokenizer"
    holds_requests = True

    def __init__(self, cfg: ServiceConfig, tcfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        model_dir = resolve_model(tcfg.model)
        self.tokenizer = Tokenizer(model_dir, tcfg.chat_template)
        self.images = ImagePrompts(model_dir, self.tokenizer, tcfg.max_image_pixels)
        self.streams: dict[str, Output] = {}
        self.outbox: Outbox  # once the bus is connected

    async def start(self) -> None:
        self.outbox = Outbox(self.bus, lambda deltas: TextDeltas(deltas=deltas))
        await self.bus.serve(TOKENIZE, self.tokenize, queue="tokenizer")
        await self.bus.serve(ENCODE, self.encode, queue="tokenizer")
        await self.bus.serve(DECODE, self.decode, queue="tokenizer")
        await self.bus.serve(detok_subject(self.instance_id), self.detokenize)
        await self.bus.serve(resume_subject(self.instance_id), self.resume)
        await self.bus.serve(ABORT, self.abort)

    async def drain(self) -> None:
        for subject in (TOKENIZE, ENCODE, DECODE):  # the queue group's others take over
            await self.bus.stop_serving(subject)
        while self.streams:  # the output of requests in flight still comes here
            await asyncio.sleep(0.1)

    async def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        self.aborted.check(req.request_id)
        images = None
        if req.messages is not None:
            try:
                text = self.chat_prompt(req)
            except Exception as exc:  # template errors come from the caller's messages
                raise ValueError(f"cannot apply the chat template: {exc}") from exc
            # No special tokens added: the template writes those it wants as text.
            ids = await self._encode(text, req.max_tokens, False)
            if req.images:  # decoding and resizing, off the loop
                ids, prepared = await asyncio.to_thread(self.images.expand, ids, req.images)
                images = [to_wire(image) for image in prepared]
        elif req.prompt is not None:
            text, ids = req.prompt, await self._encode(req.prompt, req.max_tokens, True)
        elif req.prompt_ids is not None:
            ids = list(req.prompt_ids)
            self.tokenizer.check_fits(ids, req.max_tokens)
            self.tokenizer.check_ids(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        else:
            raise ValueError("nothing to tokenize: give messages, a prompt or prompt ids")
        stream = TextStream(self.tokenizer, ids, req.stop, req.keep_special)
        self.streams[req.request_id] = Output(stream, req.output_subject)
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))
        return TokenizeReply(
            prompt_ids=ids, tokenizer_id=self.instance_id, prompt_text=text, images=images
        )

    async def _encode(self, text: str, max_tokens: int | None, special: bool) -> list[int]:
        """Off the loop: a long text takes seconds (heartbeats go on meanwhile)."""
        self.tokenizer.check_fits(text, max_tokens)
        return await asyncio.to_thread(self.tokenizer.encode, text, special)

    async def encode(self, req: EncodeRequest) -> EncodeReply:
        encode = self.tokenizer.encode
        return EncodeReply(token_ids=[encode(t, req.add_special_tokens) for t in req.texts])

    async def decode(self, req: DecodeRequest) -> DecodeReply:
        for ids in req.token_ids:
            self.tokenizer.check_ids(ids)
        decode = self.tokenizer.decode
        return DecodeReply(texts=[decode(ids, req.skip_special_tokens) for ids in req.token_ids])

    def chat_prompt(self, req: TokenizeRequest) -> str:
        """The chat as prompt text. A template that does not take tools or tool calls
        gets them written into the messages in the tool parser's format instead."""
        messages, tools = req.messages or [], req.tools
        template = self.tokenizer.template_source
        parser = make_tool_parser(req.tool_parser) if req.tool_parser else None
        if parser is not None and "tool_calls" not in template:
            messages = [_calls_as_text(m, parser) for m in messages]
        if parser is not None and tools and "tools" not in template:
            listing = parser.render_tools(tools)
            if messages and messages[0]["role"] == "system":
                system = {**messages[0], "content": f"{messages[0]['content']}\n\n{listing}"}
                messages = [system, *messages[1:]]
            else:
                messages = [{"role": "system", "content": listing}, *messages]
            tools = None
        kwargs = req.chat_template_kwargs or {}
        return self.tokenizer.apply_chat_template(messages, tools=tools, **kwargs)

    async def detokenize(self, msg: TokenBatches) -> None:
        for batch in msg.batches:
            await self._detokenize(batch)

    async def gateway_gone(self, gateway_id: str) -> None:
        subject = gateway_subject(gateway_id)
        for request_id, output in list(self.streams.items()):
            if output.gateway_subject == subject:
                del self.streams[request_id]
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))

    async def resume(self, req: ResumeRequest) -> ResumeReply:
        output = self.streams.get(req.request_id)
        if output is None:
            raise ValueError(f"request {req.request_id} is not detokenized here")
        output.attempt = req.attempt
        return ResumeReply(token_ids=output.token_ids)

    async def _detokenize(self, batch: TokenBatch) -> None:
        output = self.streams.get(batch.request_id)
        if output is None or batch.attempt < output.attempt:  # aborted, or moved meanwhile
            return
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
            del self.streams[batch.request_id]
            ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))
            if batch.finish_reason is None:  # a stop string: the decode worker is still going
                await self.bus.publish(ABORT, Abort(request_id=batch.request_id))
        delta = TextDelta(
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
        self.outbox.put(batch.output_subject, delta)

    async def abort(self, msg: Abort) -> None:
        self.aborted.add(msg.request_id)
        self.streams.pop(msg.request_id, None)
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.streams))

    def _logprob_entry(
        self, token: int, logprob: float, top: list[tuple[int, float]]
    ) -> TokenLogprob:
        def item(token_id: int, lp: float) -> TokenLogprob:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            return TokenLogprob(token_id=token_id, text=text, logprob=lp)

        entry = item(token, logprob)
        entry.top = [item(t, lp) for t, lp in top]
        return entry


def _calls_as_text(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    content = message.get("content") or ""
    return {**message, "content": content + parser.render_calls(calls)}
