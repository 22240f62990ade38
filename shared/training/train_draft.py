"""`specmesh train-draft`: data, target features, draft vocabulary, training, checkpoint.

Every stage keeps its result under `--out`, so a stopped run resumes: generated answers
(`data/self_distill.jsonl`), the training state (`train_state.pt`, every `--save-every`
steps) and the head itself, written in the published layout that
`--speculative-draft-model-path` loads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from shared.config import model_option, option, resolve_device
from shared.engine.engine import EngineConfig, LLMEngine
from shared.model.config import ModelConfig
from shared.model.fetch import resolve_model
from shared.model.llama import LlamaForCausalLM
from shared.model.loader import load_model, save_model
from shared.speculative.config import HOT_TOKENS
from shared.speculative.dflash import default_target_layers, save_dflash
from shared.speculative.drafter import target_feature_layers
from shared.speculative.eagle import EagleHead, HeadSpec, save_head, save_mtp
from shared.tokenizer import Tokenizer
from shared.training.data import (
    Sample,
    read_captured,
    read_local,
    read_samples,
    self_distill,
    self_written_prompts,
)
from shared.training.dflash_trainer import block_loss, mask_token_id, new_dflash
from shared.training.eagle_trainer import (
    Batch,
    StepResult,
    acceptance_length,
    collate,
    lr_at,
    make_batches,
    unrolled_loss,
)
from shared.training.features import TargetView, capture_layers, extract, from_capture
from shared.training.prompts import training_prompts
from shared.training.student_trainer import distill_loss, new_student

log = logging.getLogger(__name__)
TRAINABLE = ("EAGLE3", "EAGLE", "NEXTN", "DFLASH", "STANDALONE")


@dataclass
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
    temperature: float = option(
        0.0,
        "sampling temperature of self-distilled answers (0: greedy); sampled answers loop "
        "less and cover more of what the target says (SpecForge regenerates with sampling)",
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
    epochs: float = option(2.0, "passes over the training data")
    lr: float = option(5e-4, "peak learning rate (AdamW, warm-up then cosine)")
    batch_tokens: int = option(4096, "tokens per optimizer step")
    heldout: float = option(0.03, "fraction of samples kept apart to measure acceptance")
    eval_every: int = option(200, "optimizer steps between held-out evaluations")
    save_every: int = option(100, "optimizer steps between resumable checkpoints")
    minutes: float | None = option(None, "stop training after this many minutes")
    seed: int = option(0, "seed for prompt order, the held-out split, init and batches")
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")

    def checked(self) -> TrainDraftConfig:
        self.algorithm = self.algorithm.upper()
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
        if self.block_size < 2 or self.draft_layers < 1:
            raise ValueError("--block-size must be >= 2 and --draft-layers >= 1")
        if self.draft_hidden_size is not None and self.draft_hidden_size < 1:
            raise ValueError(f"--draft-hidden-size must be >= 1, got {self.draft_hidden_size}")
        if self.ttt_steps < 1 or self.epochs <= 0 or not 0 < self.heldout < 1:
            raise ValueError("--ttt-steps must be >= 1, --epochs > 0, --heldout in (0, 1)")
        if not 0 < self.root_fraction <= 1:
            raise ValueError("--root-fraction must be in (0, 1]")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        return self

    @property
    def data_files(self) -> list[Path]:
        return [Path(p) for p in (self.data or "").split(",") if p]


def read_prompt_list(path: Path) -> list[str]:
    try:
        prompts = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--exclude {path}: {exc}") from None
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"--exclude {path}: expected a JSON list of strings")
    return prompts


def gather_samples(
    cfg: TrainDraftConfig, target_dir: Path, tokenizer: Tokenizer, layers: tuple[int, ...]
) -> tuple[list[Sample], list[torch.Tensor | None]]:
    """Self-distilled answers (generated now, or resumed) plus local data, and per sample
    the target layers kept while it was generated (None: to be computed)."""
    local = [s for f in cfg.data_files for s in read_local(f, tokenizer, cfg.max_len)]
    data = Path(cfg.out) / "data"
    data.mkdir(parents=True, exist_ok=True)
    # Answers of another temperature are other data: each has its own file to resume.
    suffix = f"-t{cfg.temperature:g}" if cfg.temperature else ""
    work = data / f"self_distill{suffix}.jsonl"
    written = data / "self_prompts.json"
    builtin = training_prompts(cfg.seed)[: cfg.num_prompts]
    engine: LLMEngine | None = None
    if cfg.self_prompts and not written.exists():
        engine = _generator(cfg, target_dir)
        exclude = read_prompt_list(Path(cfg.exclude)) if cfg.exclude else []
        prompts = self_written_prompts(engine, tokenizer, cfg.self_prompts, exclude, cfg.seed)
        written.write_text(json.dumps(prompts, indent=0) + "\n")
    own = json.loads(written.read_text())[: cfg.self_prompts] if cfg.self_prompts else []
    prompts = builtin + own
    if prompts and len(read_samples(work)) < len(prompts):
        # a fresh engine: self_distill reads prompt rows from its prefix cache
        engine = _generator(cfg, target_dir)
        self_distill(
            engine, tokenizer, prompts, work, cfg.max_new_tokens, layers, cfg.temperature, cfg.seed
        )
    del engine
    distilled = read_samples(work)[: len(prompts)]
    captured = read_captured(work, layers, len(distilled)) + [None] * len(local)
    keep = [i for i, s in enumerate(distilled + local) if len(s.ids) >= 2 and s.spans]
    return [(distilled + local)[i] for i in keep], [captured[i] for i in keep]


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


def target_views(
    target: LlamaForCausalLM,
    samples: list[Sample],
    captured: list[torch.Tensor | None],
    layers: tuple[int, ...],
    normed: bool,
    greedy: bool,
) -> list[TargetView]:
    """Views from what generation kept (`greedy`: its answers were greedy); a
    teacher-forced pass for the rest."""
    missing = [i for i, c in enumerate(captured) if c is None]
    computed = dict(
        zip(
            missing,
            extract(target, [samples[i] for i in missing], layers, normed) if missing else [],
            strict=True,
        )
    )
    return [
        computed[i] if c is None else from_capture(target, samples[i], c, normed, greedy)
        for i, (s, c) in enumerate(zip(samples, captured, strict=True))
    ]


def draft_vocab(
    samples: list[Sample], views: list[TargetView], size: int, vocab: int
) -> torch.Tensor:
    """The `size` target ids most often chosen at learned positions, ascending (SpecForge's
    rule; padded with the lowest unused ids when fewer occur)."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for sample, view in zip(samples, views, strict=True):
        for start, end in sample.spans:
            counts += torch.bincount(view.argmax[max(start - 1, 0) : end - 1], minlength=vocab)
    top = counts.topk(min(size, vocab)).indices
    return top.sort().values


