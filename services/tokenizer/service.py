"""The tokenizer service.

Tokenizing, and turning ids to text for /detokenize, is stateless work shared by a
queue group. Detokenizing a request's output is not: the instance that tokenized it keeps
its text stream (`detokenizer.py`), and decode workers send that request's tokens to it.
A matched stop string ends the request everywhere with an Abort broadcast.
"""

from __future__ import annotations

import asyncio
from typing import Any

from specmesh.services.tokenizer.config import TokenizerConfig
from specmesh.services.tokenizer.detokenizer import Detokenizer
from specmesh.shared.bus import Outbox
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.multimodal.prompt import ImagePrompts
from specmesh.shared.multimodal.wire import to_wire
from specmesh.shared.parsers.tools import ToolParser, make_tool_parser
from specmesh.shared.protocol import (
    ABORT,
    DETOKENIZE,
    ENCODE,
    TOKENIZE,
    Abort,
    DetokenizeReply,
    DetokenizeRequest,
    EncodeReply,
    EncodeRequest,
    ResumeReply,
    ResumeRequest,
    TextDeltas,
    TokenBatches,
    TokenizeReply,
    TokenizeRequest,
    detok_subject,
    gateway_subject,
    resume_subject,
)
from specmesh.shared.service import Service, ServiceConfig
from specmesh.shared.telemetry import ACTIVE_REQUESTS
from specmesh.shared.tokenizer import TextStream, Tokenizer


class TokenizerService(Service):
    kind = "tokenizer"
    holds_requests = True

    def __init__(self, cfg: ServiceConfig, tcfg: TokenizerConfig) -> None:
        super().__init__(cfg)
        model_dir = resolve_model(tcfg.model)
        self.tokenizer = Tokenizer(model_dir, tcfg.chat_template)
        self.images = ImagePrompts(model_dir, self.tokenizer, tcfg.max_image_pixels)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.outbox: Outbox  # once the bus is connected

    async def start(self) -> None:
        self.outbox = Outbox(self.bus, lambda deltas: TextDeltas(deltas=deltas))
        await self.bus.serve(TOKENIZE, self.tokenize, queue="tokenizer")
        await self.bus.serve(ENCODE, self.encode, queue="tokenizer")
        await self.bus.serve(DETOKENIZE, self.detokenize, queue="tokenizer")
        await self.bus.serve(detok_subject(self.instance_id), self.receive_tokens)
        await self.bus.serve(resume_subject(self.instance_id), self.resume)
        await self.bus.serve(ABORT, self.abort)

    async def drain(self) -> None:
        for subject in (TOKENIZE, ENCODE, DETOKENIZE):  # the queue group's others take over
            await self.bus.stop_serving(subject)
        while self.detokenizer:  # the output of requests in flight still comes here
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
        self.detokenizer.open(req.request_id, stream, req.output_subject)
        self._count_active()
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

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        for ids in req.token_ids:
            self.tokenizer.check_ids(ids)
        texts = [self.tokenizer.decode(ids, req.skip_special_tokens) for ids in req.token_ids]
        return DetokenizeReply(texts=texts)

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

    async def receive_tokens(self, msg: TokenBatches) -> None:
        for batch in msg.batches:
            delta = self.detokenizer.push(batch)
            if delta is None:  # aborted, or moved meanwhile
                continue
            if delta.finish_reason is not None:
                self._count_active()
            if delta.finish_reason == "stop" and batch.finish_reason is None:
                # a stop string: the decode worker is still going
                await self.bus.publish(ABORT, Abort(request_id=batch.request_id))
            self.outbox.put(batch.output_subject, delta)

    async def gateway_gone(self, gateway_id: str) -> None:
        self.detokenizer.drop_gateway(gateway_subject(gateway_id))
        self._count_active()

    async def resume(self, req: ResumeRequest) -> ResumeReply:
        token_ids = self.detokenizer.resume(req.request_id, req.attempt)
        return ResumeReply(token_ids=token_ids or [], finished=token_ids is None)

    async def abort(self, msg: Abort) -> None:
        self.aborted.add(msg.request_id)
        self.detokenizer.drop(msg.request_id)
        self._count_active()

    def _count_active(self) -> None:
        ACTIVE_REQUESTS.labels(self.kind).set(len(self.detokenizer))


def _calls_as_text(message: dict[str, Any], parser: ToolParser) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if not calls:
        return message
    content = message.get("content") or ""
    return {**message, "content": content + parser.render_calls(calls)}
