"""KV-aware routing against load-only routing on multi-turn chats.

    python benchmarks/bench_routing.py [--model DIR] [--conversations 8] [--turns 4]
        [--max-tokens 64] [--runs 1] [--setups load,kv-aware] [--args "..."]

Each setup is its own `specmesh up` with 2 decode workers and 2 prefill instances
(`--router-policy` set per setup, `--args` added to both). Every conversation opens with
one shared system prompt, then its own question from the held-out chat prompts, then
follow-ups; conversations run concurrently (one thread each, its turns in order, each
turn carrying the whole conversation so far), greedy and streamed. Per setup: prompt
tokens sent, prompt tokens computed (prompt - `cached_tokens` of the usage: by prefill,
or by a decode worker computing a prompt itself), and the median time to first token over
all turns and over the later turns. Outputs must be equal between setups.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import specmesh_up  # noqa: E402
from specmesh.shared.infra import start_nats  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402

CHAT = json.loads((Path(__file__).parent / "prompts" / "chat_heldout.json").read_text())
SYSTEM = (
    "You are a patient assistant for a public library's help desk. Answer in plain English, "
    "in short paragraphs, without lists unless asked. When a question is unclear, say what "
    "you assume. Prefer practical advice a visitor can act on today, mention safety where it "
    "matters, and never invent facts, names or numbers. Keep every answer under one hundred "
    "words unless the visitor asks for more detail."
)
FOLLOW_UPS = ["Tell me more about that.", "Give one example.", "Sum it up in one sentence."]


@dataclass
class Turn:
    prompt_tokens: int
    computed: int
    ttft: float
    text: str


def turn(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> Turn:
    body = {
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, ttft, text, usage = time.perf_counter(), None, "", {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if content := choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += content
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return Turn(usage["prompt_tokens"], usage["prompt_tokens"] - cached, ttft or 0.0, text)


def conversation(url: str, question: str, turns: int, max_tokens: int) -> list[Turn]:
    messages = [{"role": "system", "content": SYSTEM}]
    done = []
    with httpx.Client(timeout=600) as client:
        for i in range(turns):
            messages.append(
                {"role": "user", "content": question if i == 0 else FOLLOW_UPS[(i - 1) % 3]}
            )
            done.append(turn(client, url, messages, max_tokens))
            messages.append({"role": "assistant", "content": done[-1].text})
    return done


def run_setup(
    model: Path, policy: str, extra: list[str], a: argparse.Namespace
) -> list[list[Turn]]:
    args = ["--decoders", "2", "--prefills", "2", "--router-policy", policy, *extra]
    questions = CHAT[: a.conversations]
    with start_nats() as bus, specmesh_up(model, *args, "--nats-url", bus.url) as url:
        conversation(url, "Say hello.", 1, 8)  # warm-up
        with ThreadPoolExecutor(len(questions)) as pool:
            jobs = [pool.submit(conversation, url, q, a.turns, a.max_tokens) for q in questions]
            return [j.result() for j in jobs]


def summary(results: list[list[Turn]]) -> dict[str, float]:
    turns = [t for c in results for t in c]
    later = [t for c in results for t in c[1:]]
    return {
        "prompt": sum(t.prompt_tokens for t in turns),
        "computed": sum(t.computed for t in turns),
        "ttft": statistics.median(t.ttft for t in turns),
        "ttft_later": statistics.median(t.ttft for t in later) if later else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--setups", default="load,kv-aware")
    parser.add_argument("--args", default="", help="more `specmesh up` options for every setup")
    a = parser.parse_args()
    model = Path(a.model) if a.model else fetch_default_model()
    setups = a.setups.split(",")
    print(f"{a.conversations} conversations x {a.turns} turns, {a.max_tokens} tokens, greedy")
    print("| run | setup | prompt tokens | computed | saved | median TTFT | later turns |")
    print("|---|---|---|---|---|---|---|")
    for run in range(1, a.runs + 1):
        texts = {}
        for policy in setups:
            results = run_setup(model, policy, shlex.split(a.args), a)
            texts[policy] = [[t.text for t in c] for c in results]
            s = summary(results)
            saved = 1 - s["computed"] / s["prompt"]
            print(
                f"| {run} | {policy} | {s['prompt']} | {s['computed']} | {saved:.0%} | "
                f"{s['ttft'] * 1000:.0f} ms | {s['ttft_later'] * 1000:.0f} ms |",
                flush=True,
            )
        same = all(texts[p] == texts[setups[0]] for p in setups)
        print(f"run {run}: outputs {'equal' if same else 'DIFFER'} across setups", flush=True)


if __name__ == "__main__":
    main()
