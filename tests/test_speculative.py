"""Speculative decoding in the engine: lossless greedy, the oracle draft, exact sampling."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import GREEDY, PROMPTS, tiny_llama, write_eagle_head
from specmesh.shared.config import DEFAULT_MODEL_NAME
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.engine.speculator import StepCosts, best_budget
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.sampling.sampler import draw, position_generator
from specmesh.shared.speculative.accept import accept_sampling
from specmesh.shared.speculative.config import HEADS_DIR, SpeculativeConfig
from specmesh.shared.speculative.factory import drafter_target_features
from specmesh.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def prompt_ids(smollm_dir: Path) -> list[list[int]]:
    tok = Tokenizer(smollm_dir)
    return [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(smollm_dir: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    return [plain.generate([ids], GREEDY)[0] for ids in prompt_ids]


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_llama(tmp_path_factory.mktemp("draft"), vocab=49152, seed=0)


def spec_engine(model: Path | str, **spec: object) -> LLMEngine:
    cfg = SpeculativeConfig(**spec)  # type: ignore[arg-type]
    return LLMEngine(EngineConfig(model=str(model), kv_cache_gb=0.25), cfg)


@pytest.mark.parametrize(
    "spec",
    [
        {"speculative_algorithm": "NGRAM"},
        {"speculative_algorithm": "NGRAM", "speculative_ngram_match_type": "PROB"},
        {"speculative_algorithm": "STANDALONE"},
        {
            "speculative_algorithm": "STANDALONE",
            "speculative_num_steps": 3,
            "speculative_eagle_topk": 2,
            "speculative_num_draft_tokens": 6,
        },
    ],
    ids=["ngram-bfs", "ngram-prob", "standalone-chain", "standalone-tree"],
)
def test_greedy_speculation_is_lossless(
    spec: dict[str, object],
    smollm_dir: Path,
    random_draft: str,
    prompt_ids: list[list[int]],
    reference: list[list[int]],
) -> None:
    if spec["speculative_algorithm"] == "STANDALONE":
        spec = {**spec, "speculative_draft_model_path": random_draft}
    engine = spec_engine(smollm_dir, **spec)
    alone = [engine.generate([ids], GREEDY)[0] for ids in prompt_ids]
    assert alone == reference
    for i in range(0, len(prompt_ids), 8):
        assert engine.generate(prompt_ids[i : i + 8], GREEDY) == reference[i : i + 8]
    stats = engine.speculator.stats
    assert stats.steps > 0 and stats.draft_tokens > 0
    assert engine.block_manager.num_free == engine.kv_cache.num_blocks  # nothing leaked


SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24)


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_seeded_sampling_ignores_speculation(
    algorithm: str, smollm_dir: Path, random_draft: str, prompt_ids: list[list[int]]
) -> None:
    prompts = prompt_ids[:4]
    plain = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    want = [plain.generate([ids], SEEDED)[0] for ids in prompts]
    spec: dict[str, object] = {"speculative_algorithm": algorithm}
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = random_draft
    engine = spec_engine(smollm_dir, **spec)
    # Repeated: NGRAM drafts the second time from what the first time added to its trie.
    for _ in range(2):
        assert [engine.generate([ids], SEEDED)[0] for ids in prompts] == want
    assert engine.generate(prompts, SEEDED) == want
    stats = engine.speculator.stats
    # The random draft is all but always rejected: there every token is a bonus token.
    assert stats.draft_tokens > 0 and (stats.accepted_tokens > 0 or algorithm == "STANDALONE")


def test_target_as_its_own_draft_accepts_everything(
    smollm_dir: Path, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    engine = spec_engine(
        smollm_dir,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm_dir),
        speculative_num_steps=4,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=5,
        speculative_adaptive=False,
    )
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    outputs = [engine.generate([ids], params)[0] for ids in prompt_ids[:3]]
    stats = engine.speculator.stats
    assert stats.accepted_tokens == stats.draft_tokens
    # 1 prefill token, then 8 verification steps of 4 drafts + 1 bonus token each.
    assert stats.steps == 3 * 8 and stats.acceptance_length == 5.0
    # The reference stopped at EOS; ignore_eos only lets the oracle run on past it.
    assert [o[: len(r)] for o, r in zip(outputs, reference, strict=False)] == reference[:3]


def exact_joint(
    model_dir: str | Path, prompt: list[int], steps: int, temperature: float = 1.0, top_k: int = 0
) -> dict[tuple[int, ...], float]:
    """The target's exact probability of every continuation of `steps` tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dist = {(): 1.0}
    for _ in range(steps):
        seqs = list(dist)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(s) for s in seqs])).logits[:, -1]
        logits = logits / temperature
        if top_k:
            logits[logits < logits.topk(top_k).values[:, -1:]] = float("-inf")
        probs = logits.softmax(-1)
        dist = {
            (*s, t): dist[s] * probs[i, t].item()
            for i, s in enumerate(seqs)
            for t in probs[i].nonzero()[:, 0].tolist()
        }
    return dist


