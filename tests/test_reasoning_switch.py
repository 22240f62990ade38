"""Reasoning on and off per request: chat templates that switch thinking (Qwen3's
enable_thinking, reasoning_effort, Mistral's [THINK] system prompt) rendered by the real
tokenizer, and the gateway starting each request's reasoning parser where its prompt
left off, through `specmesh up`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from deployment import chat, specmesh_up
from specmesh.shared.parsers.reasoning import make_reasoning_parser
from specmesh.shared.tokenizer import Tokenizer

# Like Qwen3's (hybrid) template: thinking off writes an empty section for the model.
QWEN3_TEMPLATE = """
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}
"""
# Like Qwen3's "thinking" models' template: the prompt opens the section; here thinking
# can also be turned off, by enable_thinking or reasoning_effort "none".
QWEN3_THINKING_TEMPLATE = """
{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if (enable_thinking is defined and enable_thinking is false)
    or (reasoning_effort is defined and reasoning_effort == 'none') %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- else %}
{{- '<think>\\n' }}
{%- endif %}
{%- endif %}
"""
# Like Mistral's (Magistral, Medium 3.x): reasoning is asked for in the system prompt.
MISTRAL_TEMPLATE = """
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'system' %}{{- '[SYSTEM_PROMPT]' + message.content + '[/SYSTEM_PROMPT]' }}
{%- elif message.role == 'user' %}{{- '[INST]' + message.content + '[/INST]' }}
{%- else %}{{- message.content + eos_token }}
{%- endif %}
{%- endfor %}
"""
THINK_SYSTEM_PROMPT = "First draft your thinking inside [THINK]...[/THINK], then answer."
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _tokenizer(smollm_dir: Path, tmp_path: Path, template: str) -> Tokenizer:
    path = tmp_path / "template.jinja"
    path.write_text(template)
    return Tokenizer(smollm_dir, path)


@pytest.mark.parametrize(
    ("kwargs", "output", "expected"),
    [
        ({}, "<think>\nplan\n</think>\n\nParis.", ("\nplan\n", "Paris.")),
        ({"enable_thinking": True}, "<think>plan</think>Paris.", ("plan", "Paris.")),
        ({"enable_thinking": False}, "Paris.", (None, "Paris.")),
        # Thinking off: even tags the model writes are the answer's.
        ({"enable_thinking": False}, "<think>x</think>Paris.", (None, "<think>x</think>Paris.")),
    ],
)
def test_qwen3_template(
    smollm_dir: Path, tmp_path: Path, kwargs: dict, output: str, expected: tuple
) -> None:
    prompt = _tokenizer(smollm_dir, tmp_path, QWEN3_TEMPLATE).apply_chat_template(
        QUESTION, **kwargs
    )
    assert make_reasoning_parser("qwen3").parse(output, prompt) == expected


@pytest.mark.parametrize(
    ("kwargs", "output", "expected"),
    [
        ({}, "plan\n</think>\n\nParis.", ("plan\n", "Paris.")),
        (
            {"enable_thinking": False},
            "plan\n</think>\n\nParis.",
            (None, "plan\n</think>\n\nParis."),
        ),
        ({"reasoning_effort": "none"}, "Paris.", (None, "Paris.")),
        ({"reasoning_effort": "high"}, "plan</think>Paris.", ("plan", "Paris.")),
    ],
)
def test_qwen3_thinking_template(
    smollm_dir: Path, tmp_path: Path, kwargs: dict, output: str, expected: tuple
) -> None:
    prompt = _tokenizer(smollm_dir, tmp_path, QWEN3_THINKING_TEMPLATE).apply_chat_template(
        QUESTION, **kwargs
    )
    for name in ("qwen3", "deepseek_r1"):  # the prompt decides, whatever the format's default
        assert make_reasoning_parser(name).parse(output, prompt) == expected


def test_mistral_template_reasoning_by_system_prompt(smollm_dir: Path, tmp_path: Path) -> None:
    tok = _tokenizer(smollm_dir, tmp_path, MISTRAL_TEMPLATE)
    parser = make_reasoning_parser("mistral")
    system = [{"role": "system", "content": THINK_SYSTEM_PROMPT}]
    thinking = tok.apply_chat_template(system + QUESTION)
    assert "[THINK]" in thinking  # the system prompt shows the tags; the prompt ends after it
    assert parser.parse("[THINK]plan[/THINK]Paris.", thinking) == ("plan", "Paris.")
    assert parser.parse("Paris.", tok.apply_chat_template(QUESTION)) == (None, "Paris.")


# --- through the gateway -------------------------------------------------------------

FORCED = "Plan.\n</think>\n\nParis."  # the output every request below is constrained to


@pytest.fixture(scope="module")
def server(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "qwen3_thinking.jinja"
    template.write_text(QWEN3_THINKING_TEMPLATE)
    args = ["--chat-template", str(template), "--reasoning-parser", "qwen3"]
    with specmesh_up(smollm_dir, *args) as url:
        yield url


def _message(url: str, **extra: object) -> dict:
    response = chat(url, QUESTION[0]["content"], regex=re.escape(FORCED), max_tokens=32, **extra)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]


def _streamed(url: str, **extra: object) -> dict:
    body = {"messages": QUESTION, "regex": re.escape(FORCED), "max_tokens": 32, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, **extra}) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines]
    return {
        key: "".join(d.get(key) or "" for d in deltas) or None
        for key in ("reasoning_content", "content")
    }


@pytest.mark.parametrize(
    ("extra", "reasoning", "content"),
    [
        ({}, "Plan.\n", "Paris."),
        ({"chat_template_kwargs": {"enable_thinking": True}}, "Plan.\n", "Paris."),
        ({"chat_template_kwargs": {"enable_thinking": False}}, None, FORCED),
        ({"reasoning_effort": "none"}, None, FORCED),
    ],
)
def test_thinking_switch_per_request(
    server: str, extra: dict, reasoning: str | None, content: str
) -> None:
    message = _message(server, **extra)
    assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    assert _streamed(server, **extra) == {"reasoning_content": reasoning, "content": content}