def new_head(
    target: LlamaForCausalLM, algorithm: str, draft_ids: torch.Tensor | None, seed: int
) -> tuple[EagleHead, ModelConfig]:
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
            head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
    return head, cfg


@dataclass
class Trainee:
    """What the training loop needs of a drafter: its module, its loss over a batch (with
    the fraction of positions used as drafting roots or anchors), and how it is saved."""

    module: torch.nn.Module
    loss: Callable[[Batch, float, torch.Generator | None], StepResult]
    save: Callable[[Path], None]


def eagle_trainee(
    cfg: TrainDraftConfig,
    target: LlamaForCausalLM,
    frequent: torch.Tensor,
    features: tuple[tuple[int, ...], bool],
    target_dir: Path,
) -> Trainee:
    """An EAGLE/EAGLE-3 head or NEXTN layer, trained unrolled over `ttt_steps` draft steps."""
    eagle3 = cfg.algorithm == "EAGLE3"
    draft_ids = frequent.to(target.lm_head.weight.device) if eagle3 else None
    head, hcfg = new_head(target, cfg.algorithm, draft_ids, cfg.seed)
    spec = HeadSpec(hcfg, len(frequent) if eagle3 else hcfg.vocab_size, features)

    def loss(batch: Batch, fraction: float, generator: torch.Generator | None) -> StepResult:
        return unrolled_loss(head, target, batch, cfg.ttt_steps, draft_ids, fraction, generator)

    def save(path: Path) -> None:
        if head.mtp:
            save_mtp(head.cpu().eval(), path, json.loads((target_dir / "config.json").read_text()))
        else:
            save_head(head.cpu().eval(), path, target.config, spec)

    return Trainee(head, loss, save)


