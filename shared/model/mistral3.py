"""Mistral3's image path: the Pixtral encoder, then the projector (RMSNorm, a learned
merge of each s x s block of patches, linear-GELU-linear) into the text model's hidden
size. One row per image token; the text model takes them in place of those tokens'
embeddings (LlamaForCausalLM.forward's `embeds`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from specmesh.shared.core.images import PromptImage
from specmesh.shared.model.layers import RMSNorm
from specmesh.shared.model.pixtral import PixtralEncoder, activation
from specmesh.shared.model.vision_config import VisionConfig
from torch import nn


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.merge = cfg.spatial_merge_size
        d = cfg.hidden_size
        self.merging_layer = nn.Linear(d * self.merge**2, d, bias=False)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """x [h*w, D] of one image -> [(h/s)*(w/s), D], merged blocks in row-major order."""
        h, w = grid
        image = x.view(h, w, -1).permute(2, 0, 1)[None]  # [1, D, h, w]
        # each s x s block as one column of D*s*s values (channel-major, as unfold lays it)
        blocks = F.unfold(image, kernel_size=self.merge, stride=self.merge)[0].T
        return self.merging_layer(blocks)


class MultiModalProjector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.patch_merger = PatchMerger(cfg)
        bias = cfg.projector_bias
        self.linear_1 = nn.Linear(cfg.hidden_size, cfg.text_hidden_size, bias=bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=bias)
        self.act = activation(cfg.projector_act)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """x [P, D] of the images' patches -> [image tokens, text hidden]."""
        x = self.norm(x)
        sizes = [h * w for h, w in grids]
        merged = [self.patch_merger(p, g) for p, g in zip(x.split(sizes), grids, strict=True)]
        return self.linear_2(self.act(self.linear_1(torch.cat(merged))))


class Mistral3Vision(nn.Module):
    """What Mistral3 adds to the text model: `vision_tower` and `multi_modal_projector`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_tower = PixtralEncoder(cfg)
        self.multi_modal_projector = MultiModalProjector(cfg)

    def tokens_for(self, image: PromptImage) -> int:
        """How many image tokens (feature rows) the image becomes."""
        _, h, w = image.pixels.shape
        return (h // self.config.token_side) * (w // self.config.token_side)

    def encode(self, images: list[PromptImage]) -> torch.Tensor:
        """Features of every image token, image after image [N, text hidden]."""
        weight = self.multi_modal_projector.linear_1.weight
        pixels = [_normalized(image, weight.device).to(weight.dtype) for image in images]
        features, grids = self.vision_tower(pixels)
        return self.multi_modal_projector(features, grids)


def _normalized(image: PromptImage, device: torch.device) -> torch.Tensor:
    """[3, H, W] float32: rescaled to [0, 1], then normalized per channel."""
    mean = torch.tensor(image.mean, device=device)[:, None, None]
    std = torch.tensor(image.std, device=device)[:, None, None]
    return (image.pixels.to(device, torch.float32) * image.rescale - mean) / std


# Checkpoint prefixes -> ours: transformers>=4.52 writes `model.language_model.*`, earlier
# versions `language_model.model.*`; the text model's tensors are ours without a prefix,
# the image path's live under `vision.` (the attribute the loader gives the text model).
CHECKPOINT_PREFIXES = (
    ("model.language_model.", ""),
    ("language_model.model.", ""),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.multi_modal_projector.", "vision.multi_modal_projector."),
    ("multi_modal_projector.", "vision.multi_modal_projector."),
)


def parameter_name(checkpoint_name: str) -> str:
    """Our parameter's name for a Mistral3 checkpoint tensor."""
    for prefix, ours in CHECKPOINT_PREFIXES:
        if checkpoint_name.startswith(prefix):
            return ours + checkpoint_name.removeprefix(prefix)
    return checkpoint_name
