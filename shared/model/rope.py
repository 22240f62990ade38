"""Rotary position embeddings, with the scaling types HF configs use."""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    # fp32 like the reference implementation, so long-context angles round the same way.
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, scaled)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def _yarn(
    inv_freq: torch.Tensor, s: dict[str, Any], head_dim: int, theta: float, max_pos: int
) -> tuple[torch.Tensor, float]:
    old_len = s.get("original_max_position_embeddings") or max_pos
    # DeepSeek-style configs leave factor out and give the ratio of the two lengths.
    factor = s.get("factor") or max_pos / old_len
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:
        return head_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if high == low:
        high += 0.001  # avoid a zero-width ramp, as the reference does
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)
    extrapolate = 1 - ramp.clamp(0, 1)
    inv = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    return inv, attention_factor


def rope_cos_sin(
    head_dim: int,
    theta: float,
    max_positions: int,
    scaling: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables [max_positions, 1, head_dim] of cos and sin (HF half-rotation layout), sin
    negated in its first half so that apply_rope rotates with one roll."""
    inv_freq = _inv_freq(head_dim, theta)
    mscale = 1.0
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq, mscale = _yarn(inv_freq, scaling, head_dim, theta, max_positions)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling type {kind!r}")
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq.float())
    emb = torch.cat([freqs, freqs], dim=-1)
    sin = emb.sin() * mscale
    sin[:, : head_dim // 2].neg_()
    return (emb.cos() * mscale)[:, None], sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, 1, head_dim] from rope_cos_sin, by position.
    x * cos + rotate_half(x) * sin, where rotate_half(x) = [-x2, x1] = roll(x) * sign."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
