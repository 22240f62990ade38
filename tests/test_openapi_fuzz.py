"""schemathesis against the gateway's own OpenAPI schema, on real services: inputs
that fit the schema and inputs that do not. No 5xx, and every error is OpenAI's
error JSON. A tiny random model with SmolLM2's tokenizer keeps generation fast."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from deployment import specmesh_up
from helpers import tiny_llama
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode
from schemathesis.schemas import APIOperation

EXAMPLES_PER_MODE = 20  # per operation, for inputs that fit the schema and that do not


@pytest.fixture(scope="module")
def tiny_deployment(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = Path(tiny_llama(tmp_path_factory.mktemp("tiny"), vocab=49152, seed=3))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, model / name)
    args = ["--speculative-algorithm", "NGRAM", "--tool-call-parser", "hermes"]
    args += ["--reasoning-parser", "qwen3", "--max-model-len", "96"]  # short generations
    with specmesh_up(model, *args) as url:
        yield url


def is_openai_error(body: object) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return (
        isinstance(error, dict)
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
        and isinstance(error.get("param"), str | None)
        and "code" in error
    )


def fuzz(operation: APIOperation, mode: GenerationMode) -> Counter[int]:
    """Hypothesis-driven requests to one operation; the status codes they got."""
    statuses: Counter[int] = Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES_PER_MODE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: schemathesis.Case) -> None:
        response = case.call(timeout=120)
        statuses[response.status_code] += 1
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert is_openai_error(response.json()), (case.body, response.text)

    check()
    return statuses


@pytest.mark.parametrize("mode", list(GenerationMode))
def test_gateway_schema(tiny_deployment: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{tiny_deployment}/openapi.json")
    found = [result.ok() for result in schema.get_all_operations()]
    operations = {f"{op.method.upper()} {op.path}": op for op in found}
    generating = ("POST /v1/chat/completions", "POST /v1/completions")
    assert set(generating) <= set(operations)
    statuses = {
        name: fuzz(operation, mode)
        for name, operation in operations.items()
        # Without a body (GETs, /flush_cache) or with a model id, which may be any string,
        # there is nothing to break
        if mode is GenerationMode.POSITIVE or operation.get_request_payload_content_types()
    }
    print(mode, statuses)
    if mode is GenerationMode.POSITIVE:  # valid requests did generate, not only fail
        assert all(statuses[name][200] for name in generating), statuses
