"""Structured outputs: validity, speculation under a grammar, and what a grammar costs.

    python benchmarks/bench_grammar.py [--model DIR] [--max-tokens 96] [--runs 3]
        [--skip-services]

In this process (greedy, the default model): 20 JSON schemas (nested objects, enums,
arrays, bounded numbers) x 3 prompts, constrained, with no speculation, NGRAM and
EAGLE-3: how many outputs parse and match their schema, whether each algorithm's
outputs equal the unspeculated ones, and the acceptance length under the grammar.
Then tokens/s side by side, medians of `--runs`, for a few requests one at a time and
for all at once: the same prompts constrained and free for as many tokens each (the
grammar's cost per token),
and constrained with each algorithm (grammar + speculation vs grammar alone).

Over the services (`specmesh up` with no --tool-call-parser, so the format comes from
the chat template): 20 prompts x {named, required} tool choice x {collected, streamed}
through the official `openai` client: how many return calls that parse, fit their
tool's schema and end with finish_reason "tool_calls"."""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema_rs
import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from deployment import specmesh_up  # noqa: E402
from helpers import WEATHER_PARAMETERS  # noqa: E402
from specmesh.shared.core.spec_stats import SpecStats  # noqa: E402
from specmesh.shared.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from specmesh.shared.model.fetch import fetch_default_model  # noqa: E402
from specmesh.shared.sampling.params import Grammar, SamplingParams  # noqa: E402
from specmesh.shared.speculative.config import SpeculativeConfig  # noqa: E402
from specmesh.shared.tokenizer import Tokenizer  # noqa: E402


def obj(required: bool = True, **properties: dict) -> dict:
    schema = {"type": "object", "properties": properties, "additionalProperties": False}
    return {**schema, "required": list(properties)} if required else schema


STR = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 100000}


def enum(*values: str) -> dict:
    return {"enum": list(values)}


def array(items: dict, most: int = 3) -> dict:
    return {"type": "array", "items": items, "minItems": 1, "maxItems": most}


SCHEMAS = [
    obj(city=STR, population=INT),
    obj(
        answer=enum("yes", "no", "maybe"), confidence={"type": "number", "minimum": 0, "maximum": 1}
    ),
    obj(name=STR, age={"type": "integer", "minimum": 0, "maximum": 120}),
    obj(title=STR, tags=array(STR)),
    obj(person=obj(name=STR, email=STR)),
    obj(sentiment=enum("positive", "negative", "neutral")),
    obj(steps=array(STR, 4)),
    obj(
        product=STR,
        price={"type": "number", "minimum": 0, "maximum": 10000},
        in_stock={"type": "boolean"},
    ),
    obj(color=enum("red", "green", "blue"), hex=STR),
    obj(event=STR, date=STR, attendees=array(STR, 2)),
    obj(address=obj(street=STR, city=STR, zip=STR)),
    obj(scores=array({"type": "integer", "minimum": 0, "maximum": 10}, 4)),
    obj(language=STR, paradigm=enum("functional", "object-oriented", "procedural")),
    obj(
        book=obj(title=STR, author=STR, year={"type": "integer", "minimum": 1000, "maximum": 2030})
    ),
    obj(items=array(obj(name=STR, qty=INT), 2)),
    obj(
        planet=STR,
        moons={"type": "integer", "minimum": 0, "maximum": 200},
        gas_giant={"type": "boolean"},
    ),
    obj(summary=STR, keywords=array(STR, 3)),
    obj(
        weather=obj(
            sky=enum("sunny", "cloudy", "rainy"),
            celsius={"type": "integer", "minimum": -50, "maximum": 60},
        )
    ),
    obj(recipe=STR, minutes=INT, vegetarian={"type": "boolean"}),
    obj(level=enum("low", "medium", "high"), reasons=array(STR, 2)),
]
PROMPTS = [
    "Answer as JSON: tell me about Paris.",
    "Reply in JSON about your favourite book.",
    "Give a JSON record for a sunny day in Madrid.",
]
TOOL_PROMPTS = [
    "Weather in Lima?",
    "Is it cold in Oslo?",
    "Should I take an umbrella in London?",
    "How hot is Cairo today?",
    "Forecast for Tokyo, please.",
    "What's it like in Sydney?",
    "Is it snowing in Montreal?",
    "Weather for Cape Town.",
    "Do I need sunscreen in Rome?",
    "How windy is Chicago?",
    "Temperature in Reykjavik?",
    "Is it humid in Singapore?",
    "Weather in Nairobi in fahrenheit.",
    "Tell me the weather in Berlin.",
    "What should I wear in Paris today?",
    "Rain in Seattle?",
    "Weather report for Mumbai.",
    "Is Dubai hot right now?",
    "Current conditions in Buenos Aires?",
    "Weather in Lisbon.",
]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": obj(city=STR)}},
]
ALGORITHMS = {"none": None, "NGRAM": "NGRAM", "EAGLE3": "EAGLE3"}
ONE_AT_A_TIME = 6  # requests timed one at a time (where speculation pays on CPU)


def generate(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], batch: int
) -> tuple[list[list[int]], float]:
    """Outputs and tokens/s, `batch` requests at a time."""
    outputs = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        outputs += engine.generate(prompts[i : i + batch], params[i : i + batch])
    return outputs, sum(map(len, outputs)) / (time.perf_counter() - start)


def fresh_engines(model: Path) -> dict[str, LLMEngine]:
    cfg = EngineConfig(model=str(model), kv_cache_gb=0.5)
    return {
        name: LLMEngine(cfg, SpeculativeConfig(speculative_algorithm=a) if a else None)
        for name, a in ALGORITHMS.items()
    }


