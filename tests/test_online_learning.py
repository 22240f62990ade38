"""Online learning: a drafter pool whose draft model a learner trains on the traffic it
serves.

The trainers (one per algorithm family), the drafters' swap and the version store alone,
then one deployment (EAGLE-3 over the services, learning online with thresholds small
enough for a test) through which versions are published, swapped under concurrency,
rolled back, refused and resumed, while greedy output stays the target's own; a
STANDALONE pool (examples without features) goes through the same with its own
checkpoints. NEXTN's and DFLASH's pools differ from these only in their trainers, swaps
and refusals, tested alone.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from deployment import chat_text, heartbeats, listing, specmesh_up
from helpers import SMOLLM_HEAD, tiny_llama, write_eagle_head
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from specmesh.services.learner.versions import HeadVersions
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.infra import start_nats
from specmesh.shared.model.loader import load_model
from specmesh.shared.sampling.params import SamplingParams
from specmesh.shared.speculative.config import SpeculativeConfig, shipped_drafter
from specmesh.shared.speculative.drafter import DraftRequest
from specmesh.shared.speculative.factory import make_drafter
from specmesh.shared.speculative.head_blob import WEIGHTS
from specmesh.shared.tokenizer import Tokenizer
from specmesh.shared.training.data import Sample
from specmesh.shared.training.eagle_trainer import Acceptance
from specmesh.shared.training.features import extract
from specmesh.shared.training.online import (
    OnlineOptions,
    OnlineTrainer,
    is_heldout,
    online_trainer,
    pooled,
)
from specmesh.shared.transport.shm import ShmTransport

TOPICS = "owls rivers volcanoes bread chess rain bees trains moons glass salt maps clocks ice"
PROMPTS = [f"Write two short facts about {topic}." for topic in TOPICS.split()]
PROMPTS += ["Count from one to eight in words.", "List four colours of the rainbow."]
PROMPTS += ["Spell 'river' letter by letter.", "Name three planets.", "Give a synonym for big."]
PROMPTS += ["What is two plus three?"]
MAX_TOKENS = 24
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}
DRAFTERS = {"drafter-0", "drafter-1"}
ROLLBACK_STEPS = 20


def test_the_heldout_share_is_a_fixed_hash_of_the_prompt() -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(49152) for _ in range(rng.randrange(1, 50))] for _ in range(4000)]
    held = [is_heldout(p, 0.1) for p in prompts]
    assert 0.08 < sum(held) / len(held) < 0.12
    assert held == [is_heldout(list(p), 0.1) for p in prompts]  # the same prompts, always


def shipped_trainer(smollm_dir: Path, algorithm: str, **options: float) -> OnlineTrainer:
    """A learner's trainer of `algorithm`'s shipped drafter, drafting as a pool does (its
    chain length, its token map)."""
    target = load_model(str(smollm_dir), torch.device("cpu"), torch.float32)
    spec = SpeculativeConfig(speculative_algorithm=algorithm).resolved()
    return online_trainer(
        algorithm,
        target.requires_grad_(False),
        OnlineOptions(ttt_steps=spec.speculative_num_steps, heldout_share=0.25, **options),
        Path(spec.speculative_draft_model_path),
        json.loads((smollm_dir / "config.json").read_text()),
        spec.speculative_token_map,
    )


def add_served(trainer: OnlineTrainer, samples: list[Sample]) -> list[torch.Tensor | None]:
    """Each sample as its drafter would have sent it: the target features it reads (none
    where it reads none) of the positions before the last token; returns them."""
    layers, normed = trainer.target_features
    features: list[torch.Tensor | None] = [None] * len(samples)
    if layers:
        views = extract(trainer.target, samples, layers, normed, store_dtype=torch.float16)
        features = [view.features[:-1] for view in views]
    for sample, rows in zip(samples, features, strict=True):
        trainer.add(sample.ids, sample.spans[0][0], rows, 0)
    return features


# Steps and options that learn the lists below: DFLASH's steps cost the most (blocks of 8).
LEARNING = {
    "EAGLE3": (8, {"lr": 1e-3, "batch_tokens": 768}),
    "NEXTN": (8, {"lr": 1e-3, "batch_tokens": 768}),
    "DFLASH": (6, {"lr": 3e-3, "batch_tokens": 300}),
    "STANDALONE": (6, {"lr": 2e-3, "batch_tokens": 300}),
}


@pytest.mark.parametrize("algorithm", list(LEARNING))
def test_training_on_served_examples_raises_heldout_acceptance(
    smollm_dir: Path, algorithm: str, tmp_path: Path
) -> None:
    """Numbered lists of a few words: the shipped drafter drafts them poorly until trained
    on what it would have been sent (the target's features where it reads them, the
    tokens). The trained draft is saved as a version is, and a pool's drafter takes it
    (NEXTN's in DeepSeek's MTP layout)."""
    steps, options = LEARNING[algorithm]
    trainer = shipped_trainer(smollm_dir, algorithm, **options)
    tok, rng = Tokenizer(smollm_dir), random.Random(0)
    words = "apple river stone cloud tiger lamp piano forest candle mirror".split()
    served = []
    for i in range(24):
        chosen = [rng.choice(words) for _ in range(10)]
        content = f"List these words, numbered ({i}): {' '.join(chosen)}"
        prompt = tok.encode_chat([{"role": "user", "content": content}])
        answer = tok.encode("\n".join(f"{k + 1}. {w.capitalize()}" for k, w in enumerate(chosen)))
        served.append(Sample(prompt + answer, [(len(prompt), len(prompt) + len(answer))]))
    add_served(trainer, served)
    assert len(trainer.heldout) >= 4 and trainer.take_new() == len(trainer.train_set)
    shipped, examples = copy.deepcopy(trainer.draft), trainer.heldout_examples()
    scores = trainer.heldout_scores(shipped, examples)
    before = pooled(scores)
    assert before == trainer.heldout_acceptance(shipped)
    for _ in range(steps):
        trainer.train_step()
    assert trainer.heldout_acceptance(trainer.draft) > before + 0.3
    # A draft's earlier scores are kept, not walked again; the examples new to it are.
    first = examples[0].serial
    marker = {first: Acceptance(tokens=1, steps=1)}
    assert trainer.heldout_scores(shipped, examples, marker) == scores | marker
    trainer.save(copy.deepcopy(trainer.draft).eval(), tmp_path)
    drafter = make_drafter(
        SpeculativeConfig(speculative_algorithm=algorithm).resolved(), trainer.target
    )
    drafter.use(drafter.prepared(tmp_path))
    if algorithm == "NEXTN":
        assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE"])  # STANDALONE: no features
def test_a_restarted_trainer_gets_its_examples_back(
    smollm_dir: Path, tmp_path: Path, algorithm: str
) -> None:
    """The buffers' tokens are saved; a new trainer restores them, features recomputed,
    as older than what arrived since; a damaged file is an error, not a crash later."""
    trainer = shipped_trainer(smollm_dir, algorithm)
    tok = Tokenizer(smollm_dir)
    served = []
    for i in range(10):
        prompt = tok.encode_chat([{"role": "user", "content": f"Count to {i + 3}."}])
        answer = tok.encode(", ".join(str(k) for k in range(1, i + 4)))
        served.append(Sample(prompt + answer, [(len(prompt), len(prompt) + len(answer))]))
    features = add_served(trainer, served)
    path = tmp_path / "examples.jsonl"
    trainer.save_examples(path)
    again = shipped_trainer(smollm_dir, algorithm)  # a restarted learner
    newest = served[-1]
    again.add(newest.ids, newest.spans[0][0], features[-1], 0)
    assert again.restore_examples(path) == len(served)
    for buffer, before in ((again.train_set, trainer.train_set), (again.heldout, trainer.heldout)):
        restored = [e.sample.ids for e in buffer][: len(before)]
        assert restored == [e.sample.ids for e in before]  # older than the one added since
    restored, saved = again.train_set[0].view, trainer.train_set[0].view
    assert torch.equal(restored.argmax, saved.argmax)
    assert torch.allclose(restored.features[:-1].float(), saved.features[:-1].float(), atol=1e-2)
    path.write_text('{"ids": [1, 2')
    with pytest.raises(ValueError):
        again.restore_examples(path)


def test_versions_persist_and_their_blobs_are_stored(tmp_path: Path) -> None:
    base = Path(shipped_drafter(None, "EAGLE3"))
    versions = HeadVersions(tmp_path / "eagle3", base, "EAGLE3")
    pushed = versions.add(lambda out: shutil.copytree(base, out), 0, "pushed")
    versions.serve(pushed)
    versions.mark(pushed, "kept")
    again = HeadVersions(tmp_path / "eagle3", base, "EAGLE3")  # a restarted learner
    assert again.current == pushed and again.records == versions.records
    head = again.announcement()
    store = ShmTransport("online-test", root=tmp_path)
    again.keep_stored(head, store)
    assert store.get_many([head.key]) == [(base / WEIGHTS).read_bytes()]
    assert head.config == (base / "config.json").read_text()


@pytest.fixture(scope="module")
def reference(smollm_dir: Path) -> dict[str, str]:
    """The target's own greedy answers (no speculation)."""
    tok = Tokenizer(smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), kv_cache_gb=0.25))
    ids = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return {p: tok.decode(o) for p, o in zip(PROMPTS, engine.generate(ids, params), strict=True)}


