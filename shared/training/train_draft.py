"""`specmesh train-draft`: data, target features, draft vocabulary, training, checkpoint.

Every stage keeps its result under `--out`, so a stopped run resumes: generated answers
(`data/self_distill.jsonl`, `data/self_distill-t0.7.jsonl` for `--temperatures 0,0.7`,
with their captured features), the training state (`train_state.pt`, every
`--save-every` steps) and the head itself, written in the published layout that
`--speculative-draft-model-path` loads. Training starts from a fresh drafter or from
`--init`'s; `--epochs` of the main stage are followed by `--on-policy-epochs` that train
where the drafter's own drafts are rejected (see `eagle_trainer.py`). Features are read
from disk per batch, so memory does not grow with the data.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from specmesh.shared.config import model_option, option, resolve_device
from specmesh.shared.engine.engine import EngineConfig, LLMEngine
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.fetch import resolve_model
from specmesh.shared.model.layers import Linear
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.loader import load_model, save_model
from specmesh.shared.speculative.config import HOT_TOKENS
from specmesh.shared.speculative.dflash import (
    DFlashDraft,
    default_target_layers,
    load_dflash,
    read_dflash_spec,
    save_dflash,
)
from specmesh.shared.speculative.drafter import target_feature_layers
from specmesh.shared.speculative.eagle import (
    EagleHead,
    HeadSpec,
    load_head,
    read_head_spec,
    save_head,
    save_mtp,
)
from specmesh.shared.speculative.standalone import load_token_map
from specmesh.shared.tokenizer import Tokenizer
from specmesh.shared.training.data import (
    Capture,
    Sample,
    find_captures,
    read_local,
    read_samples,
    self_distill,
    self_written_prompts,
)
from specmesh.shared.training.dflash_trainer import block_loss, mask_token_id, new_dflash
from specmesh.shared.training.eagle_trainer import (
    Acceptance,
    Batch,
    Roots,
    StepResult,
    collate,
    lr_at,
    make_batches,
    unrolled_loss,
)
from specmesh.shared.training.features import (
    TargetViews,
    capture_by_teacher_forcing,
    capture_layers,
)
from specmesh.shared.training.prompts import training_prompts
from specmesh.shared.training.student_trainer import distill_loss, new_student
from tqdm import tqdm

log = logging.getLogger(__name__)
TRAINABLE = ("EAGLE3", "EAGLE", "NEXTN", "DFLASH", "STANDALONE")


@dataclass(frozen=True)
class TrainDraftConfig:
    """Each field is also a `specmesh train-draft` option."""

    algorithm: str = option("EAGLE3", "drafter to train", choices=TRAINABLE)
    target: str | None = model_option()
    out: str | None = option(None, "output directory (the head, plus resumable work files)")
    data: str | None = option(
        None,
        "extra local data: comma-separated .jsonl conversation "
        "files (OpenAI messages / ShareGPT) or plain text files",
    )
    num_prompts: int | None = option(None, "built-in prompts to self-distill (default: all)")
    self_prompts: int = option(
        0, "prompts the target writes itself (Magpie) to self-distill after the built-in ones"
    )
    exclude: str | None = option(
        None, "JSON list of evaluation prompts that self-written prompts must stay clear of"
    )
    max_new_tokens: int = option(256, "longest self-distilled answer")
    temperatures: str = option(
        "0",
        "sampling temperatures of self-distilled answers, comma-separated (0: greedy): the "
        "prompts are answered at each (each temperature its own resumable file under --out) "
        "and all answers train one drafter; sampled answers loop less and cover more of what "
        "the target says (SpecForge regenerates with sampling)",
        aliases=("--temperature",),
    )
    max_len: int = option(1024, "longest training sequence, tokens")
    generate_batch: int = option(96, "sequences generated at once")
    draft_vocab_size: int = option(
        8192,
        "EAGLE-3's draft vocabulary, the most frequent targets (EAGLE, NEXTN: that many ids "
        "in the token map written beside the head)",
    )
    ttt_steps: int = option(
        5,
        "draft steps unrolled in training (training-time test; STANDALONE: the longest "
        "chain the held-out acceptance counts)",
    )
    root_fraction: float = option(
        0.25,
        "fraction of each sample's positions unrolled as drafting roots (DFLASH: block "
        "anchors) per step; STANDALONE learns at every position",
    )
    block_size: int = option(8, "DFLASH: tokens per block, the root included")
    draft_layers: int = option(
        3, "DFLASH, STANDALONE: decoder layers of the draft (STANDALONE: spaced target layers)"
    )
    draft_hidden_size: int | None = option(
        None,
        "STANDALONE: the draft's residual width (default: the target's; narrower keeps the "
        "coordinates where the target's embedding is largest)",
    )
    init: str | None = option(
        None,
        "continue training this drafter (a shipped one, or a run's head/) instead of a fresh "
        "one: of --algorithm, fitting the target and the shape options; its vocabulary "
        "(EAGLE-3's d2t, the others' hot_tokens.json) is kept",
    )
    reselect_vocab: bool = option(
        False,
        "EAGLE-3 with --init: choose the draft vocabulary again from this run's data (the "
        "--draft-vocab-size targets it chooses most) instead of keeping the head's; the ids "
        "the head had keep their LM-head rows, new ones start from the target's LM head "
        "mapped as the kept rows were",
    )
    epochs: float = option(2.0, "passes over the training data")
    on_policy_epochs: float = option(
        0.0,
        "passes after --epochs that train where the drafter's own drafts are rejected "
        "(roots drawn where its greedy chain breaks early, draft steps counted where its "
        "chain reaches them), at a tenth of --lr; not STANDALONE",
    )
    lr: float = option(5e-4, "peak learning rate (AdamW, warm-up then cosine)")
    batch_tokens: int = option(4096, "tokens per optimizer step")
    heldout: float = option(0.03, "fraction of samples kept apart to measure acceptance")
    eval_every: int = option(200, "optimizer steps between held-out evaluations")
    save_every: int = option(100, "optimizer steps between resumable checkpoints")
    minutes: float | None = option(None, "stop training after this many minutes")
    data_only: bool = option(
        False, "stop once the data is generated (train later with the same --out)"
    )
    seed: int = option(0, "seed for prompt order, the held-out split, init and batches")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")

    def checked(self) -> TrainDraftConfig:
        """This config with the algorithm's name in capitals, once every option is valid."""
        if self.algorithm != self.algorithm.upper():
            return dataclasses.replace(self, algorithm=self.algorithm.upper()).checked()
        if self.algorithm not in TRAINABLE:
            raise ValueError(f"--algorithm must be one of {TRAINABLE}, got {self.algorithm!r}")
        if not self.out:
            raise ValueError("--out is required: the directory the head is written to")
        for path in self.data_files:
            if not path.is_file():
                raise ValueError(f"--data {path}: no such file")
        if self.self_prompts < 0:
            raise ValueError(f"--self-prompts must be >= 0, got {self.self_prompts}")
        if self.exclude:
            read_prompt_list(Path(self.exclude))  # a bad file fails before anything loads
        if self.reselect_vocab and (self.algorithm != "EAGLE3" or not self.init):
            raise ValueError("--reselect-vocab needs --algorithm EAGLE3 and an --init head")
        if self.block_size < 2 or self.draft_layers < 1:
            raise ValueError("--block-size must be >= 2 and --draft-layers >= 1")
        if self.draft_hidden_size is not None and self.draft_hidden_size < 1:
            raise ValueError(f"--draft-hidden-size must be >= 1, got {self.draft_hidden_size}")
        if self.ttt_steps < 1 or self.epochs <= 0 or not 0 < self.heldout < 1:
            raise ValueError("--ttt-steps must be >= 1, --epochs > 0, --heldout in (0, 1)")
        if not 0 < self.root_fraction <= 1:
            raise ValueError("--root-fraction must be in (0, 1]")
        temperatures = self.temperature_list
        if min(temperatures) < 0 or len(set(temperatures)) < len(temperatures):
            raise ValueError(f"--temperatures must be distinct and >= 0, got {self.temperatures}")
        if self.on_policy_epochs < 0:
            raise ValueError(f"--on-policy-epochs must be >= 0, got {self.on_policy_epochs}")
        if self.on_policy_epochs and self.algorithm == "STANDALONE":
            raise ValueError(
                "--on-policy-epochs: STANDALONE learns at every position, it has no drafting "
                "roots to choose"
            )
        return self

    @property
    def data_files(self) -> list[Path]:
        return [Path(p) for p in (self.data or "").split(",") if p]

    @property
    def temperature_list(self) -> list[float]:
        try:
            return [float(t) for t in str(self.temperatures).split(",")]
        except ValueError:
            raise ValueError(
                f"--temperatures must be comma-separated numbers, got {self.temperatures!r}"
            ) from None