def chi_square(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled)."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in probs.items():
        expected = p * n
        if expected >= 5:
            stat += (counts[cell] - expected) ** 2 / expected
            cells += 1
        else:
            pooled_obs += counts[cell]
            pooled_exp += expected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        cells += 1
    return stat, cells - 1


def _accept_without_residual(
    tree: DraftTree, probs: torch.Tensor, seed: int | None, position: int, *_: float
) -> tuple[list[int], list[int]]:
    """A plausible mistake: after rejecting drafts, draw the bonus from the unmodified p."""
    gen = position_generator(seed, position, probs.device)
    children = [i for i in range(1, len(tree)) if tree.parents[i] == 0]
    for child in children:
        if torch.rand((), generator=gen).item() < probs[0, tree.tokens[child]].item():
            return [0, child], [tree.tokens[child], int(probs[child].argmax())]
    return [0], [int(draw(probs[:1], [gen])[0])]


@pytest.mark.parametrize("rule", ["exact", "wrong"])
def test_speculative_sampling_matches_the_target_distribution(
    rule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if rule == "wrong":
        import specmesh.shared.engine.speculator

        monkeypatch.setattr(
            specmesh.shared.engine.speculator, "accept_sampling", _accept_without_residual
        )
    target = tiny_llama(tmp_path / "target", vocab=6, seed=1, hidden=32, layers=2)
    draft = tiny_llama(tmp_path / "draft", vocab=6, seed=2, hidden=32, layers=1)
    prompt, n = [1, 4, 2], 3000
    engine = spec_engine(
        target,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=draft,
        speculative_num_steps=2,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=4,
    )
    params = [SamplingParams(temperature=1.0, max_tokens=3, seed=i) for i in range(n)]
    samples: list[tuple[int, ...]] = []
    for i in range(0, n, 250):
        samples += [tuple(o) for o in engine.generate([prompt] * 250, params[i : i + 250])]
    assert engine.speculator.stats.accepted_tokens > 0  # speculation really happened
    stat, dof = chi_square(Counter(samples), exact_joint(target, prompt, 3), n)
    # 99.9th percentile of chi-square is below dof + 4.5 sqrt(2 dof) for these sizes.
    bound = dof + 4.5 * (2 * dof) ** 0.5
    if rule == "exact":
        assert stat < bound, (stat, dof)
    else:  # the same test catches a rule that does not preserve the distribution
        assert stat > bound, (stat, dof)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "NEXTN", "DFLASH", "STANDALONE"])
def test_sampling_with_a_trained_drafter_keeps_the_distribution(
    algorithm: str, smollm_dir: Path, prompt_ids: list[list[int]]
) -> None:
    """Temperature 0.7 (top-k 4, so the joint of three tokens is enumerable) with the
    drafter that ships for SmolLM2: the draws follow the target's distribution."""
    engine = spec_engine(smollm_dir, speculative_algorithm=algorithm)
    prompt, n = prompt_ids[PROMPTS.index("Count from one to ten in words.")], 750
    params = [SamplingParams(temperature=0.7, top_k=4, max_tokens=3, seed=i) for i in range(n)]
    samples: list[tuple[int, ...]] = []
    for i in range(0, n, 250):
        samples += [tuple(o) for o in engine.generate([prompt] * 250, params[i : i + 250])]
    assert engine.speculator.stats.accepted_tokens > 0  # the head's drafts are taken
    stat, dof = chi_square(Counter(samples), exact_joint(smollm_dir, prompt, 3, 0.7, 4), n)
    assert stat < dof + 4.5 * (2 * dof) ** 0.5, (stat, dof)