class Pool:
    def __init__(self, url: str, nats_url: str, log: Path, root: Path) -> None:
        """`root`: the learner's directory of one algorithm's versions."""
        self.url, self.nats_url, self.log, self.root = url, nats_url, log, root

    def state(self) -> dict:
        return json.loads((self.root / "state.json").read_text())

    def push(self, head: Path, name: str) -> None:
        """As an operator would: a checkpoint moved into incoming/ whole."""
        shutil.move(str(head), self.root / "incoming" / name)

    def pushed(self, after: int) -> int | None:
        """The version a push after version number `after` became, once it has."""
        found = [int(v) for v, r in self.state()["versions"].items() if r["source"] == "pushed"]
        return max((v for v in found if v > after), default=None)

    def drafter_version(self) -> int | None:
        """The version every drafter drafts with (None while they differ)."""
        beats = heartbeats(self.nats_url, 1.5)
        versions = {beats[d].head_version if d in beats else None for d in DRAFTERS}
        return versions.pop() if len(versions) == 1 else None

    def serve_all(self) -> dict[str, str]:
        with ThreadPoolExecutor(8) as pool:
            answers = pool.map(lambda p: chat_text(self.url, p, **GREEDY), PROMPTS)
            return dict(zip(PROMPTS, answers, strict=True))

    def wait_for(self, what: str, done: Callable[[], bool], timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"{what}: not within {timeout} s\n{self.log_text()}"
            time.sleep(0.5)

    def log_text(self) -> str:
        return "\n".join(line for line in self.log.read_text().splitlines() if "learner" in line)


def noisy_drafter(algorithm: str, path: Path, noise: float) -> Path:
    """The shipped drafter of `algorithm` with seeded noise added to its weights, `noise`
    times each tensor's mean magnitude: a little drafts about as well, a lot (random
    weights) nothing right."""
    shipped = Path(shipped_drafter(None, algorithm))
    path.mkdir()
    shutil.copy(shipped / "config.json", path / "config.json")
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for name, t in load_file(shipped / WEIGHTS).items():
        if t.is_floating_point():
            scale = noise * t.float().abs().mean()
            t = (t.float() + scale * torch.randn(t.shape, generator=generator)).to(t.dtype)
        tensors[name] = t
    save_file(tensors, path / WEIGHTS)
    return path


def mismatched_drafter(algorithm: str, path: Path) -> Path:
    """A checkpoint the pool's drafters cannot take: EAGLE-3's for a target of another
    width, an EAGLE-3 head for DFLASH, a narrower LM for STANDALONE."""
    path.mkdir()
    if algorithm == "EAGLE3":
        other = {**SMOLLM_HEAD, "hidden_size": 64, "intermediate_size": 128}
        return Path(write_eagle_head(path, eagle3=True, shape=other))
    if algorithm == "DFLASH":
        shutil.copytree(Path(shipped_drafter(None, "EAGLE3")), path, dirs_exist_ok=True)
        return path
    return Path(tiny_llama(path, vocab=49152, seed=0))


@pytest.mark.parametrize("algorithm", ["DFLASH", "STANDALONE"])
def test_a_swapped_drafter_drafts_as_one_loaded_with_the_new_weights(
    smollm_dir: Path, tmp_path: Path, algorithm: str
) -> None:
    """After a swap, nothing the old weights computed is read: an open request drafts as
    a drafter loaded with the new weights does given the same news from there on
    (STANDALONE recomputes its whole context; DFLASH's starts at the features after the
    swap), and a request opened later takes no prefix the old weights computed."""
    target = load_model(str(smollm_dir), torch.device("cpu"), torch.float32)
    spec = SpeculativeConfig(speculative_algorithm=algorithm, speculative_adaptive=False)
    spec = spec.resolved()
    swapped = make_drafter(spec, target)
    new_path = noisy_drafter(algorithm, tmp_path / "new", 0.1)
    fresh = make_drafter(
        SpeculativeConfig(**{**spec.__dict__, "speculative_draft_model_path": str(new_path)}),
        target,
    )
    width = len(swapped.target_features[0]) * target.config.hidden_size
    prompt = Tokenizer(smollm_dir).encode_chat([{"role": "user", "content": PROMPTS[0]}])
    answer = [28, 253, 314, 1171, 30, 216, 17, 30]  # what a target might have emitted
    ids = prompt + answer
    features = torch.randn(len(ids), width, generator=torch.Generator().manual_seed(0))
    budget = spec.speculative_num_steps

    def news(request_id: str, start: int, end: int, position: int) -> DraftRequest:
        """Tokens start..end-1 accepted; the features of positions `position`..end-2."""
        rows = features[position : end - 1] if width else None
        return DraftRequest(request_id, ids[start:end], budget, rows, position)

    swapped.open("a", prompt)
    swapped.propose([news("a", len(prompt), len(prompt), 0)])
    swapped.propose([news("a", len(prompt), len(prompt) + 4, len(prompt) - 1)])
    swapped.use(swapped.prepared(new_path))
    fresh.open("a", prompt)
    swap_at = len(prompt) + 3  # the first position whose features come after the swap
    after = [news("a", len(prompt) + 4, len(ids), swap_at)]
    drafts = swapped.propose(after)
    after = [news("a", len(prompt), len(ids), swap_at)]
    assert drafts == fresh.propose(after) and len(drafts[0]) == budget + 1
    for drafter in (swapped, fresh):  # after a prefix the target served from its cache
        drafter.open("b", prompt)
    later = [news("b", len(prompt), len(prompt), 16)]
    assert swapped.propose(later) == fresh.propose(later)


@contextlib.contextmanager
def learning_pool(smollm_dir: Path, root: Path, algorithm: str) -> Iterator[Pool]:
    """`algorithm` learning online with two drafters; the learner publishes whatever it
    trains (min gain < 0), after rounds of 2 steps, and judges a version live after 20
    verification steps."""
    log = root / "up.log"
    args = ["--speculative-algorithm", algorithm, "--speculative-online-learning"]
    args += ["--drafters", "2", "--speculative-online-dir", str(root)]
    args += ["--kv-namespace", f"online-{algorithm}"]
    args += ["--speculative-online-min-examples", "4", "--speculative-online-round-steps", "2"]
    args += ["--speculative-online-min-gain", "-10", "--speculative-online-heldout-share", "0.4"]
    args += ["--speculative-online-rollback-steps", str(ROLLBACK_STEPS)]
    with start_nats() as bus, specmesh_up(smollm_dir, "--nats-url", bus.url, *args, log=log) as url:
        yield Pool(url, bus.url, log, root / algorithm.lower())


@pytest.fixture(scope="module")
def pool(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with learning_pool(smollm_dir, tmp_path_factory.mktemp("online"), "EAGLE3") as pool:
        yield pool


def trained_versions_are_drafted_with(pool: Pool, reference: dict[str, str]) -> None:
    assert pool.serve_all() == reference
    pool.wait_for("a trained version", lambda: pool.state()["current"] > 0)
    assert pool.serve_all() == reference  # drafted by the versions published meanwhile
    versions = pool.state()["versions"]
    assert any(v["source"] == "trained" for v in versions.values())
    pool.wait_for("the drafter on it", lambda: pool.drafter_version() == pool.state()["current"])


def test_heads_swapped_under_concurrency_leave_output_unchanged(
    pool: Pool, reference: dict[str, str]
) -> None:
    trained_versions_are_drafted_with(pool, reference)


def test_a_head_that_drafts_worse_is_rolled_back(
    pool: Pool, reference: dict[str, str], tmp_path: Path
) -> None:
    a_worse_version_is_rolled_back(pool, reference, noisy_drafter("EAGLE3", tmp_path / "bad", 50))


def a_worse_version_is_rolled_back(pool: Pool, reference: dict[str, str], head: Path) -> None:
    """`head` pushed, drafted with while output stays the target's, then rolled back."""
    assert pool.serve_all() == reference  # live acceptance for the version it is judged by
    last = max(int(v) for v in pool.state()["versions"])
    pool.push(head, "worse")
    pool.wait_for("the push", lambda: pool.pushed(last) is not None)
    bad = pool.pushed(last)
    pool.wait_for("the drafter on it", lambda: pool.drafter_version() == bad)
    while pool.state()["versions"][str(bad)]["status"] == "serving":
        assert pool.serve_all() == reference
    assert pool.state()["versions"][str(bad)]["status"] == "rolled back"
    assert "drafts worse live" in pool.log_text()
    pool.wait_for("the drafters back", lambda: pool.drafter_version() not in (None, bad))


@pytest.mark.parametrize("kind", ["mismatched", "corrupt"])
def test_a_corrupt_or_mismatched_head_is_refused(pool: Pool, kind: str, tmp_path: Path) -> None:
    a_version_is_refused(pool, unfit_drafter("EAGLE3", kind, tmp_path / kind), kind)


def unfit_drafter(algorithm: str, kind: str, path: Path) -> Path:
    """A mismatched checkpoint (`mismatched_drafter`), or the shipped one cut short."""
    if kind == "mismatched":
        return mismatched_drafter(algorithm, path)
    shutil.copytree(Path(shipped_drafter(None, algorithm)), path)
    (path / WEIGHTS).write_bytes((path / WEIGHTS).read_bytes()[:100_000])
    return path


def a_version_is_refused(pool: Pool, head: Path, kind: str) -> None:
    """Every drafter refuses `head` and drafts on; the pool goes back to the version it had
    (the learner may publish trained ones meanwhile)."""
    last = max(int(v) for v in pool.state()["versions"])
    pool.push(head, kind)
    pool.wait_for("the push", lambda: pool.pushed(last) is not None)
    pushed = pool.pushed(last)
    pool.wait_for("a refusal", lambda: pool.state()["versions"][str(pushed)]["status"] == "refused")
    for drafter in DRAFTERS:
        logger = "specmesh.services.drafter.online"
        refusal = f"{drafter} ERROR {logger}: refusing head version {pushed}: "
        pool.wait_for(f"{drafter}'s refusal", lambda r=refusal: r in pool.log.read_text())
    had = pool.state()["versions"][str(pushed)]["parent"]
    assert f"the pool goes back to version {had}" in pool.log_text()
    assert f"drafting with head version {pushed}" not in pool.log.read_text()
    pool.wait_for("the drafters on the pool's version", lambda: pool.drafter_version() is not None)


def test_a_restarted_pool_resumes_the_latest_version(pool: Pool) -> None:
    processes = listing(pool.log)
    os.kill(processes["learner-0"][0], signal.SIGKILL)  # supervision restarts it
    current = pool.state()["current"]  # what it last made current
    os.kill(processes["drafter-0"][0], signal.SIGKILL)
    pool.wait_for("both back", lambda: pool.log.read_text().count("learner-0 ready") == 2)
    pool.wait_for("the drafter on the latest", lambda: pool.drafter_version() == current)
    assert heartbeats(pool.nats_url, 1.5)["learner-0"].head_version == current
    restored = re.compile(r"learner-0 INFO \S+: restored ([1-9]\d*) served examples")
    pool.wait_for("its examples back", lambda: restored.search(pool.log.read_text()) is not None)


def test_a_draft_lm_pool_learns_as_heads_do(
    smollm_dir: Path, reference: dict[str, str], tmp_path: Path
) -> None:
    """STANDALONE's draft LM (its examples carry no features): trained versions are drafted
    with under concurrency, a mismatched one is refused, and output stays the target's
    throughout. Rollback (live acceptance) and a cut file's refusal do not depend on the
    algorithm: the EAGLE-3 pool above shows them. DFLASH shares all of it but its trainer
    and swap, tested alone above and below."""
    with learning_pool(smollm_dir, tmp_path, "STANDALONE") as pool:
        trained_versions_are_drafted_with(pool, reference)
        unfit = unfit_drafter("STANDALONE", "mismatched", tmp_path / "mismatched")
        a_version_is_refused(pool, unfit, "mismatched")


@pytest.mark.parametrize("kind", ["mismatched", "corrupt"])
def test_a_block_drafter_refuses_a_version_that_does_not_fit(
    smollm_dir: Path, tmp_path: Path, kind: str
) -> None:
    """DFLASH's half of a refusal (the pool's is the same as every algorithm's): an EAGLE-3
    head or a cut checkpoint cannot take the draft's place, and the draft stays."""
    target = load_model(str(smollm_dir), torch.device("cpu"), torch.float32)
    drafter = make_drafter(SpeculativeConfig(speculative_algorithm="DFLASH").resolved(), target)
    draft = drafter.draft
    with pytest.raises((ValueError, KeyError, SafetensorError)):
        drafter.prepared(unfit_drafter("DFLASH", kind, tmp_path / kind))
    assert drafter.draft is draft