def read_prompt_list(path: Path) -> list[str]:
    try:
        prompts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--exclude {path}: {exc}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--exclude {path}: expected a JSON list of strings")
    return prompts


def answers_file(out: Path, temperature: float) -> Path:
    """Where self-distilled answers of `temperature` accumulate; answers of another
    temperature are other data, each with its own file to resume."""
    suffix = f"-t{temperature:g}" if temperature else ""
    return out / "data" / f"self_distill{suffix}.jsonl"


def generate_answers(
    cfg: TrainDraftConfig, target_dir: Path, tokenizer: Tokenizer, layers: tuple[int, ...]
) -> int:
    """Self-written prompts and the target's answers to them and to the built-in ones, at
    each temperature, generated now or resumed; returns how many prompts the run uses."""
    data = Path(cfg.out) / "data"
    data.mkdir(parents=True, exist_ok=True)
    prompts = training_prompts(cfg.seed)[: cfg.num_prompts]
    if cfg.self_prompts:
        exclude = read_prompt_list(Path(cfg.exclude)) if cfg.exclude else []
        written = data / "self_prompts.jsonl"
        engine = _generator(cfg, target_dir)
        prompts += self_written_prompts(
            engine, tokenizer, cfg.self_prompts, exclude, written, cfg.seed
        )
        del engine  # its KV cache goes before the next engine's comes
    for temperature in cfg.temperature_list:
        work = answers_file(Path(cfg.out), temperature)
        if prompts and len(read_samples(work)) < len(prompts):
            # a fresh engine: self_distill reads prompt rows from its prefix cache
            engine = _generator(cfg, target_dir)
            self_distill(
                engine, tokenizer, prompts, work, cfg.max_new_tokens, layers, temperature, cfg.seed
            )
            del engine
    return len(prompts)


