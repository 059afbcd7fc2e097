"""Qwen2-VL vision tower: full attention in every block, LayerNorm, a quick-GELU MLP
(fc1/fc2); patch embedding, rotary, attention and merger shape as in vision_tower.py."""

from __future__ import annotations

import torch
from torch import nn

from engine_proc.layers.activation import activation
from engine_proc.models.vision_tower import FullLayout, PatchMerger, VisionAttention, VisionTower
from shared.model_config import VisionConfig

NORM_EPS = 1e-6


def _layer_norm(size: int) -> nn.LayerNorm:
    return nn.LayerNorm(size, eps=NORM_EPS)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = activation(cfg.hidden_act)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Qwen2VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _layer_norm(cfg.hidden_size)
        self.norm2 = _layer_norm(cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin, layout: FullLayout) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, layout)
        return x + self.mlp(self.norm2(x))


class Qwen2VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, device: torch.device, max_side: int = 256) -> None:
        super().__init__(cfg, device, max_side)
        self.blocks = nn.ModuleList([Qwen2VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, _layer_norm)
