"""Settings of Mistral3's image path (Pixtral encoder and projector) from config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    patch_size: int
    rope_theta: float
    hidden_act: str  # the encoder's feed-forward: gelu or silu
    spatial_merge_size: int  # the projector merges s x s patches into one token
    projector_act: str
    projector_bias: bool
    feature_layer: int  # which hidden state feeds the projector (-1: the last layer's)
    text_hidden_size: int
    norm_eps: float  # the projector's RMSNorm (the text model's eps)
    image_token_id: int

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> VisionConfig:
        """From a Mistral3 config.json (`vision_config` inside it)."""
        vision, text = cfg["vision_config"], cfg["text_config"]
        layer = cfg.get("vision_feature_layer", -1)
        if not isinstance(layer, int):
            raise ValueError("Mistral3 with several vision_feature_layer values is not supported")
        rope = vision.get("rope_parameters") or {}
        return cls(
            hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"],
            num_layers=vision["num_hidden_layers"],
            num_heads=vision["num_attention_heads"],
            num_channels=vision.get("num_channels", 3),
            patch_size=vision["patch_size"],
            rope_theta=vision.get("rope_theta", rope.get("rope_theta", 10000.0)),
            hidden_act=vision.get("hidden_act", "gelu"),
            spatial_merge_size=cfg.get("spatial_merge_size", 2),
            projector_act=cfg.get("projector_hidden_act", "gelu"),
            projector_bias=cfg.get("multimodal_projector_bias", False),
            feature_layer=layer,
            text_hidden_size=text["hidden_size"],
            norm_eps=text.get("rms_norm_eps", 1e-6),
            image_token_id=cfg.get("image_token_index", cfg.get("image_token_id", 10)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def token_side(self) -> int:
        """Pixels along each side of the square one image token covers."""
        return self.patch_size * self.spatial_merge_size
