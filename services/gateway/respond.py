"""What the generation routes share: starting a request's sequences (errors as API errors,
the request's trace span), the collected JSON response (abandoned when the client leaves),
SSE framing, usage and the speculation fields."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from specmesh.services.gateway.cluster import (
    Cluster,
    Generation,
    Overloaded,
    Placement,
    Unavailable,
)
from specmesh.services.gateway.errors import APIError, error_body
from specmesh.services.gateway.schema import GenerationRequest
from specmesh.shared.bus import BusError
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.protocol import ProtocolError, RemoteError, TextDelta, TokenLogprob
from specmesh.shared.sampling.params import SamplingParams

tracer = trace.get_tracer("specmesh.gateway")

SEED_RANGE = 2**63  # per-choice seeds stay in int64


async def start(
    cluster: Cluster,
    model_name: str,
    route: str,
    model: str | None,
    request_id: str,
    prompts: list[list[Any]],
) -> Generation:
    """Start the request's sequences (for the `model` it names), errors turned into API
    errors."""
    if model not in (None, "", model_name):
        raise APIError(404, f"model {model!r} not found", "model")
    try:
        # Below the request's own span (access.py), tagged with its id: traces are found by it.
        attributes = {"specmesh.request_id": request_id}
        with tracer.start_as_current_span(f"start {route}", attributes=attributes) as span:
            generation = await cluster.generate(prompts)
            placement = next(iter(generation.placements.values()))
            span.set_attribute("specmesh.decode", placement.decode_id)
            span.set_attribute("specmesh.drafter", placement.drafter_id or "")
    except RemoteError as exc:
        raise APIError(exc.status, str(exc)) from exc
    except ProtocolError as exc:  # a value or a size no message can carry
        raise APIError(exc.status, str(exc)) from exc
    except Overloaded as exc:
        raise APIError(429, str(exc)) from exc
    except (Unavailable, BusError) as exc:
        raise APIError(503, str(exc)) from exc
    return generation


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Seeded choices differ from each other but repeat across identical requests."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index + SEED_RANGE) % (2 * SEED_RANGE) - SEED_RANGE
    return dataclasses.replace(params, seed=seed)


def raise_if_failed(finish_reason: str | None, error: str | None) -> None:
    if finish_reason == "error":
        raise APIError(500, error or "generation failed")


def include_usage(req: GenerationRequest) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def respond(
    request: Request,
    generation: Generation,
    stream: AsyncIterator[str] | None,
    collect: Callable[[], Coroutine[Any, Any, Any]],
    request_id: str,
) -> Response:
    """The SSE `stream` if the request streams, else the collected JSON, unless the client
    leaves first (then abort the work); `x-request-id` either way."""
    headers = {"x-request-id": request_id}
    if stream is not None:
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
    task = asyncio.create_task(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return JSONResponse(task.result(), headers=headers)
            if await request.is_disconnected():
                return Response(status_code=499)  # nobody reads it
    finally:
        task.cancel()
        generation.close()


def usage(generation: Generation, choices: Any) -> dict[str, Any]:
    """Each prompt counts once, however many choices it has."""
    prompts: dict[tuple[int, ...], Placement] = {}
    for placement in generation.placements.values():
        prompts.setdefault(tuple(placement.prompt_ids), placement)
    prompt_tokens = sum(len(p.prompt_ids) for p in prompts.values())
    cached = sum(len(p.prompt_ids) - p.num_computed_tokens for p in prompts.values())
    completion_tokens = sum(c.completion_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def spec_totals(choices: Any) -> SpecStats | None:
    """Speculation over the request's choices (None: none speculated)."""
    specs = [c.spec for c in choices if c.spec is not None]
    return sum(specs, SpecStats()) if specs else None


def spec_metrics(choices: Any) -> dict[str, Any]:
    """Speculation over the request's choices, under the names aiperf reads."""
    spec = spec_totals(choices)
    if spec is None:
        return {}
    return {
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": spec.steps,
                "num_draft_tokens": spec.draft_tokens,
                "num_accepted_draft_tokens": spec.accepted_tokens,
                "draft_acceptance_rate": spec.acceptance_rate,
                "mean_acceptance_length": spec.acceptance_length,
            }
        }
    }


def openai_logprobs(entries: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    """Logprob entries in the chat API's shape (`content` items)."""

    def item(entry: TokenLogprob) -> dict[str, Any]:
        return {"token": entry.text, "logprob": entry.logprob, "bytes": list(entry.text.encode())}

    return [{**item(e), "top_logprobs": [item(t) for t in e.top]} for e in entries or []]


def sse(body: dict[str, Any] | str) -> str:
    """One server-sent event with `body` (JSON, or a bare marker such as [DONE])."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def events(
    generation: Generation,
    entry_for: Callable[[TextDelta], dict[str, Any] | None],
    head: dict[str, Any],
    choices: Any,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE framing shared by chat and completions (`head["object"]` names the chunks): a
    chunk per delta that has something to say, a failure as an error event, the usage
    chunk when asked, one [DONE]; aborts if the client leaves."""
    try:
        async for delta in generation.deltas():
            if delta.finish_reason == "error":
                yield sse(error_body(500, delta.error or "generation failed"))
                break
            if (entry := entry_for(delta)) is not None:
                yield sse({**head, "choices": [entry]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(generation, choices)})
        yield sse("[DONE]")
    finally:
        generation.close()
