"""specmesh train-draft: a tiny head learns, loads, drafts losslessly; bad input fails early."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import patch

import pytest
import torch
from safetensors.torch import load_file, save_file
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.loader import load_model
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import HEADS_DIR, SpeculativeConfig
from specmesh.shared.speculative.eagle import (
    EagleHead,
    HeadSpec,
    load_head,
    read_head_spec,
    save_head,
)
from specmesh.shared.tokenizer import Tokenizer
from specmesh.shared.training.data import CaptureReader, find_captures, read_samples, self_distill
from specmesh.shared.training.eagle_trainer import (
    Acceptance,
    Roots,
    StepResult,
    collate,
    reached,
    unrolled_loss,
)
from specmesh.shared.training.features import TargetViews, capture_layers, extract, from_capture
from specmesh.shared.training.prompts import TOPICS, training_prompts
from specmesh.shared.training.train_draft import (
    Corpus,
    TrainDraftConfig,
    answers_file,
    capture_answers,
    feature_layers,
    gather_samples,
    split_heldout,
    train_draft,
    with_draft_vocab,
)

HELDOUT = Path(__file__).parents[1] / "benchmarks" / "prompts" / "chat_heldout.json"


def tiny_target(path: Path, smollm_dir: Path) -> Path:
    """An 8-layer random Llama with SmolLM2's tokenizer and chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / name, path / name)
    return path


def tiny_config(target: Path, out: Path) -> TrainDraftConfig:
    """A minute's training: every position unrolled as a root (the model is tiny)."""
    return TrainDraftConfig(
        target=str(target),
        out=str(out),
        num_prompts=96,
        max_new_tokens=24,
        draft_vocab_size=1024,
        ttt_steps=3,
        epochs=6,
        lr=3e-3,
        batch_tokens=1024,
        root_fraction=1.0,
        heldout=0.15,
        eval_every=1000,
        seed=1,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, smollm_dir: Path) -> Path:
    return tiny_target(tmp_path_factory.mktemp("target") / "target", smollm_dir)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny: Path) -> tuple[Path, Path]:
    return tiny, train_draft(tiny_config(tiny, tmp_path_factory.mktemp("train") / "out"))


def test_sampled_answers_are_seeded_and_labelled_by_the_targets_argmax(
    tiny: Path, tmp_path: Path
) -> None:
    tok = Tokenizer(tiny)
    prompts = ["Tell me about owls.", "What is a prime number?", "Name three rivers."]
    runs = []
    for name in ("a", "b"):  # a fresh engine each: self_distill needs an empty prefix cache
        engine = LLMEngine(EngineConfig(model=str(tiny), kv_cache_gb=0.05))
        target = engine.model
        layers = capture_layers((1, 3), False, target.config.num_layers)
        self_distill(engine, tok, prompts, tmp_path / f"{name}.jsonl", 12, layers, 1.0, seed=3)
        runs.append(read_samples(tmp_path / f"{name}.jsonl"))
    assert [s.ids for s in runs[0]] == [s.ids for s in runs[1]]  # seeded
    captures = find_captures(tmp_path / "a.jsonl", layers, len(prompts))
    teacher = extract(target, runs[0], (1, 3), False)
    sampled_off_argmax = False
    for sample, capture, view in zip(runs[0], captures, teacher, strict=True):
        got = from_capture(target, CaptureReader()(capture), False, argmax=None)
        start, end = sample.spans[0]
        assert torch.equal(got.argmax[start - 1 : end - 1], view.argmax[start - 1 : end - 1])
        sampled_off_argmax |= sample.ids[start:end] != view.argmax[start - 1 : end - 1].tolist()
    assert sampled_off_argmax  # at temperature 1 the random target strays from its argmax


def test_a_tiny_head_learns_and_drafts_losslessly(trained: tuple[Path, Path]) -> None:
    target, head = trained
    report = json.loads((head / "training.json").read_text())
    first, last = report["history"][0], report["history"][-1]
    assert last["heldout_acceptance"] > first["heldout_acceptance"] + 0.2, report["history"]
    spec = read_head_spec(head, "EAGLE3", ModelConfig.from_file(target / "config.json"))
    assert spec.draft_vocab == 1024 and spec.target_features == ((1, 3, 4), False)
    assert_drafts_losslessly(target, "EAGLE3", head)


