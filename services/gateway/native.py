"""SGLang's native API over the services: /generate (SGLang's request and response
shapes, streamed too), /tokenize and /detokenize (the tokenizer service's, nothing kept),
/health_generate (one token through every service) and /flush_cache (each prefill and
decode instance's prefix cache, and the KV store)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from specmesh.services.gateway.cluster import Cluster, Generation, Placement
from specmesh.services.gateway.completions import tokenize_request
from specmesh.services.gateway.errors import APIError, error_body
from specmesh.services.gateway.respond import choice_params, raise_if_failed, respond, sse, start
from specmesh.services.gateway.schema import (
    INT64,
    MAX_CHOICES,
    Body,
    LogitBias,
    Penalty,
    Probability,
    StopString,
    Temperature,
    TokenId,
    TopP,
)
from specmesh.shared.bus import BusError
from specmesh.shared.core.spec_stats import SpecStats
from specmesh.shared.protocol import (
    DETOKENIZE,
    ENCODE,
    CacheFlushed,
    DetokenizeReply,
    DetokenizeRequest,
    EncodeReply,
    EncodeRequest,
    FlushCache,
    ProtocolError,
    RemoteError,
    TextDelta,
    TokenLogprob,
    flush_subject,
)
from specmesh.shared.sampling.params import (
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    Grammar,
    SamplingParams,
)

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's
CALL_TIMEOUT_S = 10.0  # a tokenizer, prefill or decode call that does no generation
HEALTH_TIMEOUT_S = 20.0  # /health_generate: one token through every service
HEALTH_PROMPT = "."


class NativeSamplingParams(BaseModel):
    """SGLang's `sampling_params`. An unknown or unsupported parameter is a 400, never
    silently ignored."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Annotated[int, Field(ge=1, le=INT32_MAX)] = DEFAULT_MAX_NEW_TOKENS
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = -1
    min_p: Probability = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] = 1.0
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    sampling_seed: Annotated[int, INT64] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    min_new_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0
    logit_bias: dict[str, LogitBias] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> NativeSamplingParams:
        if (self.json_schema is not None) + (self.regex is not None) + (self.ebnf is not None) > 1:
            raise ValueError("give at most one of json_schema, regex and ebnf")
        if not all(token.isdigit() for token in self.logit_bias or {}):
            raise ValueError("logit_bias keys are token ids")
        if not (self.skip_special_tokens and self.spaces_between_special_tokens):
            raise ValueError("special tokens are always skipped in the output text")
        if self.no_stop_trim:
            raise ValueError("no_stop_trim is not supported: stop strings are always trimmed")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def engine_params(self, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.sampling_seed,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logprobs=logprobs,
            max_tokens=self.max_new_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_new_tokens,
            logit_bias={int(t): bias for t, bias in (self.logit_bias or {}).items()},
            grammar=self.grammar(),
        )

    def grammar(self) -> Grammar | None:
        if self.json_schema is not None:
            return Grammar("json_schema", self.json_schema)
        if self.regex is not None:
            return Grammar("regex", self.regex)
        return Grammar("ebnf", self.ebnf) if self.ebnf is not None else None


PromptIds = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]


