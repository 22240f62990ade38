"""/v1/chat/completions: the request as tokenizer work, the output as OpenAI choices.

Each choice's text passes through the reasoning parser (reasoning_content) and
then the tool parser (tool_calls). Streamed and non-streamed responses come
from the same per-delta processing, so their text is the same.
"""

from __future__ import annotations

from typing import Any

from services.gateway.errors import APIError
from services.gateway.schema import ChatCompletionRequest, NamedToolChoice
from shared.parsers.reasoning import ReasoningParser
from shared.parsers.tools import ToolCall, ToolParser
from shared.protocol import TextDelta, TokenizeRequest


class ChatPlan:
    """What the gateway's options and a request make of it: the prompt's tokenizer
    work and the parsers its output goes through."""

    def __init__(
        self,
        req: ChatCompletionRequest,
        tool_parser: ToolParser | None,
        reasoning_parser: ReasoningParser | None,
    ) -> None:
        self.req = req
        self.reasoning_parser = reasoning_parser
        choice = req.tool_choice or "auto"
        use_tools = bool(req.tools) and choice != "none"
        if use_tools and tool_parser is None:
            raise APIError(
                400, "tool calling needs the server started with --tool-call-parser", "tools"
            )
        self.tool_parser = tool_parser if use_tools else None
        self.call_prefix = ""
        if self.tool_parser is not None and choice != "auto":
            name = choice.function.name if isinstance(choice, NamedToolChoice) else None
            self.call_prefix = self.tool_parser.call_prefix(name)

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
            assistant_prefix=self.call_prefix,
        )

    def choice(self, index: int) -> ChatChoice:
        return ChatChoice(index, self)


class ChatChoice:
    """One choice's output, delta by delta."""

    def __init__(self, index: int, plan: ChatPlan) -> None:
        self.index = index
        self.reasoning = plan.reasoning_parser.stream() if plan.reasoning_parser else None
        self.tools = plan.tool_parser.stream() if plan.tool_parser else None
        self.parallel_calls = plan.req.parallel_tool_calls
        self.calls: list[ToolCall] = []
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.spec: dict[str, int] | None = None
        if self.tools is not None and plan.call_prefix:
            self.tools.feed(plan.call_prefix)  # the forced call's start is output too

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