def dflash_trainee(
    cfg: TrainDraftConfig, target: LlamaForCausalLM, frequent: torch.Tensor, tokenizer: Tokenizer
) -> Trainee:
    """A DFLASH block draft, scoring the frequent ids (its token map) in training."""
    mask = mask_token_id(tokenizer, target.config.vocab_size)
    draft = new_dflash(target, cfg.draft_layers, cfg.block_size, mask, cfg.seed)
    vocab_ids = frequent.to(target.lm_head.weight.device)

    def loss(batch: Batch, fraction: float, generator: torch.Generator | None) -> StepResult:
        return block_loss(draft, target, batch, vocab_ids, fraction, generator)

    return Trainee(draft, loss, lambda path: save_dflash(draft.cpu().eval(), path, target.config))


def student_trainee(
    cfg: TrainDraftConfig, target: LlamaForCausalLM, frequent: torch.Tensor, target_dir: Path
) -> Trainee:
    """A STANDALONE draft LM, distilled at every position over the frequent ids."""
    width = cfg.draft_hidden_size or target.config.hidden_size
    student = new_student(target, width, cfg.draft_layers)
    vocab_ids = frequent.to(target.lm_head.weight.device)

    def loss(batch: Batch, fraction: float, generator: torch.Generator | None) -> StepResult:
        return distill_loss(student, target, batch, vocab_ids, cfg.ttt_steps)

    def save(path: Path) -> None:
        save_model(student.cpu().eval(), path, json.loads((target_dir / "config.json").read_text()))

    return Trainee(student, loss, save)


@torch.no_grad()
def evaluate(
    trainee: Trainee,
    samples: list[Sample],
    views: list[TargetView],
    batches: list[list[int]],
    device: torch.device,
) -> tuple[float, float]:
    """Held-out (loss, acceptance length of greedy chain drafting)."""
    trainee.module.eval()
    losses, corrects, valids = [], [], []
    for idx in batches:
        r = trainee.loss(collate(samples, views, idx, device), 1.0, None)
        losses.append(r.loss.item())
        corrects.append(r.correct)
        valids.append(r.valid)
    trainee.module.train()
    return sum(losses) / max(1, len(losses)), acceptance_length(
        torch.cat(corrects), torch.cat(valids)
    )


def feature_layers(cfg: TrainDraftConfig, num_layers: int) -> tuple[tuple[int, ...], bool]:
    """The target layers the drafter reads, and whether the one is final-normed."""
    if cfg.algorithm == "DFLASH":
        return default_target_layers(num_layers, cfg.draft_layers), False
    return target_feature_layers(cfg.algorithm, num_layers)


