"""/v1/responses: OpenAI's Responses API on the chat machinery.

A request becomes a chat request (input items as messages, flat function tools as
chat tools), so its prompt, sampling and parsers are chat's (`ChatPlan`, `ChatChoice`);
the choice's message deltas then become Responses output items (reasoning, message,
function_call) and the typed events that build them. A collected response is the
last of those events, so streamed and collected output are the same.

The gateway keeps no state: `previous_response_id`, `conversation` and `background`
are refused (the client sends the conversation in `input`) and `store` reads false.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import Discriminator, Field, Tag, ValidationError, field_validator
from specmesh.services.gateway.chat import ChatChoice, ChatPlan
from specmesh.services.gateway.cluster import Cluster, Generation
from specmesh.services.gateway.errors import APIError
from specmesh.services.gateway.respond import respond, spec_metrics, start, usage
from specmesh.services.gateway.schema import (
    Body,
    ChatCompletionRequest,
    ReasoningEffort,
    Temperature,
    TokenCount,
    TopP,
)
from specmesh.shared.parsers.reasoning import ReasoningParser
from specmesh.shared.parsers.tools import ToolParser
from specmesh.shared.sampling.params import SamplingParams

ROUTE = "/v1/responses"
TEXT_PARTS = frozenset({"input_text", "output_text"})

Content = str | list[dict[str, Any]]  # a string, or parts (only text ones pass _text)


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content


class FunctionCallItem(Body):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Body):
    type: Literal["function_call_output"]
    call_id: str
    output: Content


class ReasoningItem(Body):
    """Reasoning a client sends back with an earlier output: accepted, not shown to the
    model again (chat templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


def _item_type(item: Any) -> str | None:
    """Messages may leave their type out."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_type,
        custom_error_type="input_item",
        custom_error_message="input items are messages, function_call, function_call_output"
        " or reasoning items",
    ),
]

InputItems = Annotated[list[InputItem], Field(min_length=1)]


class ResponsesTool(Body):
    """A tool as Responses writes it: a function's fields beside its type. Other types
    (web_search, file_search...) parse, to be refused with a clear message."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """`text.format`: free text, any JSON object, or JSON matching `schema`."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def chat_format(self) -> dict[str, Any] | None:
        """Chat's `response_format` for it."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name or "response", "schema": self.schema_, "strict": self.strict}
        return {"type": "json_schema", "json_schema": schema}


class TextOptions(Body):
    format: TextFormat = TextFormat()


class ReasoningOptions(Body):
    effort: ReasoningEffort | None = None
    summary: str | None = None


class ResponsesRequest(Body):
    """The Responses body; what needs stored state is parsed only to be refused."""

    model: str | None = None
    input: InputItems
    instructions: str | None = None
    max_output_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningOptions | None = None
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None  # accepted; nothing is stored
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    background: bool | None = None

    @field_validator("input", mode="before", json_schema_input_type=str | InputItems)
    @classmethod
    def _string_is_a_user_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request this one asks for; what it asks that this server cannot
        do is refused (400), and chat's own checks (tool_choice among tools...) apply."""
        self._refuse_stateful()
        body = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "tools": [_chat_tool(tool, i) for i, tool in enumerate(self.tools or [])] or None,
            "tool_choice": _chat_tool_choice(self.tool_choice),
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": self.reasoning.effort if self.reasoning else None,
            "response_format": self.text.format.chat_format() if self.text else None,
            "user": self.user,
        }
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from exc

    def _refuse_stateful(self) -> None:
        """Nothing is stored here: no response to continue from or to fetch later."""
        for param in ("previous_response_id", "conversation"):
            if getattr(self, param) is not None:
                message = f"{param} is not supported: this server does not store responses;"
                raise APIError(400, f"{message} send the whole conversation in `input`", param)
        if self.background:
            message = "background is not supported: this server does not store responses"
            raise APIError(400, f"{message} to fetch later; stream instead", "background")

    def _messages(self) -> list[dict[str, Any]]:
        """Chat messages: instructions first, a function_call joins the assistant turn
        before it (parallel calls are one turn), its output becomes a tool message."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        for i, item in enumerate(self.input):
            if isinstance(item, MessageItem):
                content = _text(item.content, f"input.{i}.content")
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                function = {"name": item.name, "arguments": item.arguments}
                call = {"id": item.call_id, "type": "function", "function": function}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                content = _text(item.output, f"input.{i}.output")
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        return messages


def _text(content: Content, param: str) -> str:
    """The text of a content; images and files are refused (the models read text)."""
    if isinstance(content, str):
        return content
    for i, part in enumerate(content):
        if part.get("type") not in TEXT_PARTS or not isinstance(part.get("text"), str):
            message = f"{part.get('type')!r} content is not supported: only text parts"
            raise APIError(400, message, f"{param}.{i}")
    return "".join(part["text"] for part in content)


def _chat_tool(tool: ResponsesTool, index: int) -> dict[str, Any]:
    if tool.type != "function":
        message = f"{tool.type!r} tools are not supported: only function tools"
        raise APIError(400, message, f"tools.{index}.type")
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | NamedFunctionChoice | None) -> Any:
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


# --- output items and events ----------------------------------------------------


@dataclass(frozen=True)
class TextKind:
    """One kind of text item: the assistant's message, or its reasoning."""

    prefix: str  # of the item ids
    item: dict[str, Any]  # the item's fixed fields
    part: dict[str, Any]  # its one content part's, besides the text
    event: str  # its text events are `<event>.delta` and `<event>.done`
    extra: dict[str, Any]  # what those events carry besides the text


