"""/v1/completions: prompts as tokenizer work, the output as OpenAI text choices."""

from __future__ import annotations

from typing import Any

from services.gateway.schema import CompletionRequest
from shared.protocol import TextDelta, TokenizeRequest


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
        self.spec: dict[str, int] | None = None

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
            logprobs["tokens"].append(entry["token"])
            logprobs["token_logprobs"].append(entry["logprob"])
            top = {alt["token"]: alt["logprob"] for alt in entry["top_logprobs"]}
            logprobs["top_logprobs"].append(top)
            logprobs["text_offset"].append(self.offset)
            self.offset += len(entry["token"])
        return text, logprobs


def merge_logprobs(parts: list[dict[str, list[Any]] | None]) -> dict[str, list[Any]] | None:
    present = [p for p in parts if p is not None]
    if not present:
        return None
    return {key: [v for p in present for v in p[key]] for key in present[0]}
