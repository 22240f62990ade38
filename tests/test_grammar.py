"""What requests do to the logits, on the real SmolLM2: grammars (shared/sampling/grammar.py)
that do not compile are clear errors; masks, draft-tree masks; constrained output that
matches its schema; logit_bias and min_tokens; each the same with NGRAM and EAGLE-3
speculation as without."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema_rs
import pytest
import torch
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.parsers.tools import TOOL_PARSERS, make_tool_parser
from specmesh.shared.sampling.grammar import GrammarCompiler
from specmesh.shared.sampling.params import Grammar, SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.tokenizer import Tokenizer

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 40000000},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no", "maybe"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["answer", "confidence"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "languages": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 12},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                },
                "required": ["name", "languages"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
]
QUESTIONS = ["Tell me about Paris.", "Is the sea salty?"]


@pytest.fixture(scope="module")
def tok(smollm_dir: Path) -> Tokenizer:
    return Tokenizer(smollm_dir)


@pytest.fixture(scope="module")
def compiler(smollm_dir: Path, tok: Tokenizer) -> GrammarCompiler:
    assert tok.eos_token_id is not None
    return GrammarCompiler(smollm_dir / "tokenizer.json", tok.vocab_size, [tok.eos_token_id])


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (Grammar("json_schema", "{not json"), "invalid json_schema grammar"),
        (Grammar("json_schema", '{"type": "flower"}'), "flower"),
        (Grammar("regex", "a(?=b)"), "look-around"),
        (Grammar("ebnf", 'root ::= "a" missing'), "missing"),
        (Grammar("lark", "start: @@@"), "invalid lark grammar"),
    ],
)
def test_bad_grammars_are_clear_errors(
    compiler: GrammarCompiler, grammar: Grammar, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        compiler.compile(grammar)


def test_masks_follow_the_grammar(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    matcher = compiler.matcher(Grammar("regex", "(yes|no)!"))
    allowed = matcher.allowed()
    yes, no, hello = (tok.encode(w)[0] for w in ("yes", "no", "hello"))
    assert allowed[yes] and allowed[no] and not allowed[hello]
    for token in tok.encode("yes!"):
        matcher.accept(token)
    assert matcher.finished or matcher.allowed().sum() == 1  # the end, or only EOS
    with pytest.raises(ValueError, match="grammar"):
        compiler.matcher(Grammar("regex", "[0-9]+")).accept(hello)


def test_masks_after_each_node_of_a_draft_tree(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    matcher = compiler.matcher(Grammar("regex", "(ab|ac)d"))
    a, b, c, d, x = (tok.encode(ch)[0] for ch in "abcdx")
    # root, then a -> b, a -> c, and x (forbidden) with a child
    tree = DraftTree([d, a, b, c, x, a], [-1, 0, 1, 1, 0, 4])
    masks = matcher.masks_after([tree.path_tokens(node)[1:] for node in range(len(tree))])
    assert masks[0][a] and not masks[0][x]  # after the root: only `a` can start
    assert masks[1][b] and masks[1][c] and not masks[1][d]
    assert masks[2][d] and masks[3][d] and not masks[2][b]
    assert masks[5].all()  # below a forbidden draft: never reached
    assert matcher.allowed()[a] and not matcher.allowed()[d]  # the state is unchanged


def test_bitmask_rows_equal_llguidance_byte_masks(
    compiler: GrammarCompiler, tok: Tokenizer
) -> None:
    """The bitmask path (a bit per token, unpacked in torch) against the matcher's own
    byte-per-token mask, after each prefix of a JSON answer."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    matcher = compiler.matcher(Grammar("json_schema", json.dumps(schema)))
    answer = tok.encode('{"n": 42}')
    masks = matcher.masks_after([answer[:k] for k in range(len(answer))])
    for k, token in enumerate(answer):
        bias = matcher.matcher.compute_logit_bias()  # a byte per token: 0 or 200
        expected = torch.frombuffer(bytearray(bias), dtype=torch.uint8) != 0
        assert torch.equal(masks[k], expected[: compiler.vocab_size])
        assert 0 < int(masks[k].sum()) < compiler.vocab_size
        matcher.accept(token)


@pytest.fixture(scope="module")
def engines(smollm_dir: Path) -> dict[str, LLMEngine]:
    cfg = EngineConfig(model=str(smollm_dir), kv_cache_gb=0.1)
    specs = {"none": None, "NGRAM": "NGRAM", "EAGLE3": "EAGLE3"}
    return {
        name: LLMEngine(cfg, SpeculativeConfig(speculative_algorithm=algo) if algo else None)
        for name, algo in specs.items()
    }