MESSAGE = TextKind(
    "msg",
    {"type": "message", "role": "assistant"},
    {"type": "output_text", "annotations": [], "logprobs": []},
    "response.output_text",
    {"logprobs": []},
)
REASONING = TextKind(
    "rs",
    {"type": "reasoning", "summary": []},
    {"type": "reasoning_text"},
    "response.reasoning_text",
    {},
)


class OutputItems:
    """A choice's chat message deltas as Responses output items, and the events that
    build them. Text goes to the open item of its kind; output of another kind closes
    it (reasoning, then the message, then calls, as a model writes them)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # the closed ones
        self.kind: TextKind | None = None  # the open text item's
        self.item_id = ""
        self.text = ""

    def feed(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, key in ((REASONING, "reasoning_content"), (MESSAGE, "content")):
            if message.get(key):
                events += self._write(kind, message[key])
        for call in message.get("tool_calls", []):
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[dict[str, Any]]:
        """Close the open item (incomplete: the length limit cut it); output with
        nothing in it still gets its (empty) message."""
        events = [] if self.items or self.kind else self._open(MESSAGE)
        return events + self._close("incomplete" if incomplete else "completed")

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def _write(self, kind: TextKind, text: str) -> list[dict[str, Any]]:
        events = [] if kind is self.kind else self._close("completed") + self._open(kind)
        self.text += text
        return [
            *events,
            {"type": f"{kind.event}.delta", **self._where(), "delta": text, **kind.extra},
        ]

    def _open(self, kind: TextKind) -> list[dict[str, Any]]:
        self.kind, self.item_id, self.text = kind, f"{kind.prefix}_{uuid.uuid4().hex}", ""
        item = {"id": self.item_id, **kind.item, "status": "in_progress", "content": []}
        part = {**kind.part, "text": ""}
        return [
            {"type": "response.output_item.added", "output_index": len(self.items), "item": item},
            {"type": "response.content_part.added", **self._where(), "part": part},
        ]

    def _close(self, status: str) -> list[dict[str, Any]]:
        kind, where = self.kind, self._where()
        if kind is None:
            return []
        self.kind = None
        part = {**kind.part, "text": self.text}
        item = {"id": self.item_id, **kind.item, "status": status, "content": [part]}
        self.items.append(item)
        return [
            {"type": f"{kind.event}.done", **where, "text": self.text, **kind.extra},
            {"type": "response.content_part.done", **where, "part": part},
            {
                "type": "response.output_item.done",
                "output_index": where["output_index"],
                "item": item,
            },
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A whole call (the tool parser gives whole calls): one arguments delta."""
        events, index = self._close("completed"), len(self.items)
        function = call["function"]
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": function["arguments"],
            "status": "completed",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": index}
        added = {**item, "arguments": "", "status": "in_progress"}
        return [
            *events,
            {"type": "response.output_item.added", "output_index": index, "item": added},
            {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
            {
                "type": "response.function_call_arguments.done",
                **where,
                "arguments": item["arguments"],
            },
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]


def _head(
    req: ResponsesRequest, request_id: str, model_name: str, params: SamplingParams
) -> dict[str, Any]:
    """What every snapshot of the response repeats: its id and the request's settings
    (temperature and top_p as sampled)."""
    choice = req.tool_choice or "auto"
    return {
        "id": request_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": model_name,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "tools": [tool.model_dump() for tool in req.tools or []],
        "tool_choice": choice.model_dump() if isinstance(choice, NamedFunctionChoice) else choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "reasoning": req.reasoning.model_dump() if req.reasoning else None,
        "metadata": req.metadata or {},
        "user": req.user,
        "store": False,
        "background": False,
        "text": (req.text or TextOptions()).model_dump(by_alias=True, exclude_none=True),
    }


def _snapshot(
    head: dict[str, Any], status: str, output: list[dict[str, Any]], **fields: Any
) -> dict[str, Any]:
    """The response as it stands: `fields` fill what is known (usage, error...)."""
    empty = {"error": None, "incomplete_details": None, "usage": None}
    return {**head, "status": status, "output": output, **empty, **fields}


def _usage(generation: Generation, choice: ChatChoice) -> dict[str, Any]:
    """chat's usage under the Responses names."""
    counts = usage(generation, [choice])
    return {
        "input_tokens": counts["prompt_tokens"],
        # No cache writes to report apart: the prefix cache keeps computed blocks as it goes.
        "input_tokens_details": {**counts["prompt_tokens_details"], "cache_write_tokens": 0},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": counts["total_tokens"],
    }


async def _events(
    generation: Generation, choice: ChatChoice, head: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The response's events as its output arrives, from response.created to its last:
    response.completed, response.incomplete (the length limit), or response.failed."""
    output = OutputItems()
    yield {"type": "response.created", "response": _snapshot(head, "in_progress", [])}
    yield {"type": "response.in_progress", "response": _snapshot(head, "in_progress", [])}
    async for delta in generation.deltas():
        if delta.finish_reason == "error":
            error = {"code": "server_error", "message": delta.error or "generation failed"}
            yield {
                "type": "response.failed",
                "response": _snapshot(head, "failed", [], error=error),
            }
            return
        for event in output.feed(choice.feed(delta)):
            yield event
    incomplete = choice.finish_reason == "length"
    for event in output.finish(incomplete):
        yield event
    status = "incomplete" if incomplete else "completed"
    response = _snapshot(
        head,
        status,
        output.items,
        usage=_usage(generation, choice),
        incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        **spec_metrics([choice]),
    )
    yield {"type": f"response.{status}", "response": response}


async def _sse(events: AsyncIterator[dict[str, Any]], generation: Generation) -> AsyncIterator[str]:
    """Responses' SSE: an `event:` line naming each event, which is numbered; aborts
    the work when the client leaves."""
    numbers = itertools.count()
    try:
        async for event in events:
            data = json.dumps({**event, "sequence_number": next(numbers)})
            yield f"event: {event['type']}\ndata: {data}\n\n"
    finally:
        generation.close()


def response_routes(
    cluster: Cluster,
    model_name: str,
    tool_parser: ToolParser,
    reasoning: ReasoningParser | None,
) -> APIRouter:
    """POST /v1/responses over `cluster`."""
    router = APIRouter()

    @router.post(ROUTE, response_model=None)
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        chat = req.chat_request()
        plan = ChatPlan(chat, tool_parser, reasoning)
        request_id = f"resp_{uuid.uuid4().hex}"
        params = plan.sampling_params(chat.max_completion_tokens or 0, None)
        work = (plan.tokenize_request(f"{request_id}-0", []), params)
        generation = await start(cluster, model_name, ROUTE, chat.model, request_id, [[work]])
        choice = plan.choice(0, generation.placements[work[0].request_id].prompt_text)
        events = _events(generation, choice, _head(req, request_id, model_name, params))

        async def collect() -> dict[str, Any]:
            async for event in events:
                last = event
            if last["type"] == "response.failed":
                raise APIError(500, last["response"]["error"]["message"])
            return last["response"]

        stream = _sse(events, generation) if req.stream else None  # its last event has usage
        return await respond(request, generation, stream, collect, request_id)

    return router