def capture_answers(
    cfg: TrainDraftConfig, target_dir: Path, layers: tuple[int, ...], count: int
) -> None:
    """The target layers of answers generated without them (by a run that did not keep
    them), computed and kept beside them, once, resumably."""
    target = None
    for temperature in cfg.temperature_list:
        work = answers_file(Path(cfg.out), temperature)
        samples = read_samples(work)[:count]
        captures = find_captures(work, layers, len(samples))
        if None in captures:
            device = resolve_device(cfg.device)
            target = target or load_model(target_dir, device, torch.float32)
            capture_by_teacher_forcing(target, samples, captures, work, layers)


@dataclass
class Corpus:
    """The training samples and, per sample, where generation kept its target layers (None:
    to be computed), whether it is a greedy answer, and which prompt it answers (local
    data: a prompt of its own)."""

    samples: list[Sample]
    captures: list[Capture | None]
    greedy: list[bool]
    prompts: list[int]


def gather_samples(
    cfg: TrainDraftConfig, tokenizer: Tokenizer, layers: tuple[int, ...], count: int
) -> Corpus:
    """The answers to the first `count` prompts at each temperature, plus local data."""
    samples: list[Sample] = []
    captures: list[Capture | None] = []
    greedy: list[bool] = []
    prompts: list[int] = []
    for temperature in cfg.temperature_list:
        work = answers_file(Path(cfg.out), temperature)
        distilled = read_samples(work)[:count]
        samples += distilled
        captures += find_captures(work, layers, len(distilled))
        greedy += [temperature == 0] * len(distilled)
        prompts += range(len(distilled))
    local = [s for f in cfg.data_files for s in read_local(f, tokenizer, cfg.max_len)]
    samples += local
    captures += [None] * len(local)
    greedy += [True] * len(local)
    prompts += range(count, count + len(local))
    keep = [i for i, s in enumerate(samples) if len(s.ids) >= 2 and s.spans]
    columns = (samples, captures, greedy, prompts)
    return Corpus(*([column[i] for i in keep] for column in columns))


def split_heldout(prompts: list[int], heldout: float, seed: int) -> tuple[list[int], list[int]]:
    """(held-out, training) sample indices: a seeded random `heldout` fraction of the
    prompts is held out with all its answers (greedy and sampled answers to one prompt are
    near each other, and would leak)."""
    answers: dict[int, list[int]] = {}
    for i, prompt in enumerate(prompts):
        answers.setdefault(prompt, []).append(i)
    groups = list(answers.values())
    if len(groups) < 2:
        raise ValueError("not enough training data: give --num-prompts > 1 or --data")
    order = list(range(len(groups)))
    random.Random(seed).shuffle(order)
    n_held = max(1, int(len(groups) * heldout))
    held, train = order[:n_held], order[n_held:]
    return [i for g in held for i in groups[g]], [i for g in train for i in groups[g]]