def train_draft(cfg: TrainDraftConfig) -> Path:
    """Run every stage; returns the directory of the trained drafter."""
    cfg = cfg.checked()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    target_dir = resolve_model(cfg.target)
    tokenizer = Tokenizer(target_dir)
    num_layers = ModelConfig.from_file(target_dir / "config.json").num_layers
    layers, normed = feature_layers(cfg, num_layers)
    samples, captured = gather_samples(
        cfg, target_dir, tokenizer, capture_layers(layers, normed, num_layers)
    )
    if len(samples) < 2:
        raise ValueError("not enough training data: give --num-prompts > 1 or --data")
    target = load_model(target_dir, device, torch.float32).requires_grad_(False)
    views = target_views(target, samples, captured, layers, normed, cfg.temperature == 0)
    order = list(range(len(samples)))
    random.Random(cfg.seed).shuffle(order)
    n_held = max(1, int(len(samples) * cfg.heldout))
    held, train = order[:n_held], order[n_held:]
    # EAGLE-3's draft vocabulary; for the others the token map written beside the drafter.
    frequent = draft_vocab(
        [samples[i] for i in train],
        [views[i] for i in train],
        cfg.draft_vocab_size,
        target.config.vocab_size,
    )
    if cfg.algorithm == "DFLASH":
        trainee = dflash_trainee(cfg, target, frequent, tokenizer)
    elif cfg.algorithm == "STANDALONE":
        trainee = student_trainee(cfg, target, frequent, target_dir)
    else:
        trainee = eagle_trainee(cfg, target, frequent, (layers, normed), target_dir)
    module = trainee.module.to(device).train()

    train_batches = lambda epoch: make_batches(  # noqa: E731
        [samples[i] for i in train], [views[i] for i in train], cfg.batch_tokens, cfg.seed + epoch
    )
    held_batches = make_batches(
        [samples[i] for i in held], [views[i] for i in held], cfg.batch_tokens, cfg.seed
    )
    held_s, held_v = [samples[i] for i in held], [views[i] for i in held]
    train_s, train_v = [samples[i] for i in train], [views[i] for i in train]
    per_epoch = len(train_batches(0))
    total = max(1, int(per_epoch * cfg.epochs))
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state_path = out / "train_state.pt"
    step, history = 0, []
    if state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["config"] != asdict(cfg) | {"minutes": state["config"]["minutes"]}:
            raise ValueError(
                f"{state_path} was written with other options; remove it to start over"
            )
        module.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, history = state["step"], state["history"]
        log.info("resuming at step %d of %d", step, total)

    def save_state() -> None:
        torch.save(
            {
                "config": asdict(cfg),
                "head": module.state_dict(),
                "optimizer": opt.state_dict(),
                "step": step,
                "history": history,
            },
            state_path,
        )

    held_loss, held_acc = evaluate(trainee, held_s, held_v, held_batches, device)
    if not history:
        history.append({"step": 0, "heldout_loss": held_loss, "heldout_acceptance": held_acc})
    log.info("held-out at step %d: loss %.3f, acceptance length %.3f", step, held_loss, held_acc)
    generator = torch.Generator(device).manual_seed(cfg.seed + step)
    started = time.monotonic()
    bar = tqdm(total=total, initial=step, desc=f"train {cfg.algorithm}", unit="step")
    while step < total:
        epoch, within = divmod(step, per_epoch)
        idx = train_batches(epoch)[within]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, cfg.lr)
        result = trainee.loss(collate(train_s, train_v, idx, device), cfg.root_fraction, generator)
        opt.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 0.5)
        opt.step()
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss.item():.3f}", heldout_acc=f"{held_acc:.2f}")
        timed_out = cfg.minutes is not None and time.monotonic() - started > cfg.minutes * 60
        if step % cfg.eval_every == 0 or step == total or timed_out:
            held_loss, held_acc = evaluate(trainee, held_s, held_v, held_batches, device)
            history.append(
                {"step": step, "heldout_loss": held_loss, "heldout_acceptance": held_acc}
            )
            log.info(
                "step %d: held-out loss %.3f, acceptance length %.3f", step, held_loss, held_acc
            )
        if step % cfg.save_every == 0 or step == total or timed_out:
            save_state()
        if timed_out:
            log.info("--minutes %s reached at step %d of %d", cfg.minutes, step, total)
            break
    bar.close()
    head_dir = out / "head"
    trainee.save(head_dir)
    if cfg.algorithm != "EAGLE3":  # scoring only the frequent rows of the LM head drafts faster
        (head_dir / HOT_TOKENS).write_text(json.dumps(frequent.tolist()) + "\n")
    report = {
        "algorithm": cfg.algorithm,
        "options": asdict(cfg),
        "samples": len(samples),
        "train_tokens": sum(len(s.ids) for s in train_s),
        "steps": step,
        "total_steps": total,
        "history": history,
        "heldout_acceptance": history[-1]["heldout_acceptance"],
    }
    (head_dir / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return head_dir
