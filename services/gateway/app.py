"""The gateway's FastAPI app: the OpenAI API over the services (see cluster.py).

Every error leaves as OpenAI error JSON (see errors.py). A request becomes one
sequence per choice and prompt; a client that goes away, streaming or not,
aborts its sequences in every service.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.chat import ChatChoice, ChatPlan, merge_message
from services.gateway.cluster import Cluster, Generation, Overloaded, Placement, Unavailable
from services.gateway.completions import CompletionChoice, merge_logprobs, tokenize_request
from services.gateway.config import GatewayConfig
from services.gateway.errors import APIError, error_body, error_response
from services.gateway.schema import ChatCompletionRequest, CompletionRequest, GenerationRequest
from shared.bus import BusError
from shared.config import DEFAULT_MODEL_NAME
from shared.parsers.reasoning import make_reasoning_parser
from shared.parsers.tools import make_tool_parser
from shared.protocol import ProtocolError, RemoteError, TextDelta
from shared.sampling.params import SamplingParams

tracer = trace.get_tracer("specmesh.gateway")

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
SEED_RANGE = 2**63  # per-choice seeds stay in int64


# Probes and scrapers reach these without the API key; nothing else.
OPEN_PATHS = frozenset({"/health", "/metrics"})


class Guard:
    """ASGI middleware: the API key on every route but OPEN_PATHS, and the body size limit."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body: int) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.api_key and scope["path"] not in OPEN_PATHS:
            given = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                response = error_response(401, "invalid or missing API key (Authorization: Bearer)")
                return await response(scope, receive, send)
        length = headers.get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            status = 413 if length.isdigit() else 400
            message = f"request body over {self.max_body} bytes" if status == 413 else "bad length"
            return await error_response(status, message)(scope, receive, send)
        received = 0

        async def counted() -> Message:  # bodies sent without a length are counted too
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise APIError(413, f"request body over {self.max_body} bytes")
            return message

        await self.app(scope, counted, send)