def _generator(cfg: TrainDraftConfig, target_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(target_dir),
            device=cfg.device,
            kv_cache_gb=3.0,
            max_num_seqs=cfg.generate_batch,
            max_num_batched_tokens=1024,
        )
    )


def draft_vocab(
    samples: list[Sample], choices: list[torch.Tensor], size: int, vocab: int
) -> torch.Tensor:
    """The `size` target ids most often chosen (`choices`: the target's per position) at
    learned positions, ascending (SpecForge's rule; padded with the lowest unused ids when
    fewer occur)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for sample, chosen in zip(samples, choices, strict=True):
        for start, end in sample.spans:
            counts += torch.bincount(chosen[max(start - 1, 0) : end - 1], minlength=vocab)
    top = counts.topk(min(size, vocab)).indices
    return top.sort().values


def drafter_algorithm(path: Path) -> str:
    """The algorithm of the drafter saved at `path`, as its config.json says."""
    if not (path / "config.json").is_file():
        raise ValueError(f"--init {path}: no config.json (give a drafter's directory)")
    raw = json.loads((path / "config.json").read_text())
    architectures = raw.get("architectures") or []
    for architecture, algorithm in (
        ("DFlashDraftModel", "DFLASH"),
        ("LlamaForCausalLMEagle3", "EAGLE3"),
        ("LlamaForCausalLMEagle", "EAGLE"),
    ):
        if architecture in architectures:
            return algorithm
    return "NEXTN" if raw.get("num_nextn_predict_layers") else "STANDALONE"


def check_init(
    cfg: TrainDraftConfig, target: ModelConfig, layers: tuple[int, ...], normed: bool
) -> None:
    """Refuse an --init drafter of another algorithm, or one that does not fit the target,
    the features the data keeps or the shape options, before anything is generated."""
    path = Path(cfg.init)
    found = drafter_algorithm(path)
    if found != cfg.algorithm:
        raise ValueError(f"--init {path} is a {found} drafter; --algorithm is {cfg.algorithm}")
    if cfg.algorithm == "DFLASH":
        spec = read_dflash_spec(path, target)
        if (spec.target_layers, spec.block_size) != (layers, cfg.block_size):
            raise ValueError(
                f"--init {path} reads target layers {list(spec.target_layers)} in blocks of "
                f"{spec.block_size}; --draft-layers {cfg.draft_layers} --block-size "
                f"{cfg.block_size} read {list(layers)} in blocks of {cfg.block_size}"
            )
    elif cfg.algorithm == "STANDALONE":
        shape = ModelConfig.from_file(path / "config.json")
        width = cfg.draft_hidden_size or target.hidden_size
        if shape.vocab_size != target.vocab_size:
            raise ValueError(
                f"--init {path} has vocab size {shape.vocab_size}; the target's is "
                f"{target.vocab_size}"
            )
        if (shape.num_layers, shape.hidden_size) != (cfg.draft_layers, width):
            raise ValueError(
                f"--init {path} has {shape.num_layers} layers of width {shape.hidden_size}; "
                f"give --draft-layers {shape.num_layers} --draft-hidden-size {shape.hidden_size}"
            )
    else:
        spec = read_head_spec(path, cfg.algorithm, target)
        if spec.target_features != (layers, normed):
            raise ValueError(
                f"--init {path} reads target layers {list(spec.target_features[0])}; the "
                f"training data keeps {list(layers)}"
            )
        resized = cfg.algorithm == "EAGLE3" and spec.draft_vocab != cfg.draft_vocab_size
        if resized and not cfg.reselect_vocab:
            raise ValueError(
                f"--init {path} has a draft vocabulary of {spec.draft_vocab}; give "
                f"--draft-vocab-size {spec.draft_vocab}, or --reselect-vocab"
            )
    hot = path / HOT_TOKENS
    if hot.is_file() and len(ids := json.loads(hot.read_text())) != cfg.draft_vocab_size:
        raise ValueError(
            f"--init {path} has a token map of {len(ids)} ids; give --draft-vocab-size {len(ids)}"
        )


def load_init(cfg: TrainDraftConfig, target: LlamaForCausalLM) -> torch.nn.Module:
    """The --init drafter (checked by `check_init`), in float32 on the target's device."""
    path = Path(cfg.init)
    device = target.embed_tokens.weight.device
    if cfg.algorithm == "DFLASH":
        return load_dflash(path, target.config).to(device)
    if cfg.algorithm == "STANDALONE":
        return load_model(path, device, torch.float32)
    head, _, embed = load_head(path, cfg.algorithm, target)
    if embed is not None:
        raise ValueError(
            f"--init {path} brings its own embedding; heads trained here read the target's"
        )
    return head.to(device)


