"""DFLASH (z-lab's DFlash): a small draft model, conditioned on several target layers,
drafts a whole block of tokens in one forward pass.

Checkpoints load in z-lab's published layout (as SGLang and SpecForge read it):
config.json with `architectures: ["DFlashDraftModel"]`, `block_size` (the block it was
trained for), `dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers` and a
Qwen3 decoder shape (`num_hidden_layers` draft layers); tensors `fc` [H, K*H] (the K target
layers' outputs, concatenated -> H), `hidden_norm`, `norm` and per draft layer
`layers.{i}.*`, a Qwen3 decoder layer (q/k norms). No embedding and no LM head: the
target's.

The context is `hidden_norm(fc(features))` at the target positions before the root; every
draft layer projects it with its own k/v projections (k normed, rotated at its position)
into a K/V prefix and never runs anything else over it. The block [root, MASK x (B-1)] at
positions n .. n+B-1 (root at n) attends to that prefix and to all of itself, with no
causal mask; the output at block index k >= 1, through the target's LM head, is the draft
for position n+k. The target verifies the block as a chain.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from specmesh.shared.core.tree import DraftTree
from specmesh.shared.kvcache.block_manager import prefix_hashes
from specmesh.shared.model.config import ModelConfig
from specmesh.shared.model.layers import MLP, Linear, RMSNorm, pack_linears
from specmesh.shared.model.llama import LlamaForCausalLM
from specmesh.shared.model.loader import checkpoint_names, copy_into, split_fused
from specmesh.shared.model.quantize import quantize_drafter
from specmesh.shared.model.rope import apply_rope, rope_cos_sin
from specmesh.shared.speculative.config import SpeculativeConfig, trained_block_size
from specmesh.shared.speculative.drafter import DraftRequest, LocalDrafter
from specmesh.shared.speculative.standalone import load_token_map, packed_lm_head
from torch import nn

ARCHITECTURE = "DFlashDraftModel"
KV = tuple[torch.Tensor, torch.Tensor]  # K, V [..., C, KVH, D]
PREFIX_CONTEXT_BLOCKS = 512  # context blocks a drafter keeps for later requests' prefixes


def default_target_layers(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's default: draft layer count many target layers, spread from layer 1 to L-3."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = (num_target_layers - 4) / (num_draft_layers - 1)
    return tuple(round(1 + i * span) for i in range(num_draft_layers))


@dataclass(frozen=True)
class DFlashSpec:
    """What a DFlash checkpoint's config says, checked against its target."""

    config: ModelConfig  # the draft's decoder (num_layers: draft layers)
    block_size: int  # the block it was trained to draft
    mask_token_id: int
    target_layers: tuple[int, ...]  # target layers whose outputs make the context

    def to_hf(self, target: ModelConfig) -> dict:
        """config.json in z-lab's layout."""
        cfg = self.config
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layers),
            },
            "num_target_layers": target.num_layers,
            "num_hidden_layers": cfg.num_layers,
            "layer_types": ["full_attention"] * cfg.num_layers,
            **cfg.hf_shape(),
            "attention_bias": cfg.qkv_bias,
            "vocab_size": target.vocab_size,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }


def read_dflash_spec(path: Path, target: ModelConfig) -> DFlashSpec:
    """Check a DFlash checkpoint's config and tensor names against `target`; ValueError on
    one that does not fit (before any weight is read)."""
    where = f"the DFLASH draft at {path}"
    if not (path / "config.json").is_file():
        raise ValueError(f"{where} has no config.json")
    raw = json.loads((path / "config.json").read_text())
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(
            f"{where} is not a DFlash checkpoint (config architectures "
            f"{raw.get('architectures')}, expected [{ARCHITECTURE!r}])"
        )
    dflash = raw.get("dflash_config") or {}
    cfg = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"]})
    layers = tuple(
        int(i)
        for i in dflash.get("target_layer_ids")
        or default_target_layers(raw.get("num_target_layers", target.num_layers), cfg.num_layers)
    )
    block = trained_block_size(str(path))
    mask = dflash.get("mask_token_id")
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"{where} has hidden size {cfg.hidden_size}; the target's is {target.hidden_size}"
        )
    if raw.get("num_target_layers", target.num_layers) != target.num_layers or not all(
        0 <= i < target.num_layers for i in layers
    ):
        raise ValueError(
            f"{where} was made for a target of {raw.get('num_target_layers')} layers reading "
            f"layers {list(layers)}; this target has {target.num_layers}"
        )
    if kinds := {t for t in raw.get("layer_types") or [] if t != "full_attention"}:
        raise ValueError(f"{where} has {sorted(kinds)} layers; specmesh serves full attention")
    if not block or block < 2:
        raise ValueError(f"{where} gives no block_size >= 2 in its config")
    if mask is None or not 0 <= int(mask) < target.vocab_size:
        raise ValueError(
            f"{where} needs dflash_config.mask_token_id, an id below the target's vocabulary "
            f"({target.vocab_size}); got {mask}"
        )
    spec = DFlashSpec(cfg, block, int(mask), layers)
    _check_tensors(path, spec)
    return spec