def assert_drafts_losslessly(target: Path, algorithm: str, drafter: Path) -> None:
    """Greedy output with `drafter` equals the target's own, and some drafts are accepted."""
    tok = Tokenizer(target)
    prompts = [
        tok.encode_chat([{"role": "user", "content": p}])
        for p in ["Tell me about owls.", "What is a prime number?", "Name three rivers."]
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    plain = LLMEngine(EngineConfig(model=str(target), kv_cache_gb=0.05)).generate(prompts, greedy)
    spec_cfg = SpeculativeConfig(
        speculative_algorithm=algorithm, speculative_draft_model_path=str(drafter)
    )
    engine = LLMEngine(EngineConfig(model=str(target), kv_cache_gb=0.05), spec_cfg)
    assert engine.generate(prompts, greedy) == plain
    assert engine.speculator.stats.accepted_tokens > 0


def test_a_tiny_mtp_layer_learns_and_is_saved_in_deepseeks_layout(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, eagle3_head = trained
    cfg = dataclasses.replace(tiny_config(target, tmp_path / "out"), algorithm="NEXTN")
    shutil.copytree(eagle3_head.parent / "data", tmp_path / "out" / "data")  # same answers
    layer = train_draft(cfg)
    history = json.loads((layer / "training.json").read_text())["history"]
    assert history[-1]["heldout_acceptance"] > history[0]["heldout_acceptance"] + 0.2, history
    names = set(load_file(layer / "model.safetensors"))
    assert {
        "model.layers.8.eh_proj.weight",
        "model.layers.8.enorm.weight",
        "model.layers.8.hnorm.weight",
        "model.layers.8.shared_head.norm.weight",
        "model.layers.8.self_attn.q_proj.weight",
    } <= names
    config = json.loads((layer / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 8
    hot = json.loads((layer / "hot_tokens.json").read_text())  # the token map beside it
    assert len(hot) == 1024 and hot == sorted(set(hot))
    assert_drafts_losslessly(target, "MTP", layer)
    assert_training_continues(cfg, layer, history, tmp_path)


def test_a_tiny_dflash_draft_learns_and_is_saved_in_z_labs_layout(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, eagle3_head = trained
    cfg = dataclasses.replace(
        tiny_config(target, tmp_path / "out"), algorithm="DFLASH", block_size=4, draft_layers=2
    )
    shutil.copytree(eagle3_head.parent / "data", tmp_path / "out" / "data")  # same answers
    draft = train_draft(cfg)
    history = json.loads((draft / "training.json").read_text())["history"]
    assert history[-1]["heldout_acceptance"] > history[0]["heldout_acceptance"] + 0.2, history
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    # z-lab's default layers for 2 draft layers of an 8-layer target; the mask is EOS, as
    # SmolLM2's tokenizer leaves no embedding row free
    assert config["dflash_config"] == {"mask_token_id": 2, "target_layer_ids": [1, 5]}
    names = set(load_file(draft / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's
    assert_drafts_losslessly(target, "DFLASH", draft)
    assert_training_continues(cfg, draft, history, tmp_path, on_policy_epochs=0.5)


def test_a_tiny_standalone_draft_learns_and_is_saved_as_a_llama(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, eagle3_head = trained
    cfg = dataclasses.replace(
        tiny_config(target, tmp_path / "out"),
        algorithm="STANDALONE",
        draft_layers=4,
        lr=1e-2,
    )
    shutil.copytree(eagle3_head.parent / "data", tmp_path / "out" / "data")  # same answers
    draft = train_draft(cfg)
    history = json.loads((draft / "training.json").read_text())["history"]
    assert history[-1]["heldout_acceptance"] > history[0]["heldout_acceptance"] + 0.2, history
    config = json.loads((draft / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 4)
    assert config["tie_word_embeddings"] and config["vocab_size"] == 49152
    assert "model.embed_tokens.weight" in load_file(draft / "model.safetensors")
    assert_drafts_losslessly(target, "STANDALONE", draft)
    assert_training_continues(cfg, draft, history, tmp_path)


def assert_training_continues(
    cfg: TrainDraftConfig,
    drafter: Path,
    history: list[dict],
    tmp_path: Path,
    **changes: object,
) -> None:
    """A run from `drafter` (--init) on the same data starts where the one that made it
    ended (up to the bf16 it was saved in), and keeps its token map."""
    out = tmp_path / "more"
    shutil.copytree(Path(cfg.out) / "data", out / "data")
    more = dataclasses.replace(cfg, out=str(out), init=str(drafter), epochs=0.2, **changes)
    again = json.loads((train_draft(more) / "training.json").read_text())
    start = again["history"][0]["heldout_acceptance"]
    assert start == pytest.approx(history[-1]["heldout_acceptance"], abs=0.05), (history, again)
    on_policy = again["total_steps"] > again["on_policy_from_step"]
    assert (
        on_policy == bool(changes.get("on_policy_epochs"))
        and again["steps"] == again["total_steps"]
    )
    assert (out / "head" / "hot_tokens.json").read_text() == (
        drafter / "hot_tokens.json"
    ).read_text()


def test_the_training_run_resumes_from_its_state(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target, head = trained
    out = head.parent
    cfg = tiny_config(target, out)
    before = (head / "model.safetensors").read_bytes()
    train_draft(cfg)  # finished state: nothing left to train, the same head again
    assert (head / "model.safetensors").read_bytes() == before
    with pytest.raises(ValueError, match="other options"):
        train_draft(TrainDraftConfig(**{**cfg.__dict__, "lr": 1e-3}))


def corpus_views(cfg: TrainDraftConfig, count: int) -> tuple[LlamaForCausalLM, Corpus, TargetViews]:
    """The target, the samples of `cfg`'s run and their views, as train_draft makes them."""
    target = load_model(cfg.target, torch.device("cpu"), torch.float32)
    num_layers = target.config.num_layers
    layers, normed = feature_layers(cfg, num_layers)
    capture = capture_layers(layers, normed, num_layers)
    corpus = gather_samples(cfg, Tokenizer(cfg.target), capture, count)
    views = TargetViews(target, corpus.samples, corpus.captures, corpus.greedy, layers, normed)
    return target, corpus, views


def test_views_read_per_batch_equal_views_loaded_up_front(trained: tuple[Path, Path]) -> None:
    target_dir, head = trained
    target, corpus, views = corpus_views(tiny_config(target_dir, head.parent), 96)
    views.read = CaptureReader(budget=0)  # every file is closed again after a read
    chunks: dict[Path, list[torch.Tensor]] = {}
    for i, (sample, capture) in enumerate(zip(corpus.samples, corpus.captures, strict=True)):
        if capture.path not in chunks:  # the eager path: a whole chunk file in memory
            chunks[capture.path] = torch.load(capture.path, weights_only=True)["features"]
        greedy = torch.tensor([*sample.ids[1:], 0])
        eager = from_capture(target, chunks[capture.path][capture.index], False, greedy)
        lazy = views[i]
        assert torch.equal(lazy.features, eager.features) and torch.equal(lazy.final, eager.final)
        assert torch.equal(lazy.argmax, eager.argmax)
        assert len(views.read.files) == 1
    assert len(corpus.samples) == 96 and len(chunks) == 1


def test_the_targets_choices_are_kept_for_the_next_run_on_the_same_samples(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target_dir, head = trained
    cfg = tiny_config(target_dir, head.parent)
    target, corpus, views = corpus_views(cfg, 96)
    layers = feature_layers(cfg, target.config.num_layers)
    kept = tmp_path / "choices.pt"

    def views_of(n: int) -> TargetViews:
        columns = (corpus.samples, corpus.captures, corpus.greedy)
        return TargetViews(target, *(c[:n] for c in columns), *layers, kept)

    first = views_of(96)
    assert kept.is_file() and all(map(torch.equal, first.argmax, views.argmax))
    with patch.object(TargetViews, "_choices", side_effect=AssertionError("computed again")):
        again = views_of(96)  # read back: nothing is computed
        with pytest.raises(AssertionError, match="computed again"):
            views_of(95)  # other samples: the kept choices are not theirs
    assert all(map(torch.equal, again.argmax, views.argmax))


def test_answers_kept_without_their_layers_get_them_by_teacher_forcing(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    """An older run's answers (no chunk files of target layers) get them once, in the chunk
    files generation writes, with the values generation would have kept."""
    target_dir, head = trained
    out = tmp_path / "out"
    shutil.copytree(head.parent / "data", out / "data")
    cfg = tiny_config(target_dir, out)
    work, layers = answers_file(out, 0), capture_layers(*feature_layers(cfg, 8), 8)
    read = CaptureReader()
    generated = [read(c).clone() for c in find_captures(work, layers, 96)]
    read.files.clear()
    for path in (out / "data").glob("*.features.*.pt"):
        path.unlink()
    assert find_captures(work, layers, 96) == [None] * 96
    capture_answers(cfg, target_dir, layers, 96)
    captures = find_captures(work, layers, 96)
    for rows, capture in zip(generated, captures, strict=True):
        # generation never forwards an answer's last token: its row stays zero
        torch.testing.assert_close(read(capture)[:-1], rows[:-1], rtol=0.02, atol=0.02)


def test_a_reselected_vocabulary_keeps_the_rows_of_ids_the_head_had(
    trained: tuple[Path, Path],
) -> None:
    """Ids the head had keep their rows; a new id's row starts nearer the row training
    would have given it than the target's own row is (ids dropped, then chosen again)."""
    target_dir, head_dir = trained
    target = load_model(target_dir, torch.device("cpu"), torch.float32)
    head, _, _ = load_head(head_dir, "EAGLE3", target)
    ids, rows = head.draft_ids.clone(), head.lm_head.weight.detach().clone()
    unused = sorted(set(range(target.config.vocab_size)) - set(ids.tolist()))
    fewer = torch.tensor(sorted(ids[::2].tolist() + unused[:300]))
    head = with_draft_vocab(head, fewer, target)
    assert torch.equal(head.draft_ids, fewer)
    kept = torch.isin(fewer, ids)
    assert torch.equal(head.lm_head.weight[kept], rows[::2])
    head = with_draft_vocab(head, ids, target)  # the dropped half comes back, as new ids
    assert torch.equal(head.draft_ids, ids) and torch.equal(head.lm_head.weight[::2], rows[::2])
    again, trained_rows = head.lm_head.weight[1::2], rows[1::2]
    targets = target.lm_head.weight[ids[1::2]]
    assert (again - trained_rows).norm() < 0.8 * (targets - trained_rows).norm()


def test_greedy_and_sampled_answers_train_one_drafter(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target_dir, head = trained
    out = tmp_path / "out"
    shutil.copytree(head.parent / "data", out / "data")  # the greedy answers
    cfg = dataclasses.replace(
        tiny_config(target_dir, out), num_prompts=12, temperatures="0,1", epochs=1
    )
    report = json.loads((train_draft(cfg) / "training.json").read_text())
    assert report["samples"] == 24
    assert len(read_samples(out / "data" / "self_distill-t1.jsonl")) == 12
    target, corpus, views = corpus_views(cfg, 12)
    assert corpus.greedy == [True] * 12 + [False] * 12 and corpus.prompts == [*range(12)] * 2
    # Sampled answers' labels are the target's choices, from the logits, not their tokens
    # (up to near-ties that float rounding decides).
    sampled = corpus.samples[12:]
    teacher = extract(target, sampled, (1, 3, 4), False)
    labels, tokens, choices = [], [], []
    for sample, chosen, view in zip(sampled, views.argmax[12:], teacher, strict=True):
        start, end = sample.spans[0]
        labels.append(chosen[start - 1 : end - 1])
        tokens.append(torch.tensor(sample.ids[start:end]))
        choices.append(view.argmax[start - 1 : end - 1])
    choice = torch.cat(choices)
    assert (torch.cat(labels) != choice).float().mean() < 0.02
    assert (torch.cat(tokens) != choice).float().mean() > 0.2


def test_the_heldout_split_keeps_the_answers_to_a_prompt_together() -> None:
    prompts = [*range(40)] * 2  # two answers to each of 40 prompts
    held, train = split_heldout(prompts, 0.25, seed=0)
    assert sorted(held + train) == list(range(80)) and len(held) == 20
    assert not {prompts[i] for i in held} & {prompts[i] for i in train}


def test_training_continues_from_a_head_and_then_on_policy(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    target_dir, head = trained
    first = json.loads((head / "training.json").read_text())["history"]
    # The head with one draft id swapped for one the data never gives it: a vocabulary that
    # recomputing from the same data would not give back.
    init = tmp_path / "init"
    shutil.copytree(head, init)
    tensors = load_file(init / "model.safetensors")
    ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
    ids[-1] += 1
    tensors["d2t"] = ids - torch.arange(len(ids))
    tensors["t2d"] = torch.zeros_like(tensors["t2d"]).index_fill_(0, ids, True)
    save_file(tensors, init / "model.safetensors")
    out = tmp_path / "out"
    shutil.copytree(head.parent / "data", out / "data")
    cfg = dataclasses.replace(
        tiny_config(target_dir, out), init=str(init), epochs=0.5, on_policy_epochs=1
    )
    report = json.loads((train_draft(cfg) / "training.json").read_text())
    history = report["history"]
    # it starts where the head was (up to the swapped id), far above a fresh head
    start = history[0]["heldout_acceptance"]
    assert start == pytest.approx(first[-1]["heldout_acceptance"], abs=0.05), (first, history)
    assert start > first[0]["heldout_acceptance"] + 0.2
    assert history[-1]["heldout_acceptance"] > start - 0.05, history
    trained_tensors = load_file(out / "head" / "model.safetensors")
    assert torch.equal(trained_tensors["d2t"], tensors["d2t"])
    assert not torch.equal(trained_tensors["fc.weight"], tensors["fc.weight"])
    assert 0 < report["on_policy_from_step"] < report["steps"] == report["total_steps"]


def test_on_policy_roots_prefer_short_chains_and_steps_count_where_chains_reach(
    trained: tuple[Path, Path],
) -> None:
    valid = torch.ones(1, 100, dtype=torch.bool)
    preference = torch.ones(1, 100)
    preference[0, :10] = 100.0  # chains that break at once
    preferred = Roots(0.1, torch.Generator().manual_seed(0), preference).pick(valid)
    uniform = Roots(0.1, torch.Generator().manual_seed(0)).pick(valid)
    assert (preferred < 10).sum() >= 7 and (uniform < 10).sum() <= 3
    correct = torch.tensor([[True, False, True], [True, True, False], [False, True, True]])
    assert reached(correct).tolist() == [
        [True, True, False],
        [True, True, True],
        [True, False, False],
    ]
    # On-policy, a step's loss is counted only where the head's chain reached it.
    target_dir, head_dir = trained
    target, corpus, views = corpus_views(tiny_config(target_dir, head_dir.parent), 96)
    head, _, _ = load_head(head_dir, "EAGLE3", target)
    draft_ids = head.d2t + torch.arange(len(head.d2t))
    batch = collate(corpus.samples, views, list(range(8)), torch.device("cpu"))
    ones = torch.ones(8, batch.ids.shape[1] - 1)
    losses = {}
    for steps in (1, 3):
        for on_policy in (False, True):
            roots = Roots(preference=ones if on_policy else None)
            r = unrolled_loss(head, target, batch, steps, draft_ids, roots)
            losses[steps, on_policy] = r.loss.item()
    assert losses[1, True] == pytest.approx(losses[1, False])
    assert losses[3, True] < losses[3, False] - 1e-3, losses


@pytest.mark.unit
def test_a_judging_pass_unrolls_every_valid_entry_and_puts_chains_back_in_place() -> None:
    """`Roots()` picks each sample's valid entries (padded to the batch's most), and
    `per_entry` returns their chains at their entries, as `Acceptance` reads them."""
    valid = torch.tensor([[False, True, True, False, True], [False, False, True, False, False]])
    roots = Roots().pick(valid)  # [2, 3]
    assert roots.shape == (2, 3) and valid.gather(1, roots).sum(dim=1).tolist() == [3, 1]
    chains = (roots * 10).flatten()[:, None] + torch.arange(2)  # distinct per root: [6, 2]
    result = StepResult(torch.zeros(()), chains, valid.gather(1, roots).flatten(), roots, 5)
    correct, at_entries = result.per_entry()
    assert at_entries.view(2, 5).equal(valid)
    assert correct.view(2, 5, 2)[valid].tolist() == [[10, 11], [20, 21], [40, 41], [20, 21]]


def test_heldout_acceptance_walks_a_sample_as_serving_does() -> None:
    """The prefill makes an answer's first token; then each chain of c correct steps
    yields c + 1 tokens and the next chain starts c + 1 entries on, so entries inside an
    accepted chain are never roots."""
    valid = torch.tensor([False, True, True, True, True, True, True, True, True, False])
    chains = [0, 1, 2, 1, 0, 0, 0, 1, 0, 0]  # leading correct steps per root
    correct = torch.tensor([[k < c for k in range(3)] for c in chains])
    correct[3, 2] = correct[8, 1] = True  # past a wrong step: never counted
    acceptance = Acceptance()
    acceptance.add(correct, valid, 1)
    # Roots 2 (chain 2: 3 tokens), 5 (1 token), 6 (1), 7 (chain 1: 2 tokens).
    assert (acceptance.tokens, acceptance.steps) == (7, 4)
    acceptance.add(torch.cat([correct, correct]), torch.cat([valid, valid]), 2)
    assert acceptance.length == pytest.approx(21 / 12)
    assert Acceptance().length == 1.0


def test_init_refuses_a_drafter_that_does_not_fit(tiny: Path, tmp_path: Path) -> None:
    """Each refusal comes before any data is generated (the out directory stays empty)."""
    cases = [
        ({"init": str(HEADS_DIR / "SmolLM2-135M-Instruct-DFLASH")}, "is a DFLASH drafter; --algo"),
        (
            {"init": str(HEADS_DIR / "SmolLM2-135M-Instruct-EAGLE3"), "target": str(tiny)},
            "reads hidden size 576; the target's is 64",
        ),
        (
            {"init": str(HEADS_DIR / "SmolLM2-135M-Instruct-EAGLE3"), "draft_vocab_size": 1024},
            "give --draft-vocab-size 8192",
        ),
        (
            {
                "init": str(HEADS_DIR / "SmolLM2-135M-Instruct-DFLASH"),
                "algorithm": "DFLASH",
                "draft_layers": 2,
            },
            "reads target layers [1, 14, 27] in blocks of 8; --draft-layers 2",
        ),
        (
            {
                "init": str(HEADS_DIR / "SmolLM2-135M-Instruct-STANDALONE"),
                "algorithm": "STANDALONE",
            },
            "give --draft-layers 4 --draft-hidden-size 160",
        ),
        ({"init": str(tmp_path)}, "no config.json"),
        (
            {
                "init": str(HEADS_DIR / "SmolLM2-135M-Instruct-NEXTN"),
                "algorithm": "NEXTN",
                "reselect_vocab": True,
            },
            "--reselect-vocab needs --algorithm EAGLE3 and an --init head",
        ),
    ]
    for changes, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            train_draft(TrainDraftConfig(**{"out": str(tmp_path / "out"), **changes}))
    assert not (tmp_path / "out" / "data").exists()


def test_bad_training_input_fails_before_loading(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n')
    with pytest.raises(ValueError, match="algorithm"):
        train_draft(TrainDraftConfig(algorithm="MEDUSA", out=str(tmp_path)))
    with pytest.raises(ValueError, match="no such file"):
        train_draft(TrainDraftConfig(out=str(tmp_path), data=str(tmp_path / "missing.jsonl")))
    with pytest.raises(ValueError, match="temperatures"):
        train_draft(TrainDraftConfig(out=str(tmp_path), temperatures="0,-1"))
    with pytest.raises(ValueError, match="temperatures"):
        train_draft(TrainDraftConfig(out=str(tmp_path), temperatures="0,greedy"))
    with pytest.raises(ValueError, match="STANDALONE learns at every position"):
        train_draft(TrainDraftConfig(out=str(tmp_path), algorithm="STANDALONE", on_policy_epochs=1))
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        train_draft(TrainDraftConfig(out=str(tmp_path), data=str(bad), num_prompts=0))
    with pytest.raises(ValueError, match="self-prompts"):
        train_draft(TrainDraftConfig(out=str(tmp_path), self_prompts=-1))
    with pytest.raises(ValueError, match="--exclude .*bad.jsonl"):  # not a JSON list
        train_draft(TrainDraftConfig(out=str(tmp_path), self_prompts=8, exclude=str(bad)))


def test_heldout_chat_prompts_share_no_topic_with_training() -> None:
    heldout = json.loads(HELDOUT.read_text())
    assert len(heldout) >= 16
    training = set(training_prompts())
    for prompt in heldout:
        assert prompt not in training
        assert not [t for t in TOPICS if re.search(rf"\b{re.escape(t)}\b", prompt, re.I)], prompt


@pytest.fixture()
def head_dir(tmp_path: Path, smollm_dir: Path) -> tuple[Path, ModelConfig]:
    """A (random) EAGLE-3 head for SmolLM2-135M written by save_head."""
    target = ModelConfig.from_file(smollm_dir / "config.json")
    cfg = dataclasses.replace(target, num_layers=1)
    head = EagleHead(cfg, "EAGLE3", target.hidden_size, 64)
    head.d2t.copy_(torch.arange(64) * 7)
    spec = HeadSpec(cfg, 64, ((1, 14, 26), False))
    save_head(head, tmp_path / "head", target, spec)
    return tmp_path / "head", target


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))


def test_saved_heads_are_in_the_published_layout(head_dir: tuple[Path, ModelConfig]) -> None:
    path, target = head_dir
    names = set(load_file(path / "model.safetensors"))
    assert {
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.hidden_norm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    } <= names
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert read_head_spec(path, "EAGLE3", target).draft_vocab == 64


def test_heads_that_do_not_fit_the_target_fail_clearly(
    head_dir: tuple[Path, ModelConfig],
) -> None:
    path, target = head_dir
    _edit_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 14, 40]})
    with pytest.raises(ValueError, match=r"reads target layers \[1, 14, 40\]"):
        read_head_spec(path, "EAGLE3", target)
    _edit_config(path, eagle_config=None, target_hidden_size=512)
    with pytest.raises(ValueError, match="reads hidden size 512; the target's is 576"):
        read_head_spec(path, "EAGLE3", target)
    _edit_config(path, target_hidden_size=576, vocab_size=32000)
    with pytest.raises(ValueError, match="vocab size 32000"):
        read_head_spec(path, "EAGLE3", target)
    _edit_config(path, vocab_size=target.vocab_size)
    tensors = load_file(path / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks \['d2t'\]"):
        read_head_spec(path, "EAGLE3", target)
    with pytest.raises(ValueError, match="reads hidden size 576"):
        read_head_spec(path, "EAGLE", dataclasses.replace(target, hidden_size=960))


def test_specmesh_up_refuses_a_bad_head_before_starting(
    head_dir: tuple[Path, ModelConfig], smollm_dir: Path
) -> None:
    path, _ = head_dir
    _edit_config(path, target_hidden_size=512)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "specmesh.services.cli",
            "up",
            "--model",
            str(smollm_dir),
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "reads hidden size 512; the target's is 576" in done.stderr
    assert "specmesh is up" not in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--speculative-algorithm", "NEXTN"], "has no MTP layers"),
        (["--overlap"], "--overlap overlaps drafting with verification"),
    ],
    ids=["nextn-without-mtp-layers", "overlap-without-speculation"],
)
def test_specmesh_up_refuses_bad_speculation_before_starting(
    args: list[str], message: str, smollm_dir: Path, tmp_path: Path
) -> None:
    # A copy of the default model under another name: no shipped drafter to fall back on.
    target = tmp_path / "target"
    target.mkdir()
    for f in smollm_dir.iterdir():
        (target / f.name).symlink_to(f)
    command = [sys.executable, "-m", "specmesh.services.cli", "up", "--model", str(target), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    assert "specmesh is up" not in done.stdout