def _wrong_accept(tree: DraftTree, probs: torch.Tensor, seed: int) -> list[int]:
    """A plausible mistake: on rejection, draw the bonus from p without removing the draft."""
    gen = position_generator(seed, 0, "cpu")
    children = [i for i in range(1, len(tree)) if tree.parents[i] == 0]
    for child in children:
        if torch.rand((), generator=gen).item() < probs[0, tree.tokens[child]].item():
            return [tree.tokens[child]]
    return [int(draw(probs[:1], [gen])[0])]


def test_acceptance_rule_is_exact_and_a_wrong_rule_is_caught() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25] * 4, [0.25] * 4])
    tree = DraftTree([9, 0, 1], [-1, 0, 0])  # two competing drafts for the first token
    target = {(t,): probs[0, t].item() for t in range(4)}
    accepted: Counter[int | None] = Counter()
    right: Counter[tuple[int, ...]] = Counter()
    for seed in range(8000):
        path, emitted = accept_sampling(tree, probs, seed, 0)
        accepted[path[1] if len(path) > 1 else None] += 1
        right[tuple(emitted[:1])] += 1
    wrong = Counter(tuple(_wrong_accept(tree, probs, seed)) for seed in range(8000))
    ok, dof = chi_square(right, target, 8000)
    bad, _ = chi_square(wrong, target, 8000)
    assert ok < dof + 4.5 * (2 * dof) ** 0.5
    assert bad > 10 * (dof + 4.5 * (2 * dof) ** 0.5)
    # Draft 0 is accepted with p(0) = 0.5, draft 1 with 0.3, i.e. p(1) / (1 - p(0)) after
    # draft 0 is rejected, as in sequential rejection sampling.
    expected = {1: 0.5, 2: 0.3, None: 0.2}
    stat, dof = chi_square(accepted, expected, 8000)
    assert stat < dof + 4.5 * (2 * dof) ** 0.5


def test_sampled_tokens_do_not_depend_on_the_drafts() -> None:
    """Whatever the tree, the token at each position is the one a plain draw with that
    position's generator gives; drafts only decide how many come out of one step."""
    gen = torch.Generator().manual_seed(3)
    vocab, position = 5, 40
    for seed in range(300):
        n = int(torch.randint(1, 8, (), generator=gen))
        parents = [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]
        tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
        probs = torch.rand(n, vocab, generator=gen) ** 3
        path, emitted = accept_sampling(DraftTree(tokens, parents), probs, seed, position)
        assert [tokens[i] for i in path[1:]] == emitted[:-1]
        for depth, node in enumerate(path):
            plain = position_generator(seed, position + depth, "cpu")
            assert emitted[depth] == int(draw(probs[node : node + 1], [plain])[0])