def _check_tensors(path: Path, spec: DFlashSpec) -> None:
    names: dict[str, tuple[int, ...]] = {}
    for file in _files(path):
        with safe_open(file, "pt") as f:
            names |= {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    hidden = spec.config.hidden_size
    fc = (hidden, len(spec.target_layers) * hidden)
    wanted = ["fc.weight", "hidden_norm.weight", "norm.weight"] + [
        f"layers.{i}.{n}"
        for i in range(spec.config.num_layers)
        for n in ("self_attn.q_norm.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight")
    ]
    if missing := [n for n in wanted if n not in names]:
        raise ValueError(f"the DFLASH draft at {path} lacks {missing}")
    if names["fc.weight"] != fc:
        raise ValueError(
            f"the DFLASH draft at {path} has fc.weight {list(names['fc.weight'])}; reading "
            f"{len(spec.target_layers)} target layers of {hidden} needs {list(fc)}"
        )


def _files(path: Path) -> list[Path]:
    if files := sorted(path.glob("*.safetensors")):
        return files
    raise ValueError(f"the DFLASH draft at {path} holds no .safetensors file")


def fused_slices(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection -> (our fused parameter, row offset, rows). The query stays
    apart: the context is projected to keys and values only."""
    kv, ffn = cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return {
        "k_proj": ("kv_proj", 0, kv),
        "v_proj": ("kv_proj", kv, kv),
        "gate_proj": ("gate_up_proj", 0, ffn),
        "up_proj": ("gate_up_proj", ffn, ffn),
    }


class DFlashAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q, bias=cfg.qkv_bias)
        self.kv_proj = Linear(cfg.hidden_size, 2 * kv, bias=cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.qkv_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """x [T, H] -> K, V [T, KVH, D]: K normed, then rotated at its positions."""
        k, v = self.kv_proj(x).view(len(x), 2, self.num_kv_heads, self.head_dim).unbind(1)
        return apply_rope(self.k_norm(k), cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context: KV,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """x [G*N, H]: G groups of N block tokens; context K, V [G, C, KVH, D]; mask
        [G, N, C+N]: what each block token sees of its group's context, then of its block."""
        g, c = context[0].shape[:2]
        n = len(x) // g
        q = self.q_norm(self.q_proj(x).view(len(x), self.num_heads, self.head_dim))
        q = apply_rope(q, cos, sin).view(g, n, self.num_heads, -1).transpose(1, 2)
        k, v = self.keys_values(x, cos, sin)
        keys, values = (
            torch.cat([ctx, own.view(g, n, self.num_kv_heads, -1)], dim=1).transpose(1, 2)
            for ctx, own in zip(context, (k, v), strict=True)
        )  # [G, KVH, C+N, D]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask[:, None], enable_gqa=True
        )  # [G, NH, N, D]
        return self.o_proj(out.transpose(1, 2).reshape(len(x), -1))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KV, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    def __init__(self, spec: DFlashSpec) -> None:
        super().__init__()
        cfg = self.config = spec.config
        self.spec = spec
        hidden = cfg.hidden_size
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_layers))
        self.fc = Linear(len(spec.target_layers) * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)
        cos, sin = rope_cos_sin(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_scaling
        )
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def context(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Target features [C, K*H] at `positions` [C] -> per draft layer K, V [C, KVH, D]."""
        ctx = self.hidden_norm(self.fc(features))
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        context: list[KV],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Block token embeddings [G*N, H] at `positions` [G*N] over per-layer context
        K, V [G, C, KVH, D] with `mask` [G, N, C+N] -> normed hidden states [G*N, H]."""
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        x = embeds
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, cos, sin, kv, mask)
        return self.norm(x)


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in _files(path):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                yield name.removeprefix("model."), f.get_tensor(name)


def load_dflash(path: Path, target: ModelConfig) -> DFlashDraft:
    spec = read_dflash_spec(path, target)
    draft = DFlashDraft(spec)
    params, fused = dict(draft.named_parameters()), fused_slices(spec.config)
    seen = set()
    for name, tensor in _checkpoint_tensors(path):
        if "rotary_emb" in name:
            continue
        copy_into(params, fused, name, tensor)
        seen.add(name)
    missing = [c for n in params for c in checkpoint_names(n, fused) if c not in seen]
    if missing:
        raise ValueError(f"the DFLASH draft at {path} lacks {missing}")
    return draft


