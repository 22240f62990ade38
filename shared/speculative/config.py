"""Speculative decoding options, named and meant as SGLang's server arguments."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specmesh.shared.config import DEFAULT_MODEL_NAME, QUANTIZATIONS, QUANTIZED_AT_LOAD, option

ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN", "DFLASH")
ALIASES = {"MTP": "NEXTN"}  # SGLang's names for the same algorithm
# Drafters that grow one chain: a draft step's top-1 only (SGLang: topk 1).
CHAIN_ONLY = ("DFLASH",)
# Drafters a learner trains from served traffic (their weights swap while serving).
ONLINE_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "DFLASH", "STANDALONE")


def _drafters() -> Path | None:
    """The drafters trained here for the default model: the package `specmesh.drafters` (the
    repository's folder drafters/, its own distribution `specmesh-drafters`; each drafter's
    README.md says how it was made). None where it is not installed."""
    try:
        import specmesh.drafters
    except ModuleNotFoundError as exc:
        if exc.name != "specmesh.drafters":
            raise
        return None
    return Path(specmesh.drafters.__file__).parent


HEADS_DIR = _drafters()
SHIPPED = (
    {p.name for p in HEADS_DIR.glob("*") if (p / "config.json").is_file()} if HEADS_DIR else set()
)
DRAFTERS_MISSING = (
    f"the drafters trained for {DEFAULT_MODEL_NAME} are not installed: pip install "
    "specmesh-drafters (from the repository: pip install ./drafters), or give "
    "--speculative-draft-model-path"
)
# The token map `specmesh train-draft` writes beside EAGLE heads and MTP layers (FR-Spec:
# the ids the target chose most often in the training data).
HOT_TOKENS = "hot_tokens.json"


def trained_block_size(draft: str) -> int | None:
    """The block a DFLASH draft was trained for (its config.json `block_size`; None: no
    readable config, left to the drafter to report)."""
    try:
        raw = json.loads((Path(draft) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    size = raw.get("block_size") or (raw.get("dflash_config") or {}).get("block_size")
    return int(size) if isinstance(size, int) else None


def shipped_drafter(model: str | None, algorithm: str, missing_ok: bool = False) -> str | None:
    """The shipped drafter for `algorithm` if `model` is the default one (None means it), or
    None where none ships. Without specmesh-drafters installed: a ValueError that says how to
    install it (`missing_ok`: None)."""
    if model is not None and Path(model).name != DEFAULT_MODEL_NAME or algorithm == "NGRAM":
        return None
    if HEADS_DIR is None:
        if missing_ok:
            return None
        raise ValueError(DRAFTERS_MISSING)
    name = f"{DEFAULT_MODEL_NAME}-{algorithm}"
    return str(HEADS_DIR / name) if name in SHIPPED else None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Each field is also a command-line option (`--speculative-...`)."""

    speculative_algorithm: str | None = option(
        None,
        "speculative decoding algorithm (unset: off; MTP is NEXTN)",
        choices=(*ALGORITHMS, *ALIASES),
    )
    speculative_draft_model_path: str | None = option(
        None,
        "draft LM (STANDALONE), head (EAGLE, EAGLE3), MTP layer (NEXTN; unset: the "
        "target's own) or block draft (DFLASH); unset on the default model: the drafter "
        "trained for it that ships with specmesh",
        aliases=("--speculative-draft-model",),
    )
    speculative_draft_model_quantization: str | None = option(
        None,
        "as SGLang: the drafter's weight-only quantization, as --quantization's (EAGLE, "
        "EAGLE3, NEXTN, DFLASH: int8, int4, bf16 or fp8 made at load; STANDALONE: any; unset: "
        "full precision, or what the draft checkpoint declares)",
        choices=QUANTIZATIONS,
    )
    speculative_num_steps: int | None = option(None, "draft depth (unset: chosen automatically)")
    speculative_eagle_topk: int | None = option(None, "branching per draft step (1 = chain)")
    speculative_num_draft_tokens: int | None = option(
        None,
        "tokens verified per step, root included (topk=1: num_steps+1; DFLASH: the block "
        "drafted at once, default the draft's trained block size)",
        aliases=("--speculative-dflash-block-size",),
    )
    speculative_dflash_draft_window_size: int | None = option(
        None, "DFLASH: the most recent target positions the draft keeps as context (unset: all)"
    )
    speculative_accept_threshold_single: float = option(
        1.0, "accept a draft whose target probability reaches this (1 = exact sampling)"
    )
    speculative_accept_threshold_acc: float = option(
        1.0, "accept a draft with probability min(1, p / this) (1 = exact sampling)"
    )
    speculative_token_map: str | None = option(
        None,
        "FR-Spec: .pt or .json list of token ids the draft LM head keeps (every algorithm "
        "but NGRAM)",
    )
    speculative_ngram_min_bfs_breadth: int = option(1, "NGRAM: branching at the deepest level")
    speculative_ngram_max_bfs_breadth: int = option(8, "NGRAM: branching at the first level")
    speculative_ngram_match_type: str = option(
        "BFS", "NGRAM: BFS (recency) or PROB (frequency)", choices=("BFS", "PROB")
    )
    speculative_ngram_max_trie_depth: int = option(12, "NGRAM: longest n-gram remembered")
    speculative_ngram_capacity: int = option(1_000_000, "NGRAM: shared-trie nodes before reset")
    speculative_adaptive: bool = option(
        True, "choose each request's draft budget per step from its acceptance and measured costs"
    )
    speculative_online_learning: bool = option(
        False,
        "over the services (every algorithm but NGRAM): drafters send what they serve to a "
        "learner, which trains the draft model and publishes better versions; every drafter "
        "follows them",
    )

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    def resolved(self, model: str | None = None) -> SpeculativeConfig:
        """Validate, and fill what SGLang lets users leave unset: the tree shape options,
        and (for the default `model`) the draft head that ships with specmesh."""
        algo = self.speculative_algorithm
        if algo is None:
            return self
        algo = ALIASES.get(algo.upper(), algo.upper())
        if algo not in ALGORITHMS:
            raise ValueError(f"--speculative-algorithm must be one of {ALGORITHMS}, got {algo!r}")
        # the shipped drafter: the default, and its token map also where the path given is it
        shipped = shipped_drafter(model, algo, missing_ok=bool(self.speculative_draft_model_path))
        draft = self.speculative_draft_model_path or shipped
        token_map = self.speculative_token_map
        if token_map is None and shipped and draft == shipped:
            hot = Path(shipped) / HOT_TOKENS  # a shipped drafter drafts over its token map
            token_map = str(hot) if hot.is_file() else None
        if algo == "NEXTN" and not draft and model and Path(model).is_dir():
            draft = model  # the target's own MTP layers (checked when the drafter loads)
        if algo != "NGRAM" and not draft:
            raise ValueError(
                f"--speculative-algorithm {algo} needs --speculative-draft-model-path (specmesh "
                f"ships trained heads for {DEFAULT_MODEL_NAME} only: {sorted(SHIPPED)})"
            )
        if algo == "NGRAM" and self.speculative_draft_model_path:
            raise ValueError("NGRAM drafts from the context; it takes no draft model")
        if self.speculative_token_map and algo == "NGRAM":
            raise ValueError("--speculative-token-map restricts a draft LM head; NGRAM has none")
        self._check_draft_quantization(algo)
        if self.speculative_ngram_match_type.upper() not in ("BFS", "PROB"):
            raise ValueError("--speculative-ngram-match-type must be BFS or PROB")
        for name in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1]")
        steps, topk, tokens = (
            self.speculative_num_steps,
            self.speculative_eagle_topk,
            self.speculative_num_draft_tokens,
        )
        if algo == "DFLASH":
            steps, topk, tokens = self._dflash_shape(draft)
        elif steps is None and topk is None and tokens is None:
            # Verification is not flat on CPU, so the defaults stay small; NGRAM trees are
            # cheap to build and wider.
            steps, topk, tokens = {"NGRAM": (7, 1, 8), "NEXTN": (3, 1, 4)}.get(algo, (4, 1, 5))
        elif None in (steps, topk, tokens):
            steps = steps or 4
            topk = topk or 1
            tokens = tokens or (steps + 1 if topk == 1 else min(steps * topk, 16) + 1)
        if steps < 1 or topk < 1 or tokens < 2:
            raise ValueError("speculative num_steps and topk must be >= 1, num_draft_tokens >= 2")
        if algo in CHAIN_ONLY and topk != 1:
            raise ValueError(
                f"--speculative-algorithm {algo} drafts a chain: --speculative-eagle-topk must "
                f"be 1, got {topk}"
            )
        if topk == 1 and algo != "NGRAM" and tokens != steps + 1:
            raise ValueError(
                f"with --speculative-eagle-topk 1, --speculative-num-draft-tokens must be "
                f"num_steps + 1 = {steps + 1}, got {tokens}"
            )
        if tokens > steps * topk + 1 and algo != "NGRAM":
            raise ValueError(
                f"--speculative-num-draft-tokens {tokens} exceeds what {steps} steps of "
                f"topk {topk} can draft ({steps * topk + 1})"
            )
        if self.speculative_online_learning and algo not in ONLINE_ALGORITHMS:
            raise ValueError(
                f"--speculative-online-learning trains {', '.join(ONLINE_ALGORITHMS)} drafters, "
                f"not {algo}"
            )
        window = self.speculative_dflash_draft_window_size
        if window is not None and (algo != "DFLASH" or window < 1):
            raise ValueError("--speculative-dflash-draft-window-size is >= 1, for DFLASH only")
        values = {**self.__dict__}
        values.update(
            speculative_algorithm=algo,
            speculative_draft_model_path=draft,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens,
            speculative_token_map=token_map,
            speculative_ngram_match_type=self.speculative_ngram_match_type.upper(),
        )
        return SpeculativeConfig(**values)

    def _check_draft_quantization(self, algo: str) -> None:
        """Heads and block drafts are quantized from their loaded weights; only STANDALONE
        drafts load as the target does (a GGUF's or AWQ/GPTQ checkpoint's blocks too)."""
        quant = self.speculative_draft_model_quantization
        if quant is None or algo == "STANDALONE":
            return
        if algo == "NGRAM":
            raise ValueError("NGRAM drafts from the context; it has no draft model to quantize")
        if quant not in QUANTIZED_AT_LOAD:
            raise ValueError(
                f"--speculative-draft-model-quantization {quant}: {algo} drafters are "
                f"quantized at load ({', '.join(QUANTIZED_AT_LOAD)}); gguf, awq and gptq "
                f"checkpoints load as STANDALONE drafts only"
            )

    def _dflash_shape(self, draft: str) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens) of a DFLASH block: one chain of block - 1
        drafts, the block no larger than the draft was trained for."""
        steps, tokens = self.speculative_num_steps, self.speculative_num_draft_tokens
        trained = trained_block_size(draft)
        tokens = tokens or (steps + 1 if steps else trained or 16)
        if trained and tokens > trained:
            raise ValueError(
                f"--speculative-dflash-block-size {tokens} exceeds the block the DFLASH draft "
                f"at {draft} was trained for ({trained})"
            )
        return steps or tokens - 1, self.speculative_eagle_topk or 1, tokens