@pytest.mark.parametrize("schema", SCHEMAS, ids=["flat", "enum-number", "nested-array"])
def test_json_schema_output_is_valid_and_the_same_with_speculation(
    engines: dict[str, LLMEngine], tok: Tokenizer, schema: dict
) -> None:
    prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    grammar = Grammar("json_schema", json.dumps(schema))
    params = SamplingParams(temperature=0, max_tokens=64, grammar=grammar)
    outputs = {name: engine.generate(prompts, params) for name, engine in engines.items()}
    assert outputs["NGRAM"] == outputs["none"] and outputs["EAGLE3"] == outputs["none"]
    validator = jsonschema_rs.validator_for(schema)
    for ids in outputs["none"]:
        assert validator.is_valid(json.loads(tok.decode(ids)))
    assert engines["EAGLE3"].speculator is not None
    assert engines["EAGLE3"].speculator.stats.steps > 0


def test_seeded_sampling_under_a_grammar_is_the_same_with_speculation(
    engines: dict[str, LLMEngine], tok: Tokenizer
) -> None:
    prompts = [tok.encode_chat([{"role": "user", "content": "Pick a colour."}])]
    grammar = Grammar("regex", "(red|green|blue)( and (red|green|blue))?")
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, grammar=grammar)
    outputs = [engines[name].generate(prompts, params)[0] for name in ("none", "NGRAM")]
    assert outputs[0] == outputs[1]
    text = tok.decode(outputs[0])
    assert text.split(" and ")[0] in ("red", "green", "blue")


def test_a_grammar_that_needs_more_tokens_ends_at_the_length_limit(
    engines: dict[str, LLMEngine], tok: Tokenizer
) -> None:
    engine = engines["none"]
    prompt = tok.encode_chat([{"role": "user", "content": "Count."}])
    params = SamplingParams(temperature=0, max_tokens=5, grammar=Grammar("regex", "[0-9]{40}"))
    engine.add_request("long", prompt, params)
    reasons = []
    while engine.has_work():
        reasons += [o.finish_reason for o in engine.step() if o.finish_reason]
    assert reasons == ["length"]


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _call(name: str, arguments: dict) -> dict:
    return {"function": {"name": name, "arguments": json.dumps(arguments)}}


@pytest.mark.parametrize("parser_name", sorted({p.name for p in TOOL_PARSERS.values()}))
def test_tool_call_grammars_take_exactly_the_allowed_calls(
    compiler: GrammarCompiler, tok: Tokenizer, parser_name: str
) -> None:
    parser = make_tool_parser(parser_name)

    def takes(grammar_args: tuple, calls: list[dict]) -> bool:
        matcher = compiler.matcher(parser.call_grammar([WEATHER, TIME], *grammar_args))
        ids = tok.encode(parser.render_calls(calls))
        taken = matcher.matcher.try_consume_tokens(ids)
        return taken == len(ids) and matcher.matcher.is_accepting()

    paris = _call("get_weather", {"city": "Paris", "days": 2})
    clock = _call("get_time", {})
    assert takes((None, False), [paris]) and takes((None, False), [clock])
    assert takes(("get_weather", False), [paris]) and not takes(("get_time", False), [paris])
    assert takes((None, True), [paris, clock]) and not takes((None, False), [paris, clock])
    assert not takes((None, False), [_call("get_weather", {"town": "Paris"})])
    assert not takes((None, False), [_call("get_weather", {"city": "Paris", "days": "two"})])


def test_logit_bias_and_min_tokens_are_the_same_with_speculation(
    engines: dict[str, LLMEngine], tok: Tokenizer
) -> None:
    prompt = [tok.encode_chat([{"role": "user", "content": "Reply with one word: yes or no?"}])]
    plain = engines["none"].generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    assert len(plain) < 8 and plain[-1] in engines["none"].eos_token_ids  # a short answer
    banned = SamplingParams(temperature=0, max_tokens=6, logit_bias={plain[0]: -100.0})
    forced = SamplingParams(temperature=0, max_tokens=4, logit_bias={tok.encode("!")[0]: 100.0})
    longer = SamplingParams(temperature=0, max_tokens=24, min_tokens=12)
    for name in ("none", "NGRAM"):
        engine = engines[name]
        assert engine.generate(prompt, banned)[0][0] != plain[0]
        assert engine.generate(prompt, forced)[0] == tok.encode("!") * 4
        out = engine.generate(prompt, longer)[0]
        assert len(out) >= 12 and not set(out[:11]) & engine.eos_token_ids
        assert out == engines["none"].generate(prompt, longer)[0]
