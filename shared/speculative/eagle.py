"""EAGLE and EAGLE-3 drafting: a one-layer head that reads the target's hidden states.

Checkpoints load in their published layouts (config.json plus model.safetensors
or pytorch_model.bin):
- EAGLE: `fc` ([token embedding; target feature] -> hidden, with bias), one decoder
  layer `layers.0.*` without an input norm; logits come from the target's LM head.
  The feature is the target's final normed hidden state.
- EAGLE-3: `fc` (three target layers' outputs, concatenated -> hidden), `midlayer.*`
  whose attention reads [input_layernorm(embedding); hidden_norm(feature)], `norm`,
  its own `lm_head` over a reduced draft vocabulary, and `d2t` (target id = draft id
  + d2t[draft id]). The features are the outputs of target layers 1, L/2-1 and L-4.
- NEXTN (MTP, DeepSeek-V3's layout): the target's extra layer `model.layers.{L}.*` (L =
  num_hidden_layers) in the target's own checkpoint, or in a directory holding it alone:
  `eh_proj` ([enorm(token embedding); hnorm(feature)] -> hidden), a full decoder layer,
  and `shared_head.norm`; logits come from the target's LM head. The feature is the
  target's final normed hidden state; the layer is reapplied for every draft step.
  Qwen3-Next's `mtp.*` is the same layer under other names (`fc`, `pre_fc_norm_embedding`,
  `pre_fc_norm_hidden`, `layers.0.*`, `norm`), its decoder layer a gated full-attention
  one with routed experts.
The head's entry i pairs token i+1 with the feature of position i. Drafting
feeds a node's own output back as its children's feature, and grows the tree
as STANDALONE does (top-k per step, cumulative scores, rerank).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from specmesh.shared.core.sequence import Sequence
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.kvcache.block_manager import BlockManager, block_hash
from specmesh.shared.kvcache.kv_cache import KVCache
from specmesh.shared.model.attention import SequenceSpan, TorchAttention
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.fused import FusedDecoder
from specmesh.shared.model.layers import MLP, Linear, RMSNorm, pack_linears
from specmesh.shared.model.llama import Attention, LlamaForCausalLM
from specmesh.shared.model.loader import (
    checkpoint_parts,
    copy_into,
    fused_slices,
    split_fused,
    wanted_names,
)
from specmesh.shared.model.moe import MoE
from specmesh.shared.model.quantize import quantize_drafter
from specmesh.shared.model.rope import rope_cos_sin
from specmesh.shared.speculative.config import SpeculativeConfig
from specmesh.shared.speculative.drafter import DraftRequest, LocalDrafter, target_feature_layers
from specmesh.shared.speculative.standalone import (
    DRAFT_PARAMS,
    TreeSearch,
    load_token_map,
    packed_lm_head,
)
from torch import nn


class EagleHead(nn.Module):
    def __init__(
        self, cfg: ModelConfig, algorithm: str, target_hidden: int, draft_vocab: int
    ) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.config = cfg
        self.eagle3 = algorithm == "EAGLE3"
        self.mtp = algorithm == "NEXTN"
        eagle3 = self.eagle3
        # EAGLE's fc, EAGLE-3's feature compressor, or NEXTN's eh_proj
        self.fc = Linear(
            3 * target_hidden if eagle3 else 2 * hidden, hidden, bias=algorithm == "EAGLE"
        )
        self.self_attn = Attention(cfg, TorchAttention(), 2 * hidden if eagle3 else None)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(0) else MLP(cfg)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        if eagle3 or self.mtp:
            self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.norm = RMSNorm(hidden, cfg.rms_norm_eps)  # NEXTN: shared_head.norm
        if self.mtp:
            self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        if eagle3:
            self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
            self.lm_head = Linear(hidden, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        cos, sin = rope_cos_sin(
            cfg.rope_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor:
        """EAGLE-3: the target id of each row of its draft vocabulary (d2t holds offsets)."""
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def project(self, target_features: torch.Tensor) -> torch.Tensor:
        """Target features into the head's input space (EAGLE-3 compresses three layers)."""
        return self.fc(target_features) if self.eagle3 else target_features

    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: object,
    ) -> torch.Tensor:
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        return self.decode(embeds, features, lambda x: self.self_attn(x, cos, sin, kv_cache, meta))

    def decode(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The layer over (token embedding, feature) pairs [T, H] -> [T, H]; `attend` is its
        attention over the layer input (paged when serving, unrolled over draft steps in
        training)."""
        x, residual = self.attention_input(embeds, features)
        h = residual + attend(x)
        h = h + self.mlp(self.post_attention_layernorm(h))
        # NEXTN feeds its normed output back as the next step's feature (SGLang's MTP).
        return self.norm(h) if self.mtp else h

    def attention_input(
        self, embeds: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's attention input and residual for (token embedding, feature) pairs."""
        if self.eagle3:
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
            return x, features
        if self.mtp:
            x = self.fc(torch.cat([self.enorm(embeds), self.hnorm(features)], dim=-1))
            return self.input_layernorm(x), x
        x = self.fc(torch.cat([embeds, features], dim=-1))
        return x, x

    def logits(self, hidden: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """Logits over the draft vocabulary (EAGLE-3's own head) or the target's (EAGLE,
        NEXTN: its output is already normed)."""
        return self.lm_logits(self.lm_input(hidden), target)

    def lm_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads of the layer's output: EAGLE-3 its final norm."""
        return self.norm(hidden) if self.eagle3 else hidden

    def lm_logits(self, x: torch.Tensor, target: LlamaForCausalLM) -> torch.Tensor:
        """The LM head over `lm_input`'s rows: EAGLE-3's own, else the target's."""
        return self.lm_head(x) if self.eagle3 else target.compute_logits(x)


def _weight_file(path: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).exists():
            return path / name
    raise ValueError(
        f"the draft head at {path} holds neither model.safetensors nor pytorch_model.bin"
    )


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    file = _weight_file(path)
    if file.suffix == ".safetensors":
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def _tensor_names(path: Path) -> set[str]:
    """Checkpoint tensor names, without reading the tensors where the format allows."""
    file = _weight_file(path)
    if file.suffix != ".safetensors":
        return set(_read_weights(path))
    with safe_open(file, "pt") as f:
        return set(f.keys())


@dataclass
class HeadSpec:
    """What a head checkpoint's config says, checked against the target it drafts for."""

    config: ModelConfig  # the head's one decoder layer
    draft_vocab: int
    target_features: tuple[tuple[int, ...], bool]  # as Drafter.target_features
    mtp_prefix: str = ""  # NEXTN: the checkpoint prefix of the MTP layer's tensors
    mtp_layout: str = "deepseek"  # NEXTN: which MTP_RENAMES apply


# NEXTN checkpoint names -> ours, per layout: DeepSeek-V3's (under
# model.layers.{num_hidden_layers}.) and Qwen3-Next's (under mtp.). DeepSeek's embedding and
# LM head are the target's, stored again beside the layer.
MTP_RENAMES = {
    "deepseek": {"eh_proj.": "fc.", "shared_head.norm.": "norm."},
    "qwen3_next": {
        "pre_fc_norm_embedding.": "enorm.",
        "pre_fc_norm_hidden.": "hnorm.",
        "layers.0.": "",
    },
}
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
MTP_WANTED = {
    "deepseek": (
        "eh_proj.weight",
        "enorm.weight",
        "hnorm.weight",
        "shared_head.norm.weight",
        "self_attn.o_proj.weight",
        "mlp.down_proj.weight",
    ),
    "qwen3_next": (
        "fc.weight",
        "pre_fc_norm_embedding.weight",
        "pre_fc_norm_hidden.weight",
        "norm.weight",
        "layers.0.self_attn.o_proj.weight",
    ),
}


def read_mtp_spec(path: Path, target: ModelConfig) -> HeadSpec:
    """Check the MTP layer a (target's or extracted) checkpoint carries against `target`."""
    where = f"NEXTN: the checkpoint at {path}"
    if not (path / "config.json").is_file():
        raise ValueError(f"{where} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    names = set()
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            names |= set(f.keys())
    layout, prefix = _mtp_layout(raw, names, where)
    # One full-attention layer of the checkpoint's kind (Qwen3-Next: gated, routed experts).
    one_layer = {"num_hidden_layers": 1, "layer_types": ["full_attention"], "mlp_only_layers": []}
    cfg = ModelConfig.from_hf({**raw, **one_layer})
    if cfg.hidden_size != target.hidden_size or cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"{where} has hidden size {cfg.hidden_size} and vocab {cfg.vocab_size}; "
            f"the target's are {target.hidden_size} and {target.vocab_size}"
        )
    if missing := [n for n in MTP_WANTED[layout] if prefix + n not in names]:
        raise ValueError(f"{where} lacks the MTP layer's {[prefix + n for n in missing]}")
    features = target_feature_layers("NEXTN", target.num_layers)
    return HeadSpec(cfg, target.vocab_size, features, prefix, layout)


def _mtp_layout(raw: dict, names: set[str], where: str) -> tuple[str, str]:
    """(layout, tensor prefix) of the MTP layer a checkpoint holds."""
    if "mtp.fc.weight" in names:
        return "qwen3_next", "mtp."
    if not raw.get("num_nextn_predict_layers"):
        raise ValueError(
            f"{where} has no MTP layers (config num_nextn_predict_layers is unset, no mtp.*); "
            "give --speculative-draft-model-path a checkpoint with them (specmesh train-draft "
            "--algorithm NEXTN makes one)"
        )
    prefix = f"model.layers.{raw['num_hidden_layers']}."
    if raw["num_hidden_layers"] == 1 and prefix + "eh_proj.weight" not in names:
        prefix = "model.layers.0."  # SGLang's extracted-layer checkpoints
    return "deepseek", prefix


def _renamed(name: str, renames: dict[str, str]) -> str:
    """`name` with the first matching prefix of `renames` replaced."""
    for old, new in renames.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    return name


def read_head_spec(path: Path, algo: str, target: ModelConfig) -> HeadSpec:
    """Read and check a head's config.json and tensor names; raise ValueError on a head that
    does not fit `target` (before any weight is read)."""
    if algo == "NEXTN":
        return read_mtp_spec(path, target)
    eagle3 = algo == "EAGLE3"
    if not (path / "config.json").is_file():
        raise ValueError(f"the draft head directory {path} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_hf(
        {**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    )
    target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
    if target_hidden != target.hidden_size or (not eagle3 and cfg.hidden_size != target_hidden):
        raise ValueError(
            f"the {algo} head at {path} reads hidden size {target_hidden}; "
            f"the target's is {target.hidden_size}"
        )
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"the {algo} head at {path} has vocab size {cfg.vocab_size}; "
            f"the target's is {target.vocab_size}"
        )
    layers, normed = target_feature_layers(algo, target.num_layers)
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if eagle3 and ids is not None:
        layers = tuple(int(i) for i in ids)
        if len(layers) != 3 or not all(0 <= i < target.num_layers for i in layers):
            raise ValueError(
                f"the EAGLE3 head at {path} reads target layers {list(layers)}; "
                f"the target has layers 0..{target.num_layers - 1}"
            )
    names = {n.removeprefix("midlayer.").removeprefix("layers.0.") for n in _tensor_names(path)}
    wanted = {"fc.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"}
    wanted |= {"norm.weight", "lm_head.weight", "d2t", "hidden_norm.weight"} if eagle3 else set()
    if missing := sorted(wanted - names):
        hint = " (is it an EAGLE head? EAGLE-3 heads carry midlayer.*, d2t and lm_head)"
        raise ValueError(f"the {algo} head at {path} lacks {missing}{hint if eagle3 else ''}")
    draft_vocab = raw.get("draft_vocab_size") or cfg.vocab_size
    return HeadSpec(cfg, draft_vocab, (layers, normed))


def _safetensors_files(path: Path) -> list[Path]:
    """The files of a safetensors checkpoint, sharded or not (NEXTN reads any of them)."""
    if files := sorted(path.glob("*.safetensors")):
        return files
    raise ValueError(f"NEXTN reads safetensors checkpoints; {path} holds none")


def _head_tensors(path: Path, spec: HeadSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """The head's checkpoint tensors under our names (NEXTN: the MTP layer's alone)."""
    if not spec.mtp_prefix:
        for name, tensor in _read_weights(path).items():
            yield name.removeprefix("midlayer.").removeprefix("layers.0."), tensor
        return
    for file in _safetensors_files(path):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                short = name.removeprefix(spec.mtp_prefix)
                if short != name and short not in MTP_SHARED:
                    yield _renamed(short, MTP_RENAMES[spec.mtp_layout]), f.get_tensor(name)


def load_head(
    path: Path, algo: str, target: LlamaForCausalLM
) -> tuple[EagleHead, HeadSpec, torch.Tensor | None]:
    """The head, its checked spec and, if the checkpoint brings one, its own embedding."""
    spec = read_head_spec(path, algo, target.config)
    head = EagleHead(spec.config, algo, target.config.hidden_size, spec.draft_vocab)
    fused = fused_slices(spec.config)
    params = dict(head.named_parameters())
    if head.eagle3:
        params["d2t"] = head.d2t
    embed, seen = None, set()
    for name, tensor in _head_tensors(path, spec):
        if name == "embed_tokens.weight":
            embed = tensor
            continue
        if name == "t2d" or (name == "input_layernorm.weight" and algo == "EAGLE"):
            continue  # t2d: the inverse map; EAGLE's layer 0 never applies its input norm
        for part, value in checkpoint_parts(spec.config, name, tensor):
            copy_into(params, fused, part, value)
            seen.add(part)
    missing = [
        c for n in params for c in wanted_names(n, spec.config, fused, seen) if c not in seen
    ]
    if missing:
        raise ValueError(f"the {algo} head at {path} lacks {missing}")
    return head, spec, embed


def save_head(head: EagleHead, path: Path, target: ModelConfig, spec: HeadSpec) -> None:
    """Write `head` in its published layout, bf16: EAGLE-3 as SpecForge exports it for
    SGLang (`midlayer.*`, `d2t`, `t2d`), EAGLE as `fc` + `layers.0.*` (NEXTN: `save_mtp`)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg, eagle3 = head.config, head.eagle3
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in head.state_dict().items():
        top = name.split(".")[0] in ("fc", "norm", "lm_head", "d2t")
        for part, value in split_fused(name, tensor, fused_slices(cfg)):
            key = part if top else ("midlayer." if eagle3 else "layers.0.") + part
            tensors[key] = value if name == "d2t" else value.to(torch.bfloat16)
    if eagle3:
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[head.draft_ids] = True
        tensors["t2d"] = t2d
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    layers, _ = spec.target_features
    config = {
        "architectures": ["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        **cfg.hf_shape(),
        "vocab_size": target.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if eagle3:
        config["draft_vocab_size"] = spec.draft_vocab
        config["target_hidden_size"] = target.hidden_size
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": list(layers),
            "use_aux_hidden_state": True,
        }
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_mtp(head: EagleHead, path: Path, target_config: dict) -> None:
    """The MTP layer as DeepSeek-V3 stores it, alone: tensors `model.layers.{L}.*` (L =
    the target's num_hidden_layers) and the target's config.json with
    num_nextn_predict_layers, so that NEXTN loads it as a draft path (and the tensors could
    join the target's own checkpoint)."""
    path.mkdir(parents=True, exist_ok=True)
    theirs = {ours: name for name, ours in MTP_RENAMES["deepseek"].items()}
    prefix = f"model.layers.{target_config['num_hidden_layers']}."
    tensors = {}
    for name, tensor in head.state_dict().items():
        for part, value in split_fused(name, tensor, fused_slices(head.config)):
            tensors[prefix + _renamed(part, theirs)] = value.to(torch.bfloat16).contiguous()
    save_file(tensors, path / "model.safetensors")
    config = {**target_config, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class EagleDrafter(LocalDrafter):
    def __init__(
        self,
        cfg: SpeculativeConfig,
        target: LlamaForCausalLM,
        kv_cache_gb: float = 0.05,
        block_size: int = 16,
    ) -> None:
        path = Path(cfg.speculative_draft_model_path)
        weight = target.embed_tokens.weight
        device, dtype = weight.device, weight.dtype
        self.algorithm, self.token_map = cfg.speculative_algorithm, cfg.speculative_token_map
        self.quantization = cfg.speculative_draft_model_quantization
        head, spec, embed = load_head(path, self.algorithm, target)
        self.head = head.to(device, dtype).eval()
        quantize_drafter(self.head, self.quantization)
        self.embed = embed.to(device, dtype) if embed is not None else weight
        self.target = target
        self.target_features = spec.target_features
        self._vocab(self.token_map)
        pack_linears(self.head)
        self.kv_cache = KVCache.for_memory(self.head.config, kv_cache_gb, block_size, device, dtype)
        self.fused = self._fused(self.head)
        self.blocks = BlockManager(self.kv_cache.num_blocks, block_size)
        self.num_steps = cfg.speculative_num_steps
        self.topk = cfg.speculative_eagle_topk
        self.head_version = 0  # in every cache salt: a swapped head reuses no K/V of the last
        # Per request: all its tokens; the head's sequence of pairs, the first of which is
        # at target position `offsets` (after any prefix the target served from cache);
        # projected features not yet in the head's KV.
        self.tokens: dict[str, list[int]] = {}
        self.offsets: dict[str, int] = {}
        self.seqs: dict[str, Sequence] = {}
        self.features: dict[str, list[torch.Tensor]] = {}

    def _vocab(self, token_map: str | None) -> None:
        """The rows of the LM head drafting scores (`lm_rows`, None: the head's own) and the
        target id of each (`vocab_ids`, None: the row index). EAGLE-3 scores its draft
        vocabulary; EAGLE the target's. A token map (FR-Spec) keeps only the listed ids."""
        head, device = self.head, self.embed.device
        self.vocab_ids: torch.Tensor | None = None
        self.lm_rows: Linear | None = None
        if head.eagle3:
            self.vocab_ids = head.draft_ids.to(device)
        if token_map is None:
            return
        listed = load_token_map(token_map, self.target.config.vocab_size).to(device)
        if head.eagle3:
            keep = torch.isin(self.vocab_ids, listed).nonzero()[:, 0]
            if len(keep) == 0:
                raise ValueError(
                    f"--speculative-token-map {token_map} keeps none of the head's draft vocabulary"
                )
            self.lm_rows = packed_lm_head(head.lm_head.weight[keep])
            self.vocab_ids = self.vocab_ids[keep]
        else:
            self.lm_rows = packed_lm_head(self.target.lm_head.weight[listed])
            self.vocab_ids = listed

    def prepared(self, path: Path) -> EagleHead:
        """The head at `path`, loaded and checked to take this one's place (any thread);
        ValueError if it does not fit the target or this drafter's cache and features."""
        head, spec, embed = load_head(path, self.algorithm, self.target)
        if embed is not None:
            raise ValueError("it brings its own token embedding; this drafter uses the target's")
        if spec.target_features != self.target_features:
            raise ValueError(
                f"it reads target layers {spec.target_features}, this drafter "
                f"{self.target_features}"
            )
        if head.config.hf_shape() != self.head.config.hf_shape():
            raise ValueError(
                f"its layer is shaped {head.config.hf_shape()}, this drafter's "
                f"{self.head.config.hf_shape()}"
            )
        weight = self.target.embed_tokens.weight
        head = head.to(weight.device, weight.dtype).eval()
        quantize_drafter(head, self.quantization)
        pack_linears(head)
        return head

    def use(self, head: EagleHead) -> None:
        """Draft with `head` (from `prepared`) from the next call on: on the thread that
        drafts, so no step sees half of it. The cache keeps the old head's entries for the
        requests in flight (they only cost acceptance until those requests end); no later
        request reuses them."""
        self.head = head
        self.fused = self._fused(head)
        self.head_version += 1
        self._vocab(self.token_map)

    def _fused(self, head: EagleHead) -> FusedDecoder | None:
        """An EAGLE-3 head's layer in the C++ decoder, where it applies (one call per draft
        step instead of a dozen torch ops)."""
        return FusedDecoder.eagle3(head, self.kv_cache.layers, self.embed) if head.eagle3 else None

    def _logits(self, lm_input: torch.Tensor) -> torch.Tensor:
        """Drafting logits of the LM head's input rows (`EagleHead.lm_input`)."""
        if self.lm_rows is None:
            return self.head.lm_logits(lm_input, self.target)
        return self.lm_rows(lm_input)

    def _forward(
        self,
        spans: list[SequenceSpan],
        ids: list[int],
        features: torch.Tensor,
        positions: list[int],
        rows: list[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over a step's (token id, feature [T, H]) pairs: its output at `rows`
        ([R, H], the feature fed to their children) and their logits [R, draft vocab]."""
        block_size = self.kv_cache.block_size
        if self.fused is not None:
            normed, out, _ = self.fused.forward(
                ids, positions, spans, block_size, rows, features=features
            )
            return out, self._logits(normed)  # the fused layer's final norm: EAGLE-3's
        device = self.embed.device
        embeds = self.embed[torch.tensor(ids, device=device)]
        pos, out_rows = (torch.tensor(v, device=device) for v in (positions, rows))
        meta = self.head.self_attn.backend.prepare(spans, block_size, device)
        out = self.head(embeds, features, pos, self.kv_cache.layers[0], meta)[out_rows]
        return out, self._logits(self.head.lm_input(out))

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.tokens[request_id] = list(prompt_ids)
        self.seqs[request_id] = Sequence(request_id, [], DRAFT_PARAMS)
        self.features[request_id] = []
        self.offsets[request_id] = 0

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id)
        if seq.block_table:
            self.blocks.free(seq)
        del self.tokens[request_id], self.features[request_id], self.offsets[request_id]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        searches: list[TreeSearch | None] = []
        for r in requests:
            tokens = self.tokens[r.request_id]
            tokens.extend(r.new_tokens)
            if r.features is not None:
                if not self.seqs[r.request_id].token_ids and not self.features[r.request_id]:
                    self.offsets[r.request_id] = r.feature_position
                self.features[r.request_id].append(self.head.project(r.features))
            searches.append(self._prepare(r))
        active = [s for s in searches if s is not None]
        steps = max((min(self.num_steps, s.budget) for s in active), default=0)
        for step in range(steps):
            self._expand(active, catch_up=step == 0)
        return [
            s.tree() if s is not None else DraftTree([self.tokens[r.request_id][-1]], [-1])
            for s, r in zip(searches, requests, strict=True)
        ]

    def _prepare(self, r: DraftRequest) -> TreeSearch | None:
        seq, tokens = self.seqs[r.request_id], self.tokens[r.request_id]
        offset = self.offsets[r.request_id]
        known = sum(len(f) for f in self.features[r.request_id]) + seq.num_computed_tokens
        # Pairs (token p+1, feature p) for every feature known; the last pair is the root's.
        seq.token_ids.extend(tokens[offset + len(seq) + 1 : offset + known + 1])
        if r.max_drafts < 1 or not seq.token_ids or offset + len(seq) != len(tokens) - 1:
            return None
        extra = self.num_steps * self.topk
        if not seq.block_table:
            seq = self._allocate(r.request_id, extra)
            if seq is None:
                return None
        if not self.blocks.can_grow(seq, extra):
            return None
        self.blocks.ensure_capacity(seq, extra)
        return TreeSearch(seq, r.max_drafts, [tokens[-1]])

    def _allocate(self, request_id: str, reserve: int) -> Sequence | None:
        """Blocks for a request's pairs, the leading ones from the prefix cache where it
        holds them. Where the target began after a prefix it had cached (offset > 0), the
        pairs of that prefix are looked up too: found, the head drafts with its whole
        context instead of the part after the prefix."""
        seq, offset = self.seqs[request_id], self.offsets[request_id]
        seq.cache_salt = self._context_salt(request_id, offset)
        first = 0  # the pair the pending features begin at
        if offset:
            pairs = self.tokens[request_id][1 : offset + len(seq) + 1]
            whole = Sequence(request_id, pairs, DRAFT_PARAMS)
            whole.cache_salt = self._context_salt(request_id, 0)
            held = self.blocks.num_cached_blocks(whole) * self.blocks.block_size
            if held >= offset and self.blocks.can_allocate(whole, reserve=reserve):
                seq, first = whole, offset
                self.seqs[request_id], self.offsets[request_id] = whole, 0
        if not self.blocks.can_allocate(seq, reserve=reserve):
            return None
        self.blocks.allocate(seq)
        if seq.num_computed_tokens > first:  # the cache holds pairs of pending features
            pending = torch.cat(self.features[request_id])
            self.features[request_id] = [pending[seq.num_computed_tokens - first :]]
        return seq

    def _context_salt(self, request_id: str, offset: int) -> bytes:
        """What the K/V of pairs from target position `offset` on depends on besides their
        own tokens: the tokens before them and the head."""
        context = self.tokens[request_id][: offset + 1] + [self.head_version]
        return block_hash(context, None).to_bytes(8, "little")

    def _expand(self, searches: list[TreeSearch], catch_up: bool) -> None:
        spans, ids, feats, positions, rows = [], [], [], [], []
        for s in searches:
            seq, first_row = s.seq, len(ids)
            offset = self.offsets[seq.request_id]
            if catch_up:  # pairs the head has not seen, ending with the root's
                start = seq.num_computed_tokens
                pending = self.features[seq.request_id]
                feats.append(torch.cat(pending))
                pending.clear()
                ids += seq.token_ids[start:]
                spans.append(SequenceSpan(seq.block_table, start, len(seq) - start))
                positions += range(offset + start, offset + len(seq))
                rows.append(len(ids) - 1)
            else:  # expanded nodes, each fed its parent's output as its feature
                ids += [s.tokens[i] for i in s.expanded]
                feats.append(torch.stack([s.hidden[s.parents[i]] for i in s.expanded]))
                mask = s.expanded_mask()
                spans.append(SequenceSpan(seq.block_table, len(seq), len(s.expanded), mask))
                positions += [offset + len(seq) - 1 + s.depths[i] for i in s.expanded]
                rows += [first_row + s.expanded.index(f) for f in s.frontier]
        out, logits = self._forward(spans, ids, torch.cat(feats), positions, rows)
        top_lp, top_ids = torch.log_softmax(logits.float(), dim=-1).topk(self.topk)
        if self.vocab_ids is not None:
            top_ids = self.vocab_ids[top_ids]
        row = 0
        for s in searches:
            if catch_up:
                computed_before, s.seq.num_computed_tokens = s.seq.num_computed_tokens, len(s.seq)
                self.blocks.seal(s.seq, computed_before)
            for j, node in enumerate(s.frontier):
                s.hidden[node] = out[row + j]
            n = len(s.frontier)
            s.grow(top_lp[row : row + n], top_ids[row : row + n])
            row += n