def test_lossy_thresholds_accept_more_and_stay_seeded() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25] * 4])
    tree = DraftTree([9, 1], [-1, 0])

    def accepted(seed: int, single: float, acc: float) -> bool:
        return len(accept_sampling(tree, probs, seed, 7, single, acc)[0]) > 1

    exact = sum(accepted(s, 1.0, 1.0) for s in range(2000))
    assert all(accepted(s, 0.3, 1.0) for s in range(50))  # share 0.3 reaches the threshold
    lossy = [accepted(s, 1.0, 0.5) for s in range(2000)]
    # Accepted when sampled (0.3), or else with probability 0.3 / 0.5: 0.3 + 0.7 * 0.6.
    assert abs(exact / 2000 - 0.3) < 0.05 and abs(sum(lossy) / 2000 - 0.72) < 0.05
    assert lossy == [accepted(s, 1.0, 0.5) for s in range(2000)]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"speculative_algorithm": "MEDUSA"}, "must be one of"),
        ({"speculative_algorithm": "STANDALONE"}, "needs --speculative-draft-model-path"),
        (
            {
                "speculative_algorithm": "STANDALONE",
                "speculative_draft_model_path": "x",
                "speculative_num_steps": 3,
                "speculative_eagle_topk": 1,
                "speculative_num_draft_tokens": 8,
            },
            "num_steps \\+ 1",
        ),
        (
            {"speculative_algorithm": "NGRAM", "speculative_accept_threshold_acc": 0.0},
            "threshold",
        ),
        ({"speculative_algorithm": "NGRAM", "speculative_token_map": "x.json"}, "NGRAM has"),
        ({"speculative_algorithm": "EAGLE3"}, "ships trained heads for SmolLM2"),
    ],
)
def test_invalid_option_combinations_fail_clearly(spec: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        # a model other than the default one: no shipped head to fall back on
        SpeculativeConfig(**spec).resolved("/models/Llama-3.1-8B")  # type: ignore[arg-type]


def test_unset_tree_options_are_chosen_automatically() -> None:
    cfg = SpeculativeConfig("STANDALONE", "draft").resolved()
    assert cfg.speculative_num_draft_tokens == cfg.speculative_num_steps + 1
    assert cfg.speculative_eagle_topk == 1


def test_shipped_drafters_are_the_default_with_their_token_maps() -> None:
    cfg = SpeculativeConfig("MTP").resolved()
    layer = HEADS_DIR / f"{DEFAULT_MODEL_NAME}-NEXTN"
    assert cfg.speculative_algorithm == "NEXTN"
    assert cfg.speculative_draft_model_path == str(layer)
    assert cfg.speculative_token_map == str(layer / "hot_tokens.json")
    mapped = SpeculativeConfig("NEXTN", speculative_token_map="mine.json").resolved()
    assert mapped.speculative_token_map == "mine.json"
    assert SpeculativeConfig("EAGLE3").resolved().speculative_token_map is None  # own vocab
    student = SpeculativeConfig("STANDALONE").resolved()
    draft = HEADS_DIR / f"{DEFAULT_MODEL_NAME}-STANDALONE"
    assert student.speculative_draft_model_path == str(draft)
    assert student.speculative_token_map == str(draft / "hot_tokens.json")


def hot_tokens(tmp_path: Path, answers: list[list[int]]) -> tuple[list[int], Path]:
    """A reduced vocabulary holding the answers' tokens plus the first thousand ids, as a
    token map file."""
    keep = sorted({t for r in answers for t in r} | set(range(1000)))
    token_map = tmp_path / "hot_tokens.json"
    token_map.write_text(json.dumps(keep))
    return keep, token_map


def test_token_map_restricts_drafts_and_stays_lossless(
    smollm_dir: Path, tmp_path: Path, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    from specmesh.shared.speculative.drafter import DraftRequest

    keep, token_map = hot_tokens(tmp_path, reference[:3])
    engine = spec_engine(
        smollm_dir,
        speculative_algorithm="STANDALONE",
        speculative_draft_model_path=str(smollm_dir),
        speculative_token_map=str(token_map),
    )
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids[:3]] == reference[:3]
    assert engine.speculator.stats.accepted_tokens > 0
    drafter = engine.speculator.drafter
    drafter.open("probe", prompt_ids[5])
    tree = drafter.propose([DraftRequest("probe", [], 4)])[0]
    assert len(tree) == 5 and set(tree.tokens[1:]) <= set(keep)


def test_token_map_restricts_an_eagle3_heads_vocabulary(
    smollm_dir: Path, tmp_path: Path, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    keep, token_map = hot_tokens(tmp_path, reference[:3])
    engine = spec_engine(
        smollm_dir, speculative_algorithm="EAGLE3", speculative_token_map=str(token_map)
    )
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids[:3]] == reference[:3]
    assert engine.speculator.stats.accepted_tokens > 0  # the shipped head, restricted
    drafter = engine.speculator.drafter
    assert set(drafter.vocab_ids.tolist()) <= set(keep)
    assert drafter.lm_rows.out_features == len(drafter.vocab_ids) < len(drafter.head.d2t)


def test_an_eagle3_heads_fused_layer_drafts_as_its_torch_layer(
    smollm_dir: Path, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    """The shipped head's layer in the C++ decoder, on every draft step of two requests
    (catching up on a prompt, then on accepted tokens, and trees under their masks): the
    same outputs and logits as the head's torch layer over the same cache."""
    engine = spec_engine(
        smollm_dir,
        speculative_algorithm="EAGLE3",
        speculative_num_steps=3,
        speculative_eagle_topk=3,
        speculative_num_draft_tokens=8,
        speculative_adaptive=False,
    )
    drafter = engine.speculator.drafter
    fused, steps = drafter.fused, []
    assert fused is not None  # this machine builds the CPU kernels

    def both_paths(*step: object) -> tuple[torch.Tensor, torch.Tensor]:
        drafter.fused = None
        torch_out, torch_logits = type(drafter)._forward(drafter, *step)
        drafter.fused = fused
        out, logits = type(drafter)._forward(drafter, *step)
        torch.testing.assert_close(out, torch_out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, torch_logits, rtol=1e-4, atol=1e-4)
        steps.append(len(step[1]))
        return out, logits

    drafter._forward = both_paths
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids[:2]] == reference[:2]
    assert max(steps) > 20 and min(steps) <= 3  # prompts caught up, then trees and catch-ups


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_eagle_heads_load_from_published_layouts_and_are_lossless(
    algorithm: str,
    smollm_dir: Path,
    tmp_path: Path,
    prompt_ids: list[list[int]],
    reference: list[list[int]],
) -> None:
    head = write_eagle_head(tmp_path, eagle3=algorithm == "EAGLE3")
    engine = spec_engine(
        smollm_dir,
        speculative_algorithm=algorithm,
        speculative_draft_model_path=head,
        speculative_num_steps=3,
        speculative_eagle_topk=2,
        speculative_num_draft_tokens=5,
    )
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids] == reference
    # Every decode step drafted (all but a request's last, when max_tokens leaves no room).
    stats = engine.speculator.stats
    decode_steps = sum(len(r) - 1 for r in reference)
    assert decode_steps - len(reference) <= stats.steps <= decode_steps
    for i in range(0, len(prompt_ids), 8):
        assert engine.generate(prompt_ids[i : i + 8], GREEDY) == reference[i : i + 8]
    assert stats.draft_tokens >= stats.steps