def build_app(cluster: Cluster, cfg: GatewayConfig) -> FastAPI:
    model_name = cfg.model_name
    tool_parser = make_tool_parser(cfg.tool_call_parser) if cfg.tool_call_parser else None
    reasoning = make_reasoning_parser(cfg.reasoning_parser) if cfg.reasoning_parser else None
    app = FastAPI(title="specmesh", summary="OpenAI-compatible API with speculative decoding")
    app.add_middleware(Guard, api_key=cfg.api_key, max_body=cfg.max_request_bytes)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return error_response(400, message, param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_response(500, f"internal error: {type(exc).__name__}")

    @app.get("/health")
    async def health() -> JSONResponse:
        """Ready when a decode worker is alive (503 otherwise, so orchestrators wait)."""
        workers = len(cluster.live("decode"))
        body = {"status": "ok" if workers else "no decode workers", "decode_workers": workers}
        return JSONResponse(body, status_code=200 if workers else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """State in SGLang's shape (bench_serving reads avg_spec_accept_length)."""
        decoders = [i.heartbeat for i in cluster.live("decode")]
        stats = cluster.stats
        state: dict[str, Any] = {
            "finished_requests": stats.requests,
            "generated_tokens": stats.generated_tokens,
            "kv_blocks_free": sum(h.kv_blocks_free for h in decoders),
            "kv_blocks_total": sum(h.kv_blocks_total for h in decoders),
            "instances": {kind: len(cluster.live(kind)) for kind in ("decode", "drafter")},
        }
        algorithms = {h.algorithm for h in decoders if h.algorithm}
        if algorithms:
            state.update(
                speculative_algorithm=",".join(sorted(algorithms)),
                avg_spec_accept_length=_acceptance_length(
                    stats.spec_steps, stats.spec_accepted_tokens
                ),
                spec_verify_steps=stats.spec_steps,
                spec_draft_tokens=stats.spec_draft_tokens,
                spec_accepted_tokens=stats.spec_accepted_tokens,
            )
        return {"model_path": cfg.model or DEFAULT_MODEL_NAME, "internal_states": [state]}

    def max_model_len() -> int | None:
        """The context limit the live decode workers advertise (None before any is up)."""
        limits = [i.heartbeat.max_model_len for i in cluster.live("decode")]
        return min((n for n in limits if n), default=None)

    def model_card() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specmesh"}
        return {**card, "root": model_name, "max_model_len": max_model_len()}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        """SGLang's model info endpoint."""
        path = cfg.model or DEFAULT_MODEL_NAME
        return {
            "model_path": path,
            "tokenizer_path": path,
            "is_generation": True,
            "max_model_len": max_model_len(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != model_name:
            raise APIError(404, f"model {model_id!r} not found", "model")
        return model_card()

    async def start(
        route: str, req: GenerationRequest, request_id: str, prompts: list[list[Any]]
    ) -> Generation:
        """Start the request's sequences, errors turned into API errors."""
        if req.model not in (None, "", model_name):
            raise APIError(404, f"model {req.model!r} not found", "model")
        try:
            # The request's trace: every service's spans for it hang below this one.
            attributes = {"specmesh.request_id": request_id}
            with tracer.start_as_current_span(f"POST {route}", attributes=attributes) as span:
                generation = await cluster.generate(prompts)
                placement = next(iter(generation.placements.values()))
                span.set_attribute("specmesh.decode", placement.decode_id)
                span.set_attribute("specmesh.drafter", placement.drafter_id or "")
        except RemoteError as exc:
            raise APIError(exc.status, str(exc)) from exc
        except ProtocolError as exc:  # a value no message can carry
            raise APIError(400, str(exc)) from exc
        except Overloaded as exc:
            raise APIError(429, str(exc)) from exc
        except (Unavailable, BusError) as exc:
            raise APIError(503, str(exc)) from exc
        return generation

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        plan = ChatPlan(req, tool_parser, reasoning)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens or 0
        params = req.sampling_params(max_tokens, logprobs)
        stop = req.stop_strings()
        choices = [
            (plan.tokenize_request(f"{request_id}-{i}", stop), _choice_params(params, i))
            for i in range(req.n)
        ]
        generation = await start("/v1/chat/completions", req, request_id, [choices])
        outputs = {t.request_id: plan.choice(i) for i, (t, _) in enumerate(choices)}
        head = {"id": request_id, "created": int(time.time()), "model": model_name}
        headers = {"x-request-id": request_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _chat_stream(generation, outputs, head, req.logprobs, include_usage)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)

        async def collect() -> dict[str, Any]:
            messages: dict[str, list[dict[str, Any]]] = {rid: [] for rid in outputs}
            logprob_entries: dict[str, list[dict[str, Any]]] = {rid: [] for rid in outputs}
            async for delta in generation.deltas():
                _raise_if_failed(delta.finish_reason, delta.error)
                messages[delta.request_id].append(outputs[delta.request_id].feed(delta))
                logprob_entries[delta.request_id] += delta.logprobs or []
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
                "usage": _usage(generation, outputs.values()),
                **_spec_metrics(outputs.values()),
            }

        return await _respond(request, generation, collect, headers)

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        request_id = f"cmpl-{uuid.uuid4().hex}"
        params = req.sampling_params(req.max_tokens or DEFAULT_COMPLETION_TOKENS, req.logprobs)
        stop = req.stop_strings()
        prompts = [
            [
                (
                    tokenize_request(prompt, f"{request_id}-{p * req.n + i}", stop),
                    _choice_params(params, i),
                )
                for i in range(req.n)
            ]
            for p, prompt in enumerate(req.prompts())
        ]
        generation = await start("/v1/completions", req, request_id, prompts)
        outputs = {
            t.request_id: CompletionChoice(
                p * req.n + i, req, generation.placements[t.request_id].prompt_text
            )
            for p, choices in enumerate(prompts)
            for i, (t, _) in enumerate(choices)
        }
        head = {"id": request_id, "created": int(time.time()), "model": model_name}
        headers = {"x-request-id": request_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = _completion_stream(generation, outputs, head, include_usage)
            return StreamingResponse(body, media_type="text/event-stream", headers=headers)

        async def collect() -> dict[str, Any]:
            texts: dict[str, list[str]] = {rid: [] for rid in outputs}
            logprobs: dict[str, list[Any]] = {rid: [] for rid in outputs}
            async for delta in generation.deltas():
                _raise_if_failed(delta.finish_reason, delta.error)
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
                "usage": _usage(generation, outputs.values()),
                **_spec_metrics(outputs.values()),
            }

        return await _respond(request, generation, collect, headers)

    return app


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Seeded choices differ from each other but repeat across identical requests."""
    if params.seed is None or index == 0:
        return params
    seed = (params.seed + index + SEED_RANGE) % (2 * SEED_RANGE) - SEED_RANGE
    return dataclasses.replace(params, seed=seed)


def _raise_if_failed(finish_reason: str | None, error: str | None) -> None:
    if finish_reason == "error":
        raise APIError(500, error or "generation failed")


async def _respond(
    request: Request,
    generation: Generation,
    collect: Callable[[], Coroutine[Any, Any, dict[str, Any]]],
    headers: dict[str, str],
) -> Response:
    """The collected response, unless the client leaves first (then abort the work)."""
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


def _usage(generation: Generation, choices: Any) -> dict[str, Any]:
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


def _acceptance_length(steps: int, accepted: int) -> float:
    """Tokens per verify step: the accepted drafts plus the target's own token."""
    return 1 + accepted / steps if steps else 0.0


def _spec_metrics(choices: Any) -> dict[str, Any]:
    """Speculation over the request's choices, under the names aiperf reads."""
    specs = [c.spec for c in choices if c.spec]
    if not specs:
        return {}
    totals = {key: sum(s[key] for s in specs) for key in specs[0]}
    steps, drafted, accepted = totals["steps"], totals["draft_tokens"], totals["accepted_tokens"]
    return {
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": steps,
                "num_draft_tokens": drafted,
                "num_accepted_draft_tokens": accepted,
                "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_acceptance_length": _acceptance_length(steps, accepted),
            }
        }
    }


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _events(
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
                yield _sse(error_body(500, delta.error or "generation failed"))
                break
            if (entry := entry_for(delta)) is not None:
                yield _sse({**head, "choices": [entry]})
        if include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(generation, choices)})
        yield _sse("[DONE]")
    finally:
        generation.close()


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
            entry["logprobs"] = {"content": delta.logprobs or []}
        return entry

    head = {**head, "object": "chat.completion.chunk"}
    return _events(generation, entry_for, head, outputs.values(), include_usage)


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
    return _events(generation, entry_for, head, outputs.values(), include_usage)