def kept_vocab(
    cfg: TrainDraftConfig, init: torch.nn.Module | None, vocab: int
) -> torch.Tensor | None:
    """The --init drafter's vocabulary, which training keeps: EAGLE-3's draft ids, the
    others' token map (None: no --init, or one without a token map)."""
    if init is None:
        return None
    if isinstance(init, EagleHead) and init.eagle3:
        return init.draft_ids.cpu()
    hot = Path(cfg.init) / HOT_TOKENS
    return load_token_map(str(hot), vocab) if hot.is_file() else None


@torch.no_grad()
def with_draft_vocab(
    head: EagleHead, draft_ids: torch.Tensor, target: LlamaForCausalLM
) -> EagleHead:
    """The EAGLE-3 `head` drafting over `draft_ids` (ascending target ids) instead of its
    own vocabulary: an id it had keeps its LM-head row, a new one starts from the target's
    row carried into the head's space."""
    device = head.d2t.device
    draft_ids = draft_ids.to(device)
    row_of = torch.full((target.config.vocab_size,), -1, dtype=torch.long, device=device)
    row_of[head.draft_ids] = torch.arange(len(head.d2t), device=device)
    kept = row_of[draft_ids]
    had = kept >= 0
    # Training moved the head's rows away from the target's (the head's hidden space is its
    # own): new ids start from the target's rows through the linear map that best takes the
    # target's rows of the ids kept to the head's.
    kept_rows = head.lm_head.weight[kept[had]]
    transfer = torch.linalg.lstsq(target.lm_head.weight[draft_ids[had]], kept_rows).solution
    rows = target.lm_head.weight[draft_ids] @ transfer
    rows[had] = kept_rows
    head.lm_head = Linear(rows.shape[1], len(draft_ids), bias=False).to(device)
    head.lm_head.weight.copy_(rows)
    head.d2t = draft_ids - torch.arange(len(draft_ids), device=device)
    return head


def new_head(
    target: LlamaForCausalLM, algorithm: str, draft_ids: torch.Tensor | None, seed: int
) -> EagleHead:
    """A head shaped like one target layer (NEXTN: exactly one, biases included). It starts
    near the target's own prediction: `fc` passes the last feature it reads through, and
    the output norm (and EAGLE-3's LM head, restricted to the draft vocabulary) are the
    target's."""
    torch.manual_seed(seed)
    tcfg = target.config
    eagle3 = algorithm == "EAGLE3"
    cfg = dataclasses.replace(tcfg, num_layers=1)
    if algorithm != "NEXTN":
        cfg = dataclasses.replace(
            cfg, architecture="LlamaForCausalLM", qkv_bias=False, o_proj_bias=False, mlp_bias=False
        )
    vocab = len(draft_ids) if draft_ids is not None else tcfg.vocab_size
    head = EagleHead(cfg, algorithm, tcfg.hidden_size, vocab)
    for name, p in head.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)
    with torch.no_grad():  # fc starts by passing the last feature through (nearest the output)
        hidden = tcfg.hidden_size
        head.fc.weight[:, -hidden:] += torch.eye(hidden)
    with torch.no_grad():
        if eagle3 or head.mtp:
            head.norm.weight.copy_(target.norm.weight)
        if eagle3:
            head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids), device=draft_ids.device))
    return head


@dataclass
class Trainee:
    """What the training loop needs of a drafter: its module, its loss over a batch from the
    roots (DFLASH: anchors) it picks, and how it is saved."""

    module: torch.nn.Module
    loss: Callable[[Batch, Roots], StepResult]
    save: Callable[[Path], None]


