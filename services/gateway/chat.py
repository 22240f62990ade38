"""/v1/chat/completions: the request as tokenizer work, the output as OpenAI choices.

Each choice's text passes through the reasoning parser (reasoning_content) and
then the tool parser (tool_calls). Streamed and non-streamed responses come
from the same per-delta processing, so their text is the same.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from specmesh.services.gateway.cluster import Cluster, Generation
from specmesh.services.gateway.errors import APIError
from specmesh.services.gateway.respond import (
    choice_params,
    events,
    include_usage,
    openai_logprobs,
    raise_if_failed,
    respond,
    spec_metrics,
    start,
    usage,
)
from specmesh.services.gateway.schema import ChatCompletionRequest, NamedToolChoice
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.multimodal.data_url import image_bytes
from specmesh.shared.parsers.reasoning import ReasoningParser
from specmesh.shared.parsers.tools import ToolCall, ToolParser
from specmesh.shared.protocol import TextDelta, TokenizeRequest
from specmesh.shared.sampling.params import SamplingParams


class ChatPlan:
    """What the gateway's options and a request make of it: the prompt's tokenizer
    work, the grammar its output must follow (a forced tool call's, or the request's
    response_format) and the parsers its output goes through."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        tool_parser: ToolParser,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.req = req
        self.reasoning_parser = reasoning_parser
        choice = req.tool_choice or "auto"
        use_tools = bool(req.tools) and choice != "none"
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        self.tool_parser = tool_parser.for_request(tools) if use_tools else None
        self.grammar = req.grammar()
        try:
            self.images = [image_bytes(url) for m in req.messages for url in m.image_urls()]
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from exc
        if self.tool_parser is not None and choice != "auto":
            if self.grammar is not None:
                message = "a forced tool call cannot also follow response_format, regex or ebnf"
                raise APIError(400, message, "tool_choice")
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            self.grammar = self.tool_parser.call_grammar(tools, name, req.parallel_tool_calls)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        params = self.req.sampling_params(max_tokens, logprobs)
        return dataclasses.replace(params, grammar=self.grammar)

    def tokenize_request(self, request_id: str, stop: list[str]) -> TokenizeRequest:
        req = self.req
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        return TokenizeRequest(
            request_id=request_id,
            messages=[m.for_template() for m in req.messages],
            chat_template_kwargs=kwargs,
            stop=stop,
            tools=tools if self.tool_parser else None,
            tool_parser=self.tool_parser.name if self.tool_parser else None,
            keep_special=self.parser_markers(),
            images=self.images or None,
        )

    def parser_markers(self) -> list[str]:
        """The markers this request's parsers read (kept in its output text where they are
        special tokens, as Mistral's [TOOL_CALLS] and [THINK] are)."""
        markers = list(self.tool_parser.markers) if self.tool_parser else []
        if self.reasoning_parser is not None:
            markers += [self.reasoning_parser.start_tag, self.reasoning_parser.end_tag]
        return markers

    def choice(self, index: int, prompt_text: str) -> ChatChoice:
        """Choice `index`, whose output continues `prompt_text` (the rendered prompt)."""
        return ChatChoice(index, self, prompt_text)