class GenerateRequest(Body):
    """SGLang's /generate body: one prompt or a batch, as text or token ids."""

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = None
    input_ids: PromptIds | Annotated[list[PromptIds], Field(min_length=1)] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] = NativeSamplingParams()
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] = 0
    return_text_in_logprobs: bool = False
    logprob_start_len: Literal[-1] = -1  # prompt logprobs are not served
    model: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        size = len(self.prompts())
        for name in ("sampling_params", "rid"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != size:
                raise ValueError(f"{name} is a list of {len(value)}, for {size} prompts")
        return self

    @property
    def batched(self) -> bool:
        prompt = self.text if self.text is not None else self.input_ids
        return isinstance(prompt, list) and (self.text is not None or isinstance(prompt[0], list))

    def prompts(self) -> list[str] | list[list[int]]:
        if self.text is not None:
            return self.text if isinstance(self.text, list) else [self.text]
        assert self.input_ids is not None
        return self.input_ids if isinstance(self.input_ids[0], list) else [self.input_ids]  # type: ignore[list-item,return-value]

    def params_of(self, index: int) -> NativeSamplingParams:
        params = self.sampling_params
        return params[index] if isinstance(params, list) else params

    def rid_of(self, index: int) -> str | None:
        return self.rid[index] if isinstance(self.rid, list) else self.rid


class SequenceOutput:
    """One sequence's output so far, and its result in SGLang's shape."""

    def __init__(self, rid: str, req: GenerateRequest) -> None:
        self.rid, self.req = rid, req
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.spec: SpecStats | None = None

    def feed(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.output_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        if delta.finish_reason is not None:
            self.finish_reason, self.spec = delta.finish_reason, delta.spec

    def result(self, placement: Placement | None, started: float) -> dict[str, Any]:
        prompt_tokens = len(placement.prompt_ids) if placement else 0
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self._finish_reason(),
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": prompt_tokens - placement.num_computed_tokens if placement else 0,
            "e2e_latency": time.perf_counter() - started,
        }
        if self.spec is not None:
            meta.update(
                spec_verify_ct=self.spec.steps,
                spec_draft_token_num=self.spec.draft_tokens,
                spec_accept_token_num=self.spec.accepted_tokens,
                spec_accept_rate=self.spec.acceptance_rate,
                spec_accept_length=self.spec.acceptance_length,
            )
        if self.req.return_logprob:
            meta["output_token_logprobs"] = [self._triple(e) for e in self.logprobs]
            meta["output_top_logprobs"] = [[self._triple(t) for t in e.top] for e in self.logprobs]
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": meta}

    def _finish_reason(self) -> dict[str, Any] | None:
        if self.finish_reason == "length":
            return {"type": "length", "length": len(self.output_ids)}
        if self.finish_reason is None:
            return None
        return {"type": self.finish_reason}

    def _triple(self, entry: TokenLogprob) -> list[Any]:
        """SGLang's logprob entry: [logprob, token id, text or None]."""
        return [
            entry.logprob,
            entry.token_id,
            entry.text if self.req.return_text_in_logprobs else None,
        ]


def native_routes(cluster: Cluster, model_name: str) -> APIRouter:
    """SGLang's native endpoints over `cluster`."""
    router = APIRouter()

    @router.post("/generate", response_model=None)
    async def generate(req: GenerateRequest, request: Request) -> Response:
        return await _generate(cluster, model_name, req, request)

    @router.post("/tokenize")
    @router.post("/v1/tokenize")
    async def tokenize(req: TokenizeBody) -> dict[str, Any]:
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        encoded = EncodeRequest(texts=texts, add_special_tokens=req.add_special_tokens)
        reply = await _call(cluster, ENCODE, encoded, EncodeReply)
        ids = reply.token_ids if isinstance(req.prompt, list) else reply.token_ids[0]
        counts = [len(i) for i in reply.token_ids]
        count = counts if isinstance(req.prompt, list) else counts[0]
        return {"tokens": ids, "count": count, "max_model_len": cluster.max_model_len()}

    @router.post("/detokenize")
    @router.post("/v1/detokenize")
    async def detokenize(req: DetokenizeBody) -> dict[str, Any]:
        batched = bool(req.tokens) and isinstance(req.tokens[0], list)
        ids = req.tokens if batched else [req.tokens]
        decoded = DetokenizeRequest(token_ids=ids, skip_special_tokens=req.skip_special_tokens)  # type: ignore[arg-type]
        reply = await _call(cluster, DETOKENIZE, decoded, DetokenizeReply)
        return {"text": reply.texts if batched else reply.texts[0]}

    @router.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a token went through tokenizer, prefill and decode; 503 otherwise."""
        probe = GenerateRequest(
            text=HEALTH_PROMPT,
            sampling_params=NativeSamplingParams(max_new_tokens=1, temperature=0),
        )
        try:
            await asyncio.wait_for(_probe(cluster, model_name, probe), HEALTH_TIMEOUT_S)
        except (APIError, TimeoutError) as exc:
            message = exc.message if isinstance(exc, APIError) else "no token in time"
            return JSONResponse(error_body(503, f"unhealthy: {message}"), status_code=503)
        return Response(status_code=200)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        """SGLang's: refused (400) while requests run, here or at any instance."""
        engines = [*cluster.live("prefill"), *cluster.live("decode")]
        if cluster.outputs:
            raise APIError(400, "cannot flush the cache while requests are running")
        replies = await asyncio.gather(
            *(
                _call(cluster, flush_subject(i.heartbeat.instance_id), FlushCache(), CacheFlushed)
                for i in engines
            )
        )
        blocks = sum(r.blocks for r in replies)
        return PlainTextResponse(f"Cache flushed: {blocks} blocks on {len(engines)} instances.\n")

    return router


class TokenizeBody(Body):
    model: str | None = None
    prompt: str | Annotated[list[str], Field(min_length=1)]
    add_special_tokens: bool = True


class DetokenizeBody(Body):
    model: str | None = None
    tokens: list[TokenId] | Annotated[list[list[TokenId]], Field(min_length=1)]
    skip_special_tokens: bool = True


async def _call(cluster: Cluster, subject: str, msg: Any, expect: type[Any]) -> Any:
    """A service's reply, its failures as API errors."""
    try:
        return await cluster.bus.request(subject, msg, expect, CALL_TIMEOUT_S)
    except (RemoteError, ProtocolError) as exc:
        raise APIError(exc.status, str(exc)) from exc
    except BusError as exc:
        raise APIError(503, str(exc)) from exc


async def _start(
    cluster: Cluster, model_name: str, req: GenerateRequest, request_id: str
) -> tuple[Generation, dict[str, SequenceOutput]]:
    """Every choice of every prompt, as sequences; their outputs by sequence id."""
    prompts, outputs = [], {}
    for p, prompt in enumerate(req.prompts()):
        params = req.params_of(p)
        engine = params.engine_params(req.top_logprobs_num if req.return_logprob else None)
        choices = []
        for i in range(params.n):
            rid = f"{request_id}-{p * MAX_CHOICES + i}"
            given = req.rid_of(p)  # the client's name for it, SGLang's meta_info.id
            name = rid if given is None else given if params.n == 1 else f"{given}-{i}"
            outputs[rid] = SequenceOutput(name, req)
            tokenize = tokenize_request(prompt, rid, params.stop_strings())
            choices.append((tokenize, choice_params(engine, i)))
        prompts.append(choices)
    generation = await start(cluster, model_name, "/generate", req.model, request_id, prompts)
    return generation, outputs


async def _probe(cluster: Cluster, model_name: str, req: GenerateRequest) -> None:
    generation, _ = await _start(cluster, model_name, req, f"health-{uuid.uuid4().hex}")
    try:
        async for delta in generation.deltas():
            raise_if_failed(delta.finish_reason, delta.error)
    finally:
        generation.close()


async def _generate(
    cluster: Cluster, model_name: str, req: GenerateRequest, request: Request
) -> Response:
    started, request_id = time.perf_counter(), f"generate-{uuid.uuid4().hex}"
    generation, outputs = await _start(cluster, model_name, req, request_id)

    async def collect() -> dict[str, Any] | list[dict[str, Any]]:
        async for delta in generation.deltas():
            raise_if_failed(delta.finish_reason, delta.error)
            outputs[delta.request_id].feed(delta)
        body = [out.result(generation.placements.get(rid), started) for rid, out in outputs.items()]
        return body[0] if not req.batched and len(body) == 1 else body

    stream = _stream(generation, outputs, started) if req.stream else None
    return await respond(request, generation, stream, collect, request_id)


async def _stream(
    generation: Generation, outputs: dict[str, SequenceOutput], started: float
) -> AsyncIterator[str]:
    """SGLang's stream: per delta, that sequence's whole output so far (`index` tells the
    sequences of a batch apart), then [DONE]."""
    index = {rid: i for i, rid in enumerate(outputs)}
    try:
        async for delta in generation.deltas():
            if delta.finish_reason == "error":
                yield sse(error_body(500, delta.error or "generation failed"))
                break
            out = outputs[delta.request_id]
            out.feed(delta)
            chunk = out.result(generation.placements.get(delta.request_id), started)
            yield sse({**chunk, "index": index[delta.request_id]})
        yield sse("[DONE]")
    finally:
        generation.close()