def eagle_trainee(
    cfg: TrainDraftConfig,
    target: LlamaForCausalLM,
    frequent: torch.Tensor,
    features: tuple[tuple[int, ...], bool],
    target_dir: Path,
    init: EagleHead | None,
) -> Trainee:
    """An EAGLE/EAGLE-3 head or NEXTN layer, trained unrolled over `ttt_steps` draft steps."""
    eagle3 = cfg.algorithm == "EAGLE3"
    draft_ids = frequent.to(target.lm_head.weight.device) if eagle3 else None
    head = init if init is not None else new_head(target, cfg.algorithm, draft_ids, cfg.seed)
    spec = HeadSpec(head.config, len(frequent) if eagle3 else head.config.vocab_size, features)

    def loss(batch: Batch, roots: Roots) -> StepResult:
        return unrolled_loss(head, target, batch, cfg.ttt_steps, draft_ids, roots)

    def save(path: Path) -> None:
        if head.mtp:
            save_mtp(head.cpu().eval(), path, json.loads((target_dir / "config.json").read_text()))
        else:
            save_head(head.cpu().eval(), path, target.config, spec)

    return Trainee(head, loss, save)


def dflash_trainee(
    cfg: TrainDraftConfig,
    target: LlamaForCausalLM,
    frequent: torch.Tensor,
    tokenizer: Tokenizer,
    init: DFlashDraft | None,
) -> Trainee:
    """A DFLASH block draft, scoring the frequent ids (its token map) in training."""
    draft = init
    if draft is None:
        mask = mask_token_id(tokenizer, target.config.vocab_size)
        draft = new_dflash(target, cfg.draft_layers, cfg.block_size, mask, cfg.seed)
    vocab_ids = frequent.to(target.lm_head.weight.device)

    def loss(batch: Batch, anchors: Roots) -> StepResult:
        return block_loss(draft, target, batch, vocab_ids, anchors)

    return Trainee(draft, loss, lambda path: save_dflash(draft.cpu().eval(), path, target.config))


def student_trainee(
    cfg: TrainDraftConfig,
    target: LlamaForCausalLM,
    frequent: torch.Tensor,
    target_dir: Path,
    init: LlamaForCausalLM | None,
) -> Trainee:
    """A STANDALONE draft LM, distilled at every position over the frequent ids."""
    width = cfg.draft_hidden_size or target.config.hidden_size
    student = init if init is not None else new_student(target, width, cfg.draft_layers)
    vocab_ids = frequent.to(target.lm_head.weight.device)

    def loss(batch: Batch, roots: Roots) -> StepResult:
        return distill_loss(student, target, batch, vocab_ids, cfg.ttt_steps)

    def save(path: Path) -> None:
        save_model(student.cpu().eval(), path, json.loads((target_dir / "config.json").read_text()))

    return Trainee(student, loss, save)


@torch.no_grad()
def evaluate(run: Run, batches: list[list[int]]) -> tuple[float, float]:
    """Held-out (loss, acceptance length of greedy chain drafting)."""
    run.trainee.module.eval()
    losses, acceptance = [], Acceptance()
    for idx in batches:
        r = run.trainee.loss(collate(run.samples, run.views, idx, run.device), Roots())
        losses.append(r.loss.item())
        acceptance.add(*r.per_entry(), len(idx))
    run.trainee.module.train()
    return sum(losses) / max(1, len(losses)), acceptance.length


@torch.no_grad()
def chain_preference(trainee: Trainee, batch: Batch) -> torch.Tensor:
    """[B, M] the on-policy stage's preference for each entry as a root (DFLASH: anchor):
    K + 1 - the length of the drafter's greedy chain from it, K its steps (see
    `eagle_trainer.py`)."""
    with torch.no_grad():  # a probe: no graph to keep
        correct, _ = trainee.loss(batch, Roots()).per_entry()
    chain = correct.int().cumprod(dim=1).sum(dim=1)
    return (correct.shape[1] + 1 - chain).float().view(len(batch.ids), -1)


def feature_layers(cfg: TrainDraftConfig, num_layers: int) -> tuple[tuple[int, ...], bool]:
    """The target layers the drafter reads, and whether the one is final-normed."""
    if cfg.algorithm == "DFLASH":
        return default_target_layers(num_layers, cfg.draft_layers), False
    return target_feature_layers(cfg.algorithm, num_layers)