def write_mtp_target(path: Path, smollm_dir: Path, seed: int = 0) -> Path:
    """SmolLM2-135M whose checkpoint also carries an MTP layer in DeepSeek-V3's layout
    (`model.layers.{num_hidden_layers}.*`, random weights, with the copies of the embedding
    and LM head DeepSeek stores beside it) and config key num_nextn_predict_layers."""
    from safetensors.torch import save_file

    path.mkdir()
    for f in smollm_dir.iterdir():
        if f.name != "config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((smollm_dir / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    hidden, ffn, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q = config["num_attention_heads"] * (hidden // config["num_attention_heads"])
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    shapes = {
        "eh_proj.weight": (hidden, 2 * hidden),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
    }
    prefix = f"model.layers.{config['num_hidden_layers']}."
    w = {prefix + name: torch.randn(shape) * 0.02 for name, shape in shapes.items()}
    for norm in (
        "enorm",
        "hnorm",
        "input_layernorm",
        "post_attention_layernorm",
        "shared_head.norm",
    ):
        w[f"{prefix}{norm}.weight"] = torch.ones(hidden)
    for shared in ("embed_tokens.weight", "shared_head.head.weight"):
        w[prefix + shared] = torch.zeros(vocab, hidden, dtype=torch.bfloat16)
    save_file(w, str(path / "model-mtp.safetensors"))
    return path


TREE = {"speculative_num_steps": 3, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}


