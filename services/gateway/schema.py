"""OpenAI API request bodies: the fields we honour, with their ranges (which also
make the OpenAPI schema). Unknown extra fields are tolerated, as OpenAI does."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from specmesh.shared.multimodal.data_url import IMAGE_PLACEHOLDER
from specmesh.shared.sampling.params import (
    INT32_MAX,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    Grammar,
    SamplingParams,
)

MAX_CHOICES = 64  # n; each choice is a sequence in flight
MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries
# Fields other servers honour that would change the output here if we ignored them: a
# request that sets one gets a 400 rather than an answer that silently differs.
IGNORED_FIELDS = frozenset(
    {
        "use_beam_search",
        "length_penalty",
        "prompt_logprobs",
        "include_stop_str_in_output",
        "truncate_prompt_tokens",
        "typical_p",
        "bad_words",
        "allowed_token_ids",
        "structural_tag",
        "prediction",
        "audio",
        "modalities",
    }
)
INT64 = Field(ge=-(2**63), le=2**63 - 1)

Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
LogitBias = Annotated[float, Field(ge=-100, le=100)]
TokenCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
Temperature = Annotated[float, Field(ge=0, le=2)]
TopP = Annotated[float, Field(gt=0, le=1)]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(Body):
    include_usage: bool = False


class FunctionCall(Body):
    name: str
    arguments: str = "{}"


class ToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool

    @field_validator("content")
    @classmethod
    def _text_and_image_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else []:
            if part.get("type") == "image_url":
                image = part.get("image_url")
                if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                    raise ValueError("an image_url part needs image_url.url")
            elif part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text and image_url content parts are supported")
        return content

    def image_urls(self) -> list[str]:
        content = self.content if isinstance(self.content, list) else []
        return [part["image_url"]["url"] for part in content if part["type"] == "image_url"]

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string, each image as
        the placeholder the tokenizer expands."""
        content = self.content
        if isinstance(content, list):
            content = "".join(
                part["text"] if part["type"] == "text" else IMAGE_PLACEHOLDER for part in content
            )
        return {**self.model_dump(exclude_none=True), "content": content or ""}


class FunctionDefinition(Body):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JSONSchemaFormat(Body):
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        return self

    def grammar(self) -> Grammar | None:
        """What the output must match (None: free text)."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema else None
        if schema is None:
            return Grammar("json_object")
        return Grammar("json_schema", json.dumps(schema))


class GenerationRequest(Body):
    """Fields chat and completions share."""

    model: str | None = None
    max_tokens: TokenCount | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Probability | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: Annotated[int, INT64] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: Annotated[dict[str, LogitBias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT32_MAX)] = 0  # vLLM's: no EOS or stop token before
    response_format: ResponseFormat | None = None
    regex: str | None = None  # SGLang's: the output matches this regex
    ebnf: str | None = None  # SGLang's: the output matches this EBNF (GBNF) grammar
    guided_json: str | dict[str, Any] | None = None  # vLLM's spellings of the same
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1)] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _consistent_fields(self) -> GenerationRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if len(self._grammars()) > 1:
            raise ValueError("give at most one of response_format, regex, ebnf and guided_*")
        ignored = sorted(IGNORED_FIELDS & set(self.model_extra or {}))
        if ignored:
            raise ValueError(f"{', '.join(ignored)}: not supported by this server")
        for token in self.logit_bias or {}:
            if not token.isdigit():
                raise ValueError(f"logit_bias keys are token ids, not {token!r}")
        return self

    def _grammars(self) -> list[Grammar]:
        """Every constraint the request asks for (at most one is allowed)."""
        json_text = self.guided_json
        if isinstance(json_text, dict):
            json_text = json.dumps(json_text)
        choices = self.guided_choice
        given = [
            self.response_format.grammar() if self.response_format else None,
            Grammar("regex", self.regex) if self.regex is not None else None,
            Grammar("ebnf", self.ebnf) if self.ebnf is not None else None,
            Grammar("json_schema", json_text) if json_text is not None else None,
            Grammar("regex", self.guided_regex) if self.guided_regex is not None else None,
            Grammar("regex", "|".join(map(re.escape, choices))) if choices else None,
            Grammar("ebnf", self.guided_grammar) if self.guided_grammar is not None else None,
        ]
        return [g for g in given if g is not None]

    def grammar(self) -> Grammar | None:
        """What the output must match, if anything."""
        return next(iter(self._grammars()), None)

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; unset fields take the OpenAI defaults."""
        defaults = SamplingParams()

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            temperature=pick(self.temperature, defaults.temperature),
            top_p=pick(self.top_p, defaults.top_p),
            top_k=pick(self.top_k, defaults.top_k),
            min_p=pick(self.min_p, defaults.min_p),
            seed=self.seed,
            repetition_penalty=pick(self.repetition_penalty, defaults.repetition_penalty),
            frequency_penalty=pick(self.frequency_penalty, defaults.frequency_penalty),
            presence_penalty=pick(self.presence_penalty, defaults.presence_penalty),
            logprobs=logprobs,
            max_tokens=max_tokens,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            min_tokens=self.min_tokens,
            grammar=self.grammar(),
        )


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: ReasoningEffort | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice):
            names = {tool.function.name for tool in self.tools or []}
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, not in tools")
        return self


PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(GenerationRequest):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | PromptIds
        | Annotated[list[PromptIds], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None  # no beam-style best_of
    suffix: Annotated[str, Field(max_length=0)] | None = None  # no insertion

    @model_validator(mode="after")
    def _no_prompt_logprobs(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported")
        return self

    def prompts(self) -> list[str] | list[list[int]]:
        """Each prompt of the batch."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return prompt  # type: ignore[return-value]
