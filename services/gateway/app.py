"""The gateway's FastAPI app: OpenAI routes over a token-generating backend."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from services.gateway.protocol import ChatCompletionRequest
from shared.engine.async_engine import AsyncEngine
from shared.engine.engine import TokenOutput
from shared.engine.speculation import SpecStats
from shared.sampling.params import SamplingParams
from shared.tokenizer import TextStream, Tokenizer


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


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
    return SamplingParams(
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


def _logprob_entry(tokenizer: Tokenizer, out: TokenOutput) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    entry = item(out.token_id, out.logprob if out.logprob is not None else 0.0)
    entry["top_logprobs"] = [item(t, lp) for t, lp in out.top_logprobs or []]
    return entry


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, model_name: str) -> FastAPI:
    app = FastAPI(title="specmesh")
    created = int(time.time())

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
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), type_)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        """Engine state in SGLang's shape (bench_serving reads avg_spec_accept_length)."""
        llm = engine.engine
        state: dict[str, Any] = {
            "steps": llm.stats.steps,
            "generated_tokens": llm.stats.generated_tokens,
            "kv_blocks_free": llm.block_manager.num_free,
            "kv_blocks_total": llm.kv_cache.num_blocks,
            "prefix_reused_tokens": llm.block_manager.reused_tokens,
        }
        if llm.speculator is not None:
            spec = llm.speculator.stats
            state.update(
                speculative_algorithm=llm.speculator.cfg.speculative_algorithm,
                avg_spec_accept_length=spec.acceptance_length,
                spec_verify_steps=spec.steps,
                spec_draft_tokens=spec.draft_tokens,
                spec_accepted_tokens=spec.accepted_tokens,
            )
        return {"model_path": llm.cfg.model, "internal_states": [state]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "specmesh"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        if req.model not in (None, "", model_name):
            raise APIError(404, f"model {req.model!r} not found", "not_found_error", "model")
        params = _sampling_params(req)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        try:
            prompt_ids = tokenizer.encode_chat(messages, **(req.chat_template_kwargs or {}))
        except Exception as exc:  # template errors are the caller's input
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        stream = TextStream(tokenizer, prompt_ids, stop)
        try:
            tokens = engine.generate(request_id, prompt_ids, params)
            first = await anext(tokens)  # surfaces a rejected request before any response
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        common = {"id": request_id, "created": int(time.time()), "model": model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chunks = _stream_chunks(
                tokenizer,
                stream,
                first,
                tokens,
                common,
                len(prompt_ids),
                req.logprobs,
                include_usage,
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        text, logprobs, finish_reason, completion_tokens = "", [], None, 0
        spec: SpecStats | None = None
        async for out in _until_stop(first, tokens, stream):
            text += stream.push([out.token_id])
            completion_tokens += 1
            if req.logprobs:
                logprobs.append(_logprob_entry(tokenizer, out))
            finish_reason = "stop" if stream.stopped else out.finish_reason
            spec = out.spec or spec
        text += stream.flush()
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": {"content": logprobs} if req.logprobs else None,
            "finish_reason": finish_reason,
        }
        body = {**common, "object": "chat.completion", "choices": [choice]}
        body["usage"] = _usage(len(prompt_ids), completion_tokens)
        if spec is not None:  # per-request speculation, in the shape vLLM reports it
            body["metrics"] = {
                "speculative_decoding": {
                    "num_verify_steps": spec.steps,
                    "num_draft_tokens": spec.draft_tokens,
                    "num_accepted_tokens": spec.accepted_tokens,
                    "mean_acceptance_length": spec.acceptance_length,
                }
            }
        return JSONResponse(body)

    return app


async def _until_stop(
    first: TokenOutput, rest: AsyncIterator[TokenOutput], stream: TextStream
) -> AsyncIterator[TokenOutput]:
    """The request's tokens, ending early (which aborts it) once a stop string matched."""
    yield first
    if first.finish_reason is not None:
        return
    async for out in rest:
        if stream.stopped:
            break
        yield out
    await rest.aclose()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _stream_chunks(
    tokenizer: Tokenizer,
    stream: TextStream,
    first: TokenOutput,
    tokens: AsyncIterator[TokenOutput],
    common: dict[str, Any],
    prompt_tokens: int,
    want_logprobs: bool,
    include_usage: bool,
) -> AsyncIterator[str]:
    def sse(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {**common, "object": "chat.completion.chunk", "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    role_sent, completion_tokens, finish_reason = False, 0, None
    async for out in _until_stop(first, tokens, stream):
        completion_tokens += 1
        text = stream.push([out.token_id])
        finish_reason = "stop" if stream.stopped else out.finish_reason
        if finish_reason is not None:
            text += stream.flush()
        if not text and not want_logprobs and finish_reason is None:
            continue
        delta: dict[str, Any] = {"content": text}
        if not role_sent:
            delta, role_sent = {"role": "assistant", **delta}, True
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        if want_logprobs:
            choice["logprobs"] = {"content": [_logprob_entry(tokenizer, out)]}
        yield sse([choice])
    if include_usage:
        yield sse([], usage=_usage(prompt_tokens, completion_tokens))
    yield "data: [DONE]\n\n"
