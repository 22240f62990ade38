"""The gateway's FastAPI app: OpenAI routes over the services (see cluster.py)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from opentelemetry import trace
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from services.gateway.cluster import Cluster, Placement, Unavailable
from services.gateway.protocol import ChatCompletionRequest
from shared.bus import BusError
from shared.protocol import RemoteError, TextDelta, TokenizeRequest
from shared.sampling.params import SamplingParams
from shared.telemetry import E2E, GENERATION_TOKENS, ITL, PROMPT_TOKENS, REQUESTS, TTFT

tracer = trace.get_tracer("specmesh.gateway")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


_ERROR_TYPES = {404: "not_found_error", 503: "service_unavailable_error", 500: "server_error"}


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        max_tokens=req.max_completion_tokens or req.max_tokens or 256,
        ignore_eos=req.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    return params


class ServerStats:
    """Totals over finished requests, for /get_server_info."""

    def __init__(self) -> None:
        self.requests = self.generated_tokens = 0
        self.spec_steps = self.spec_draft_tokens = self.spec_accepted_tokens = 0

    def add(self, usage_tokens: int, spec: dict[str, int] | None) -> None:
        self.requests += 1
        self.generated_tokens += usage_tokens
        if spec:
            self.spec_steps += spec["steps"]
            self.spec_draft_tokens += spec["draft_tokens"]
            self.spec_accepted_tokens += spec["accepted_tokens"]


def build_app(cluster: Cluster, model_name: str, model_path: str) -> FastAPI:
    app = FastAPI(title="specmesh")
    created = int(time.time())
    stats = ServerStats()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        return _error(400, f"{param}: {first['msg']}", "invalid_request_error", param)

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        type_ = _ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return _error(exc.status_code, str(exc.detail), type_)

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
                avg_spec_accept_length=(
                    1 + stats.spec_accepted_tokens / stats.spec_steps if stats.spec_steps else 0.0
                ),
                spec_verify_steps=stats.spec_steps,
                spec_draft_tokens=stats.spec_draft_tokens,
                spec_accepted_tokens=stats.spec_accepted_tokens,
            )
        return {"model_path": model_path, "internal_states": [state]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specmesh"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        arrival = time.perf_counter()
        if req.model not in (None, "", model_name):
            raise APIError(404, f"model {req.model!r} not found", "not_found_error", "model")
        params = _sampling_params(req)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        tokenize = TokenizeRequest(
            request_id, messages=messages, chat_template_kwargs=req.chat_template_kwargs, stop=stop
        )
        try:
            # The request's trace: every service's spans for it hang below this one.
            with tracer.start_as_current_span(
                "POST /v1/chat/completions", attributes={"specmesh.request_id": request_id}
            ) as span:
                placement, deltas = await cluster.submit(tokenize, params)
                span.set_attribute("specmesh.decode", placement.decode_id)
                span.set_attribute("specmesh.drafter", placement.drafter_id or "")
        except RemoteError as exc:
            type_ = _ERROR_TYPES.get(exc.status, "invalid_request_error")
            raise APIError(exc.status, str(exc), type_) from exc
        except (Unavailable, BusError) as exc:
            raise APIError(503, str(exc), "service_unavailable_error") from exc
        timed = _timed(deltas, arrival, stats)
        common = {"id": request_id, "created": int(time.time()), "model": model_name}
        headers = {"x-request-id": request_id}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _stream_chunks(timed, common, placement, req.logprobs, include_usage)
            return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
        text, logprobs, last = "", [], None
        completion_tokens = 0
        async for delta in timed:
            text += delta.text
            completion_tokens += delta.num_tokens
            logprobs += delta.logprobs or []
            last = delta
        assert last is not None
        if last.finish_reason == "error":
            raise APIError(500, last.error or "generation failed", "server_error")
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": logprobs} if req.logprobs else None,
            "finish_reason": last.finish_reason,
        }
        body = {**common, "object": "chat.completion", "choices": [choice]}
        body["usage"] = _usage(placement, completion_tokens)
        if last.spec is not None:  # per-request speculation, in the shape vLLM reports it
            spec = last.spec
            body["metrics"] = {
                "speculative_decoding": {
                    "num_verify_steps": spec["steps"],
                    "num_draft_tokens": spec["draft_tokens"],
                    "num_accepted_tokens": spec["accepted_tokens"],
                    "mean_acceptance_length": (
                        1 + spec["accepted_tokens"] / spec["steps"] if spec["steps"] else 0.0
                    ),
                }
            }
        return JSONResponse(body, headers=headers)

    return app


async def _timed(
    deltas: AsyncIterator[TextDelta], arrival: float, stats: ServerStats
) -> AsyncIterator[TextDelta]:
    """The request's deltas, recording TTFT, inter-token latency and totals."""
    last_time, tokens = None, 0
    async for delta in deltas:
        now = time.perf_counter()
        if delta.num_tokens:
            if last_time is None:
                TTFT.observe(now - arrival)
            else:
                for _ in range(delta.num_tokens):  # tokens of one step arrive together
                    ITL.observe((now - last_time) / delta.num_tokens)
            last_time = now
        tokens += delta.num_tokens
        if delta.finish_reason is not None:
            REQUESTS.labels("error" if delta.finish_reason == "error" else "ok").inc()
            E2E.observe(now - arrival)
            PROMPT_TOKENS.inc(delta.num_prompt_tokens)
            GENERATION_TOKENS.inc(tokens)
            stats.add(tokens, delta.spec)
        yield delta


def _usage(placement: Placement, completion_tokens: int) -> dict[str, Any]:
    prompt_tokens = len(placement.prompt_ids)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": prompt_tokens - placement.num_computed_tokens},
    }


async def _stream_chunks(
    deltas: AsyncIterator[TextDelta],
    common: dict[str, Any],
    placement: Placement,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    def sse(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {**common, "object": "chat.completion.chunk", "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    role_sent, completion_tokens = False, 0
    async for delta in deltas:
        completion_tokens += delta.num_tokens
        if delta.finish_reason == "error":
            error = {"message": delta.error, "type": "server_error", "param": None, "code": 500}
            yield f"data: {json.dumps({'error': error})}\n\n"
            break
        if not delta.text and not want_logprobs and delta.finish_reason is None:
            continue
        content: dict[str, Any] = {"content": delta.text}
        if not role_sent:
            content, role_sent = {"role": "assistant", **content}, True
        choice: dict[str, Any] = {
            "index": 0,
            "delta": content,
            "finish_reason": delta.finish_reason,
        }
        if want_logprobs:
            choice["logprobs"] = {"content": delta.logprobs or []}
        yield sse([choice])
    if include_usage:
        yield sse([], usage=_usage(placement, completion_tokens))
    yield "data: [DONE]\n\n"