def train_draft(cfg: TrainDraftConfig) -> Path:
    """Run every stage; returns the directory of the trained drafter."""
    cfg = cfg.checked()
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    target_dir = resolve_model(cfg.target)
    tokenizer = Tokenizer(target_dir)
    target_config = ModelConfig.from_file(target_dir / "config.json")
    features = feature_layers(cfg, target_config.num_layers)
    if cfg.init:
        check_init(cfg, target_config, *features)
    capture = capture_layers(*features, target_config.num_layers)
    count = generate_answers(cfg, target_dir, tokenizer, capture)
    capture_answers(cfg, target_dir, capture, count)
    if cfg.data_only:
        return Path(cfg.out) / "data"
    corpus = gather_samples(cfg, tokenizer, capture, count)
    run = prepare_run(cfg, target_dir, tokenizer, corpus, features)
    schedule = Schedule.of(cfg, run)
    return save_drafter(cfg, run, schedule, train_steps(cfg, run, schedule))


@dataclass
class Run:
    """What a training run trains, on what: the drafter and the samples with the target's
    views of them, split into training and held-out prompts."""

    trainee: Trainee
    samples: list[Sample]
    views: TargetViews
    train: list[int]
    held: list[int]
    frequent: torch.Tensor  # the draft vocabulary (EAGLE-3) or the token map written beside
    device: torch.device


def prepare_run(
    cfg: TrainDraftConfig,
    target_dir: Path,
    tokenizer: Tokenizer,
    corpus: Corpus,
    features: tuple[tuple[int, ...], bool],
) -> Run:
    samples = corpus.samples
    held, train = split_heldout(corpus.prompts, cfg.heldout, cfg.seed)
    device = resolve_device(cfg.device)
    target = load_model(target_dir, device, torch.float32).requires_grad_(False)
    choices = Path(cfg.out) / "data" / "choices.pt"
    views = TargetViews(target, samples, corpus.captures, corpus.greedy, *features, choices)
    init = load_init(cfg, target) if cfg.init else None
    frequent = None if cfg.reselect_vocab else kept_vocab(cfg, init, target.config.vocab_size)
    if frequent is None:
        frequent = draft_vocab(
            [samples[i] for i in train],
            [views.argmax[i] for i in train],
            cfg.draft_vocab_size,
            target.config.vocab_size,
        )
    if cfg.reselect_vocab and isinstance(init, EagleHead):  # `checked` made sure it is
        init = with_draft_vocab(init, frequent, target)
    if cfg.algorithm == "DFLASH":
        trainee = dflash_trainee(cfg, target, frequent, tokenizer, init)
    elif cfg.algorithm == "STANDALONE":
        trainee = student_trainee(cfg, target, frequent, target_dir, init)
    else:
        trainee = eagle_trainee(cfg, target, frequent, features, target_dir, init)
    trainee.module.to(device).train()
    return Run(trainee, samples, views, train, held, frequent, device)


@dataclass
class Schedule:
    """Steps: `main` over the training prompts (`--epochs`), then the on-policy stage's, up
    to `total`."""

    per_epoch: int
    main: int
    total: int
    batches: Callable[[int], list[list[int]]]  # an epoch's batches, shuffled by its number

    @classmethod
    def of(cls, cfg: TrainDraftConfig, run: Run) -> Schedule:
        @lru_cache(maxsize=1)
        def batches(epoch: int) -> list[list[int]]:
            return make_batches(run.samples, run.train, cfg.batch_tokens, cfg.seed + epoch)

        per_epoch = len(batches(0))
        main = max(1, int(per_epoch * cfg.epochs))
        return cls(per_epoch, main, main + int(per_epoch * cfg.on_policy_epochs), batches)

    def batch_at(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.per_epoch)
        return self.batches(epoch)[within]


@dataclass
class Progress:
    """Where training is: its step and held-out measures so far (what a checkpoint keeps
    beside the weights and the optimizer)."""

    step: int = 0
    history: list[dict[str, float]] = field(default_factory=list)

    def record(self, loss: float, acceptance: float) -> None:
        self.history.append(
            {"step": self.step, "heldout_loss": loss, "heldout_acceptance": acceptance}
        )
        log.info("step %d: held-out loss %.3f, acceptance length %.3f", self.step, loss, acceptance)


def load_checkpoint(
    cfg: TrainDraftConfig, run: Run, opt: torch.optim.Optimizer, total: int
) -> Progress:
    """Resume from `--out`'s train_state.pt, if there is one of these options."""
    path = Path(cfg.out) / "train_state.pt"
    if not path.exists():
        return Progress()
    state = torch.load(path, map_location=run.device, weights_only=False)
    if _run_options(state["config"]) != _run_options(asdict(cfg)):
        raise ValueError(f"{path} was written with other options; remove it to start over")
    run.trainee.module.load_state_dict(state["head"])
    opt.load_state_dict(state["optimizer"])
    log.info("resuming at step %d of %d", state["step"], total)
    return Progress(state["step"], state["history"])