def save_dflash(draft: DFlashDraft, path: Path, target: ModelConfig) -> None:
    """`draft` in z-lab's layout, bf16: `model.safetensors` and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    fused = fused_slices(draft.config)
    tensors = {
        part: value.to(torch.bfloat16).contiguous()
        for name, tensor in draft.state_dict().items()
        for part, value in split_fused(name, tensor, fused)
    }
    save_file(tensors, path / "model.safetensors")
    config = draft.spec.to_hf(target)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[G, longest, ...], zero-padded (one tensor: a view, no copy)."""
    if len(tensors) == 1:
        return tensors[0][None]
    return nn.utils.rnn.pad_sequence(tensors, batch_first=True)


class PrefixContexts:
    """Draft layers' K/V of whole blocks of target positions, kept across requests under
    their tokens' chained block hash (a position's entry depends on every token up to it),
    the newest `capacity` blocks. Where the target served a prompt's prefix from its cache
    and sent no features for it, a request takes that prefix's context from here."""

    block_size = 16  # positions per kept block

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, list[KV]] = OrderedDict()

    def lookup(self, tokens: list[int], end: int) -> list[KV] | None:
        """Each layer's K/V of positions 0 .. end - 1, if every block of them is held."""
        blocks = -(-end // self.block_size)
        hashes = prefix_hashes(tokens[: blocks * self.block_size], self.block_size)
        if len(hashes) < blocks or not all(h in self.blocks for h in hashes):
            return None
        for h in hashes:
            self.blocks.move_to_end(h)
        held = [self.blocks[h] for h in hashes]
        return [
            (torch.cat([b[i][0] for b in held])[:end], torch.cat([b[i][1] for b in held])[:end])
            for i in range(len(held[0]))
        ]

    def store(self, tokens: list[int], layers: list[KV], start: int, end: int) -> None:
        """Keep the blocks that positions start .. end - 1 completed (`layers` hold the
        K/V of positions 0 .. end - 1)."""
        bs = self.block_size
        first, last = start // bs, end // bs
        if first == last:  # no block completed: most decode steps
            return
        for b, h in enumerate(prefix_hashes(tokens[: last * bs], bs)[first:], start=first):
            if h not in self.blocks:
                rows = slice(b * bs, (b + 1) * bs)
                self.blocks[h] = [(k[rows].clone(), v[rows].clone()) for k, v in layers]
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


@dataclass
class _Context:
    """One request's draft context: per draft layer K, V [C, KVH, D] of target positions
    `end - C .. end - 1`."""

    layers: list[KV] = field(default_factory=list)
    end: int = -1  # the next target position due (-1: no features yet)


class DFlashDrafter(LocalDrafter):
    def __init__(self, cfg: SpeculativeConfig, target: LlamaForCausalLM) -> None:
        weight = target.embed_tokens.weight
        device = weight.device
        self.target = target
        self.quantization = cfg.speculative_draft_model_quantization
        self.draft = self._loaded(Path(cfg.speculative_draft_model_path))
        spec = self.draft.spec
        self.block_size = cfg.speculative_num_draft_tokens  # at most spec's (resolved() checks)
        self.window = cfg.speculative_dflash_draft_window_size
        self.target_features = (spec.target_layers, False)
        # FR-Spec: score only the listed rows of the target's LM head.
        self.vocab_ids: torch.Tensor | None = None
        self.lm_rows: Linear | None = None
        if cfg.speculative_token_map:
            self.vocab_ids = load_token_map(cfg.speculative_token_map, weight.shape[0]).to(device)
            self.lm_rows = packed_lm_head(target.lm_head.weight[self.vocab_ids])
        self.tokens: dict[str, list[int]] = {}
        self.contexts: dict[str, _Context] = {}
        # A window keeps no prefix whole, so nothing to share.
        self.prefixes = None if self.window else PrefixContexts(PREFIX_CONTEXT_BLOCKS)

    def _loaded(self, path: Path) -> DFlashDraft:
        weight = self.target.embed_tokens.weight
        draft = load_dflash(path, self.target.config).to(weight.device, weight.dtype).eval()
        quantize_drafter(draft, self.quantization)
        pack_linears(draft)
        return draft

    def prepared(self, path: Path) -> DFlashDraft:
        """The draft at `path`, loaded and checked to take this one's place (any thread);
        ValueError if it does not fit the target, the features the pool sends or its
        block."""
        draft = self._loaded(path)
        if (draft.spec.target_layers, False) != self.target_features:
            raise ValueError(
                f"it reads target layers {list(draft.spec.target_layers)}, this drafter "
                f"{list(self.target_features[0])}"
            )
        if draft.spec.block_size < self.block_size:
            raise ValueError(
                f"it was trained for blocks of {draft.spec.block_size}; this drafter drafts "
                f"{self.block_size}"
            )
        return draft

    def use(self, draft: DFlashDraft) -> None:
        """Draft with `draft` (from `prepared`) from the next call on, on the thread that
        drafts. Every context the old draft's layers projected is dropped: an open request
        drafts again once its next features are projected by the new one (from there on,
        or whole where a later request stored its prefix), and no prefix is kept."""
        self.draft = draft
        self.contexts = {request_id: _Context() for request_id in self.contexts}
        if self.prefixes:
            self.prefixes = PrefixContexts(PREFIX_CONTEXT_BLOCKS)

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.tokens[request_id] = list(prompt_ids)
        self.contexts[request_id] = _Context()

    def close(self, request_id: str) -> None:
        del self.tokens[request_id], self.contexts[request_id]

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree]:
        drafting = []
        for r in requests:
            tokens = self.tokens[r.request_id]
            tokens.extend(r.new_tokens)
            if r.features is not None:
                self._extend(r.request_id, r.features, r.feature_position)
            # Drafts need the context up to the root's parent, the position before the root.
            if r.max_drafts >= 1 and self.contexts[r.request_id].end == len(tokens) - 1:
                drafting.append(r)
        drafts = dict(zip((r.request_id for r in drafting), self._draft(drafting), strict=True))
        return [
            DraftTree.chain(self.tokens[r.request_id][-1], drafts.get(r.request_id, []))
            for r in requests
        ]

    def _extend(self, request_id: str, features: torch.Tensor, start: int) -> None:
        """Add the context of target positions `start ..` (features [n, K*H])."""
        ctx, tokens = self.contexts[request_id], self.tokens[request_id]
        if not ctx.layers and start and self.prefixes:  # the target began after a prefix
            ctx.layers = self.prefixes.lookup(tokens, start) or []
        weight = self.target.embed_tokens.weight
        positions = torch.arange(start, start + len(features), device=weight.device)
        new = self.draft.context(features.to(weight.device, weight.dtype), positions)
        if ctx.layers:
            new = [
                (torch.cat([old[0], kv[0]]), torch.cat([old[1], kv[1]]))
                for old, kv in zip(ctx.layers, new, strict=True)
            ]
        if self.window:
            new = [(k[-self.window :], v[-self.window :]) for k, v in new]
        ctx.layers, ctx.end = new, start + len(features)
        if self.prefixes and len(new[0][0]) == ctx.end:  # the whole context, from position 0
            self.prefixes.store(tokens, new, start, ctx.end)

    def _draft(self, requests: list[DraftRequest]) -> list[list[int]]:
        """One forward over every request's block -> each one's drafted chain."""
        if not requests:
            return []
        weight = self.target.embed_tokens.weight
        g, n = len(requests), self.block_size
        block = torch.full((g, n), self.draft.spec.mask_token_id, device=weight.device)
        block[:, 0] = torch.tensor([self.tokens[r.request_id][-1] for r in requests])
        first = torch.tensor([len(self.tokens[r.request_id]) - 1 for r in requests])
        positions = (first[:, None] + torch.arange(n)).to(weight.device).flatten()
        contexts = [self.contexts[r.request_id].layers for r in requests]
        lengths = torch.tensor([len(c[0][0]) for c in contexts])
        layers = [
            tuple(_stacked([c[i][j] for c in contexts]) for j in range(2))
            for i in range(len(self.draft.layers))
        ]
        # [G, N, C+N]: a group's own context entries, and all of its block
        columns = torch.arange(int(lengths.max()) + n)
        mask = (columns < lengths[:, None]) | (columns >= int(lengths.max()))
        mask = mask[:, None].expand(g, n, -1).to(weight.device)
        hidden = self.draft(weight[block.flatten()], positions, layers, mask)
        hidden = hidden.view(g, n, -1)[:, 1:].reshape(g * (n - 1), -1)
        score = self.target.compute_logits if self.lm_rows is None else self.lm_rows
        ids = score(hidden).argmax(-1)
        if self.vocab_ids is not None:
            ids = self.vocab_ids[ids]
        chains = ids.view(g, n - 1).tolist()
        return [chain[: r.max_drafts] for chain, r in zip(chains, requests, strict=True)]
