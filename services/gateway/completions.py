"""/v1/completions: prompts as tokenizer work, the output as OpenAI text choices."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from specmesh.services.gateway.cluster import Cluster, Generation
from specmesh.services.gateway.respond import (
    choice_params,
    events,
    include_usage,
    raise_if_failed,
    respond,
    spec_metrics,
    start,
    usage,
)
from specmesh.services.gateway.schema import CompletionRequest
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.protocol import TextDelta, TokenizeRequest

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions


def tokenize_request(prompt: str | list[int], request_id: str, stop: list[str]) -> TokenizeRequest:
    if isinstance(prompt, str):
        return TokenizeRequest(request_id=request_id, prompt=prompt, stop=stop)
    return TokenizeRequest(request_id=request_id, prompt_ids=prompt, stop=stop)


class CompletionChoice:
    """One choice's output, delta by delta: text (after the echoed prompt) and
    logprobs in the completions shape (tokens, token_logprobs, top_logprobs, text_offset)."""

    def __init__(self, index: int, req: CompletionRequest, prompt_text: str) -> None:
        self.index = index
        self.echo = prompt_text if req.echo else ""
        self.want_logprobs = req.logprobs is not None
        self.offset = len(self.echo)  # where the next token's text starts
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.spec: SpecStats | None = None

    def feed(self, delta: TextDelta) -> tuple[str, dict[str, list[Any]] | None]:
        """The text this output adds (the echo before the first), and its logprobs."""
        self.completion_tokens += delta.num_tokens
        text, self.echo = self.echo + delta.text, ""
        if delta.finish_reason is not None:
            self.finish_reason, self.spec = delta.finish_reason, delta.spec
        if not self.want_logprobs:
            return text, None
        logprobs: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for entry in delta.logprobs or []:
            logprobs["tokens"].append(entry.text)
            logprobs["token_logprobs"].append(entry.logprob)
            logprobs["top_logprobs"].append({alt.text: alt.logprob for alt in entry.top})
            logprobs["text_offset"].append(self.offset)
            self.offset += len(entry.text)
        return text, logprobs


def merge_logprobs(parts: list[dict[str, list[Any]] | None]) -> dict[str, list[Any]] | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {key: [v for p in present for v in p[key]] for key in present[0]}


def completion_routes(cluster: Cluster, model_name: str) -> APIRouter:
    """POST /v1/completions over `cluster`."""
    router = APIRouter()

    @router.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = req.sampling_params(req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
        stop = req.stop_strings()
        prompts = [
            [
                (
                    tokenize_request(prompt, f"{request_id}-{p * req.n + i}", stop),
                    choice_params(params, i),
                )
                for i in range(req.n)
            ]
            for p, prompt in enumerate(req.prompts())
        ]
        generation = await start(
            cluster, model_name, "/v1/completions", req.model, request_id, prompts
        )
        outputs = {
            t.request_id: CompletionChoice(
                p * req.n + i, req, generation.placements[t.request_id].prompt_text
            )
            for p, choices in enumerate(prompts)
            for i, (t, _) in enumerate(choices)
        }
        head = {"id": request_id, "created": int(time.time()), "model": model_name}

        async def collect() -> dict[str, Any]:
            texts: dict[str, list[str]] = {rid: [] for rid in outputs}
            logprobs: dict[str, list[Any]] = {rid: [] for rid in outputs}
            async for delta in generation.deltas():
                raise_if_failed(delta.finish_reason, delta.error)
                text, entry = outputs[delta.request_id].feed(delta)
                texts[delta.request_id].append(text)
                logprobs[delta.request_id].append(entry)
            choices = sorted(
                (
                    {
                        "index": choice.index,
                        "text": "".join(texts[rid]),
                        "logprobs": merge_logprobs(logprobs[rid]),
                        "finish_reason": choice.finish_reason,
                    }
                    for rid, choice in outputs.items()
                ),
                key=lambda c: c["index"],
            )
            return {
                **head,
                "object": "text_completion",
                "choices": choices,
                "usage": usage(generation, outputs.values()),
                **spec_metrics(outputs.values()),
            }

        stream = None
        if req.stream:
            stream = _completion_stream(generation, outputs, head, include_usage(req))
        return await respond(request, generation, stream, collect, request_id)

    return router


def _completion_stream(
    generation: Generation,
    outputs: dict[str, CompletionChoice],
    head: dict[str, Any],
    include_usage: bool,
) -> AsyncIterator[str]:
    def entry_for(delta: TextDelta) -> dict[str, Any] | None:
        choice = outputs[delta.request_id]
        text, logprobs = choice.feed(delta)
        finished = choice.finish_reason is not None
        if not text and not finished and not logprobs:
            return None
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason if finished else None,
        }

    head = {**head, "object": "text_completion"}
    return events(generation, entry_for, head, outputs.values(), include_usage)