def _run_options(options: dict[str, Any]) -> dict[str, Any]:
    """What a resumed run must share with its checkpoint's: not its time limit or device,
    and of `--init` only the drafter's name (the folder may have moved)."""
    init = options["init"] and Path(options["init"]).name
    return {k: v for k, v in options.items() if k not in ("minutes", "device")} | {"init": init}


def save_checkpoint(
    cfg: TrainDraftConfig, run: Run, opt: torch.optim.Optimizer, progress: Progress
) -> None:
    state = {
        "config": asdict(cfg),
        "head": run.trainee.module.state_dict(),
        "optimizer": opt.state_dict(),
        "step": progress.step,
        "history": progress.history,
    }
    torch.save(state, Path(cfg.out) / "train_state.pt")


def train_steps(cfg: TrainDraftConfig, run: Run, schedule: Schedule) -> Progress:
    """Train until the schedule ends or `--minutes` pass, checkpointing on the way."""
    module = run.trainee.module
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    progress = load_checkpoint(cfg, run, opt, schedule.total)
    held_batches = make_batches(run.samples, run.held, cfg.batch_tokens, cfg.seed)
    held_loss, held_acc = evaluate(run, held_batches)
    if progress.history:
        log.info("held-out at step %d: acceptance length %.3f", progress.step, held_acc)
    else:
        progress.record(held_loss, held_acc)
    generator = torch.Generator(run.device).manual_seed(cfg.seed + progress.step)
    started = time.monotonic()
    bar = tqdm(
        total=schedule.total, initial=progress.step, desc=f"train {cfg.algorithm}", unit="step"
    )
    while progress.step < schedule.total:
        loss = train_step(
            cfg, run, schedule, opt, progress.step, Roots(cfg.root_fraction, generator)
        )
        progress.step += 1
        if progress.step > schedule.main:
            bar.set_description(f"on-policy {cfg.algorithm}")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", heldout_acc=f"{held_acc:.2f}")
        step = progress.step
        timed_out = cfg.minutes is not None and time.monotonic() - started > cfg.minutes * 60
        if step % cfg.eval_every == 0 or step in (schedule.main, schedule.total) or timed_out:
            held_loss, held_acc = evaluate(run, held_batches)
            progress.record(held_loss, held_acc)
        if step % cfg.save_every == 0 or step == schedule.total or timed_out:
            save_checkpoint(cfg, run, opt, progress)
        if timed_out:
            log.info("--minutes %s reached at step %d of %d", cfg.minutes, step, schedule.total)
            break
    bar.close()
    return progress


def train_step(
    cfg: TrainDraftConfig,
    run: Run,
    schedule: Schedule,
    opt: torch.optim.Optimizer,
    step: int,
    roots: Roots,
) -> float:
    """One optimizer step; past the main stage, on-policy (roots where the drafter's own
    chains end) at the end learning rate, a tenth of the peak."""
    for group in opt.param_groups:
        group["lr"] = lr_at(step, schedule.main, cfg.lr)
    batch = collate(run.samples, run.views, schedule.batch_at(step), run.device)
    if step >= schedule.main:
        roots.preference = chain_preference(run.trainee, batch)
    result = run.trainee.loss(batch, roots)
    opt.zero_grad(set_to_none=True)
    result.loss.backward()
    torch.nn.utils.clip_grad_norm_(run.trainee.module.parameters(), 0.5)
    opt.step()
    return result.loss.item()


def save_drafter(cfg: TrainDraftConfig, run: Run, schedule: Schedule, progress: Progress) -> Path:
    """The drafter in its serving layout under `--out`/head, with how it was trained."""
    head_dir = Path(cfg.out) / "head"
    run.trainee.save(head_dir)
    if cfg.algorithm != "EAGLE3":  # scoring only the frequent rows of the LM head drafts faster
        (head_dir / HOT_TOKENS).write_text(json.dumps(run.frequent.tolist()) + "\n")
    report = {
        "algorithm": cfg.algorithm,
        "options": asdict(cfg),
        "samples": len(run.samples),
        "train_tokens": sum(len(run.samples[i].ids) for i in run.train),
        "steps": progress.step,
        "total_steps": schedule.total,
        "on_policy_from_step": schedule.main,
        "history": progress.history,
        "heldout_acceptance": progress.history[-1]["heldout_acceptance"],
    }
    (head_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return head_dir