@pytest.mark.parametrize("shape", [{}, TREE], ids=["chain", "tree"])  # {}: NEXTN's default
def test_nextn_drafts_from_the_targets_own_mtp_layer_losslessly(
    shape: dict[str, int],
    smollm_dir: Path,
    tmp_path: Path,
    prompt_ids: list[list[int]],
    reference: list[list[int]],
) -> None:
    """The layer reapplied to its own output drafts a chain, or a tree as EAGLE's heads do
    (SGLang runs NEXTN as EAGLE, any topk)."""
    target = write_mtp_target(tmp_path / "target", smollm_dir)
    # no draft path: the target's own layer
    engine = spec_engine(target, speculative_algorithm="NEXTN", **shape)
    drafter = engine.speculator.drafter
    assert drafter.head.mtp and drafter.target_features == ((29,), True)
    assert [engine.generate([ids], GREEDY)[0] for ids in prompt_ids] == reference
    for i in range(0, len(prompt_ids), 8):
        assert engine.generate(prompt_ids[i : i + 8], GREEDY) == reference[i : i + 8]
    stats = engine.speculator.stats
    assert stats.steps > 0 and stats.draft_tokens >= stats.steps


@pytest.mark.parametrize("algorithm", ["EAGLE3", "DFLASH"])  # NEXTN: EAGLE3's drafter
def test_a_prompt_prefix_from_the_cache_keeps_the_drafts_whole_context(
    algorithm: str, smollm_dir: Path, prompt_ids: list[list[int]]
) -> None:
    """Chat prompts share their system prompt, which the target then serves from its
    prefix cache and computes no features for. The drafter keeps its own K/V of that
    prefix, so a request that starts after it drafts exactly as it would alone (fixed
    draft shapes: adaptive ones follow timings)."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    spec = {"speculative_algorithm": algorithm, "speculative_adaptive": False}
    shared = spec_engine(smollm_dir, **spec)
    shared.generate([prompt_ids[1]], params)
    before = msgspec.structs.replace(shared.speculator.stats)
    reused = shared.block_manager.reused_tokens
    out = shared.generate([prompt_ids[2]], params)
    assert shared.block_manager.reused_tokens > reused  # the target started after a prefix
    alone = spec_engine(smollm_dir, **spec)
    assert out == alone.generate([prompt_ids[2]], params)
    assert shared.speculator.stats.since(before) == alone.speculator.stats


def test_nextn_without_mtp_layers_fails_before_loading(smollm_dir: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"  # another name: no shipped layer to fall back on
    plain.mkdir()
    for f in smollm_dir.iterdir():
        (plain / f.name).symlink_to(f)
    cfg = SpeculativeConfig(speculative_algorithm="NEXTN").resolved(str(plain))
    assert cfg.speculative_draft_model_path == str(plain)
    assert cfg.speculative_num_steps == 3 and cfg.speculative_eagle_topk == 1
    with pytest.raises(ValueError, match="has no MTP layers .*num_nextn_predict_layers"):
        drafter_target_features(cfg, str(plain))
    target = write_mtp_target(tmp_path / "target", smollm_dir)
    (target / "model-mtp.safetensors").unlink()
    cfg = SpeculativeConfig(speculative_algorithm="NEXTN").resolved(str(target))
    with pytest.raises(ValueError, match="lacks the MTP layer's .*model.layers.30.eh_proj"):
        drafter_target_features(cfg, str(target))


def test_draft_budgets_follow_measured_costs_and_acceptance() -> None:
    flat = StepCosts(verify=[1.0] * 9)
    steep = StepCosts(verify=[1.0 + 0.5 * k for k in range(9)])
    assert best_budget(0.9, flat, 8) == 8  # verification is free: draft all allowed
    assert best_budget(0.2, steep, 8) == 1  # costly and rarely accepted: one draft
    assert 1 < best_budget(0.8, steep, 8) < 8
    assert best_budget(0.9, StepCosts(verify=[1.0] * 9, draft=0.5), 8) < 8  # drafting costs


def test_the_verify_cost_curve_is_measured_per_draft_count_and_never_falls(
    tmp_path: Path,
) -> None:
    target = tiny_llama(tmp_path / "target", vocab=64, seed=0)
    engine = spec_engine(target, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    curve = engine.speculator.costs.verify
    assert len(curve) == 6 and curve[0] > 0  # a plain step, then 1..5 drafts
    assert all(a <= b for a, b in zip(curve, curve[1:], strict=False))
