"""Pixtral's vision encoder: patch convolution, RMSNorm, 2D RoPE over patch rows and
columns, and pre-norm transformer blocks whose attention stays within each image.

Module names follow the checkpoint's (`vision_tower.*`), so the loader copies tensors as
they are. The images of one call go through as one flat sequence of patches `[P, D]`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from specmesh.shared.model.layers import RMSNorm
from specmesh.shared.model.rope import apply_rope
from specmesh.shared.model.vision_config import VisionConfig
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu}
NORM_EPS = 1e-5  # Pixtral's RMSNorms, fixed (not in the config)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (supported: {list(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def axial_rope(cfg: VisionConfig, grids: list[tuple[int, int]]) -> tuple[torch.Tensor, ...]:
    """cos and sin [P, 1, head_dim] (apply_rope's layout) for the patches of each (rows,
    cols) grid in row-major order: even frequencies turn with the row, odd with the column."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    rows = torch.cat([torch.arange(h).repeat_interleave(w) for h, w in grids]).float()
    cols = torch.cat([torch.arange(w).repeat(h) for h, w in grids]).float()
    half = torch.cat([rows[:, None] * inv_freq[0::2], cols[:, None] * inv_freq[1::2]], dim=-1)
    emb = torch.cat([half, half], dim=-1)  # [P, head_dim]
    sin = emb.sin()
    sin[:, : dim // 2].neg_()  # apply_rope rotates with one roll
    return emb.cos()[:, None], sin[:, None]


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """x [P, D]; mask [P, P], True where both patches are of one image."""
        shape = (-1, self.num_heads, self.head_dim)
        q = apply_rope(self.q_proj(x).view(shape), cos, sin)
        k = apply_rope(self.k_proj(x).view(shape), cos, sin)
        v = self.v_proj(x).view(shape)
        # [H, P, Dh] for SDPA; non-causal: every patch sees its whole image
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask
        )
        return self.o_proj(out.transpose(0, 1).reshape(x.shape))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        d, ffn = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.attention = VisionAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.feed_forward = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.num_layers))


class PixtralEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        p = cfg.patch_size
        self.patch_conv = nn.Conv2d(cfg.num_channels, cfg.hidden_size, p, stride=p, bias=False)
        self.ln_pre = RMSNorm(cfg.hidden_size, NORM_EPS)
        self.transformer = VisionTransformer(cfg)

    def forward(self, images: list[torch.Tensor]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """images: normalized [C, H, W] each, sides multiples of the patch. Returns the
        hidden state `feature_layer` selects for every patch [P, D], image after image,
        row-major, and each image's patch grid (rows, cols)."""
        patches = [self.patch_conv(image[None])[0] for image in images]  # [D, h, w] each
        grids = [(p.shape[1], p.shape[2]) for p in patches]
        x = self.ln_pre(torch.cat([p.flatten(1).T for p in patches]))  # [P, D]
        cos, sin = (t.to(x.device, x.dtype) for t in axial_rope(self.config, grids))
        # block-diagonal: a patch attends to the patches of its own image only
        mask = torch.block_diag(*(torch.ones(h * w, h * w, dtype=torch.bool) for h, w in grids))
        mask = mask.to(x.device)
        states = [x]  # the hidden states as transformers counts them: input, then each layer
        for layer in self.transformer.layers:
            states.append(layer(states[-1], cos, sin, mask))
        return states[self.config.feature_layer], grids