def in_process(model: Path, max_tokens: int, runs: int) -> None:
    tok = Tokenizer(model)
    cases = [(s, p) for s in SCHEMAS for p in PROMPTS]
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for _, p in cases]
    grammars = [Grammar("json_schema", json.dumps(s)) for s, _ in cases]
    constrained = [
        SamplingParams(temperature=0, max_tokens=max_tokens, grammar=g) for g in grammars
    ]
    batches = {1: ONE_AT_A_TIME, len(cases): len(cases)}  # batch size: requests timed
    rates: dict[tuple[str, int], list[float]] = {}
    for run in range(runs):
        engines = fresh_engines(model)  # no n-gram trie remembers an earlier run
        for engine in engines.values():  # grammars compile once per schema, not timed
            for ids, params in zip(prompts, constrained, strict=True):
                engine.check_request(ids, params)
        for batch, n in batches.items():
            outputs: dict[str, list[list[int]]] = {}
            for name, engine in engines.items():
                before = _spec_totals(engine)
                outputs[name], rate = generate(engine, prompts[:n], constrained[:n], batch)
                rates.setdefault((f"{name} + grammar", batch), []).append(rate)
                if run == 0 and batch > 1:
                    _report(name, engine, before, cases, outputs, tok)
            # The same number of tokens per request, free: the difference is the grammar's.
            free = [
                SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True)
                for ids in outputs["none"]
            ]
            _, rate = generate(engines["none"], prompts[:n], free, batch)
            rates.setdefault(("none, free", batch), []).append(rate)
        line = "  ".join(f"{k} b={b} {v[-1]:.1f}" for (k, b), v in rates.items())
        print(f"run {run + 1}: {line}", flush=True)
    print(
        f"\ntok/s, greedy, median of {runs} runs: {ONE_AT_A_TIME} requests one at a time "
        f"(b=1), all {len(cases)} at once (b={len(cases)})"
    )
    names = dict.fromkeys(name for name, _ in rates)
    print(f"{'':<20}" + "".join(f"{'b=' + str(b):>10}" for b in batches))
    for name in names:
        medians = (statistics.median(rates[(name, b)]) for b in batches)
        print(f"{name:<20}" + "".join(f"{m:>10.1f}" for m in medians))
    for b in batches:
        cost = 1e3 / statistics.median(rates[("none + grammar", b)])
        cost -= 1e3 / statistics.median(rates[("none, free", b)])
        line = f"b={b}: grammar cost per token {cost:+.2f} ms"
        for name in ("NGRAM", "EAGLE3"):
            pairs = zip(rates[(f"{name} + grammar", b)], rates[("none + grammar", b)], strict=True)
            ratio = statistics.median(s / g for s, g in pairs)
            line += f"; {name} + grammar / grammar alone {ratio:.2f}x"
        print(line)


def _report(
    name: str,
    engine: LLMEngine,
    before: SpecStats,
    cases: list[tuple[dict, str]],
    outputs: dict[str, list[list[int]]],
    tok: Tokenizer,
) -> None:
    """Validity, identity with the unspeculated outputs, and acceptance under the grammar."""
    texts = [tok.decode(ids) for ids in outputs[name]]
    valid = sum(_valid(schema, text) for (schema, _), text in zip(cases, texts, strict=True))
    same = sum(a == b for a, b in zip(outputs[name], outputs["none"], strict=True))
    line = f"{name:>6}: {valid}/{len(cases)} valid, {same}/{len(cases)} as unspeculated"
    if engine.speculator is not None:
        line += f", acceptance length {engine.speculator.stats.since(before).acceptance_length:.2f}"
    print(line, flush=True)


def _spec_totals(engine: LLMEngine) -> SpecStats:
    """A copy of the engine's speculation totals so far."""
    totals = engine.speculator.stats if engine.speculator else SpecStats()
    return copy.copy(totals)


def _valid(schema: dict, text: str) -> bool:
    try:
        return jsonschema_rs.validator_for(schema).is_valid(json.loads(text))
    except ValueError:
        return False


def tool_calls(model: Path) -> None:
    with specmesh_up(model) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice_name, choice in (("named", named), ("required", "required")):
            for stream in (False, True):
                good = sum(_good_call(client, p, choice, stream) for p in TOOL_PROMPTS)
                how = "streamed" if stream else "collected"
                print(
                    f"tool_choice {choice_name}, {how}: {good}/{len(TOOL_PROMPTS)} good calls",
                    flush=True,
                )


def _good_call(client: openai.OpenAI, prompt: str, choice: object, stream: bool) -> bool:
    args = {"model": "", "messages": [{"role": "user", "content": prompt}], "tools": TOOLS}
    args |= {"tool_choice": choice, "temperature": 0, "max_tokens": 160}  # room for 2 calls
    if stream:
        chunks = [c for c in client.chat.completions.create(**args, stream=True) if c.choices]
        calls = [
            (d.function.name, d.function.arguments)
            for c in chunks
            for d in c.choices[0].delta.tool_calls or []
        ]
        finish = chunks[-1].choices[0].finish_reason
    else:
        out = client.chat.completions.create(**args).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in out.message.tool_calls or []]
        finish = out.finish_reason
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    return (
        finish == "tool_calls"
        and bool(calls)
        and all(name in schemas and _valid(schemas[name], arguments) for name, arguments in calls)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-services", action="store_true")
    args = parser.parse_args()
    model = Path(args.model) if args.model else fetch_default_model()
    in_process(model, args.max_tokens, args.runs)
    if not args.skip_services:
        tool_calls(model)


if __name__ == "__main__":
    main()