class ChatChoice:
    """One choice's output, delta by delta."""

    def __init__(self, index: int, plan: ChatPlan, prompt_text: str) -> None:
        self.index = index
        # The prompt tells whether the template opened or closed a thinking section.
        reasoning = plan.reasoning_parser
        self.reasoning = reasoning.stream(prompt_text) if reasoning else None
        self.tools = plan.tool_parser.stream() if plan.tool_parser else None
        self.parallel_calls = plan.req.parallel_tool_calls
        self.calls: list[ToolCall] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.spec: SpecStats | None = None

    def feed(self, delta: TextDelta) -> dict[str, Any]:
        """The message delta this output adds: content, reasoning_content, tool_calls."""
        self.completion_tokens += delta.num_tokens
        finished = delta.finish_reason is not None
        reasoning, content = "", delta.text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta.text)
            if finished:
                more_reasoning, more_content = self.reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[ToolCall] = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                more_content, more_calls = self.tools.finish()
                content, calls = content + more_content, calls + more_calls
        if not self.parallel_calls:
            calls = calls[: max(0, 1 - len(self.calls))]
        message: dict[str, Any] = {}
        if reasoning:
            message["reasoning_content"] = reasoning
        if content:
            message["content"] = content
        if calls:
            message["tool_calls"] = [
                {
                    "index": len(self.calls) + i,
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for i, call in enumerate(calls)
            ]
            self.calls += calls
        if finished:
            self.spec = delta.spec
            self.finish_reason = delta.finish_reason
            if self.calls and delta.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        return message


def merge_message(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A whole assistant message from its deltas (content null when only tools answer)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [
        {k: v for k, v in call.items() if k != "index"}
        for d in deltas
        for call in d.get("tool_calls", [])
    ]
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if not calls:
        message["content"] = content
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def chat_routes(
    cluster: Cluster,
    model_name: str,
    tool_parser: ToolParser,
    reasoning: ReasoningParser | None,
) -> APIRouter:
    """POST /v1/chat/completions over `cluster`."""
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        plan = ChatPlan(req, tool_parser, reasoning)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens or 0
        params = plan.sampling_params(max_tokens, logprobs)
        stop = req.stop_strings()
        choices = [
            (plan.tokenize_request(f"{request_id}-{i}", stop), choice_params(params, i))
            for i in range(req.n)
        ]
        generation = await start(
            cluster, model_name, "/v1/chat/completions", req.model, request_id, [choices]
        )
        outputs = {
            t.request_id: plan.choice(i, generation.placements[t.request_id].prompt_text)
            for i, (t, _) in enumerate(choices)
        }
        head = {"id": request_id, "created": int(time.time()), "model": model_name}

        async def collect() -> dict[str, Any]:
            messages: dict[str, list[dict[str, Any]]] = {rid: [] for rid in outputs}
            logprob_entries: dict[str, list[dict[str, Any]]] = {rid: [] for rid in outputs}
            async for delta in generation.deltas():
                raise_if_failed(delta.finish_reason, delta.error)
                messages[delta.request_id].append(outputs[delta.request_id].feed(delta))
                logprob_entries[delta.request_id] += openai_logprobs(delta.logprobs)
            return {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": choice.index,
                        "message": merge_message(messages[rid]),
                        "logprobs": {"content": logprob_entries[rid]} if req.logprobs else None,
                        "finish_reason": choice.finish_reason,
                    }
                    for rid, choice in outputs.items()
                ],
                "usage": usage(generation, outputs.values()),
                **spec_metrics(outputs.values()),
            }

        stream = None
        if req.stream:
            stream = _chat_stream(generation, outputs, head, req.logprobs, include_usage(req))
        return await respond(request, generation, stream, collect, request_id)

    return router


def _chat_stream(
    generation: Generation,
    outputs: dict[str, ChatChoice],
    head: dict[str, Any],
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    started: set[str] = set()

    def entry_for(delta: TextDelta) -> dict[str, Any] | None:
        choice = outputs[delta.request_id]
        message = choice.feed(delta)
        finished = choice.finish_reason is not None
        if not message and not finished and not (want_logprobs and delta.logprobs):
            return None
        if delta.request_id not in started:  # the role rides on the first real chunk
            started.add(delta.request_id)
            message = {"role": "assistant", **message}
        entry: dict[str, Any] = {
            "index": choice.index,
            "delta": message,
            "finish_reason": choice.finish_reason if finished else None,
        }
        if want_logprobs:
            entry["logprobs"] = {"content": openai_logprobs(delta.logprobs)}
        return entry

    head = {**head, "object": "chat.completion.chunk"}
    return events(generation, entry_for, head, outputs.values(), include_usage)
