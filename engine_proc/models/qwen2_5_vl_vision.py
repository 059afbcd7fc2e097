"""Qwen2.5-VL vision tower: window attention blocks with a few full-attention ones, RMSNorm,
a gated SiLU MLP (the shared parts are in vision_tower.py).

Window blocks gather each window's patches into a padded [windows, len] batch and scatter
the result back; full blocks attend per image. Transformers instead permutes the sequence
into window order and back; attention is the same either way, and this saves both
permutations and the merger's final reorder.

All layout (rotary positions, window gather/scatter indices) is built with numpy (cached
for small grid lists) and copied to the device in one non-blocking transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers.rms_norm import RMSNorm
from engine_proc.models.qwen2 import Qwen2MLP
from engine_proc.models.vision_tower import (
    CACHED_LAYOUT_MAX_PATCHES,
    Grids,
    PatchMerger,
    VarlenSpans,
    VisionAttention,
    VisionTower,
    patch_positions,
    to_device,
)
from shared.model_config import VisionConfig


@dataclass(frozen=True)
class _HostLayout:
    """Layout of one vision forward, as numpy arrays (see `_host_layout`)."""

    pos_hw: np.ndarray  # [N, 2] row/column of each patch
    window_gather: np.ndarray  # [W, L] patch index at each padded window slot
    window_scatter: np.ndarray  # [N] flat padded slot of each patch
    window_valid: np.ndarray | None  # [W, L] bool; None when every window is full
    window_lengths: np.ndarray  # [W] patches per window
    image_sizes: tuple[int, ...]  # patches per image (full-attention spans)
    max_side: int


@dataclass
class VisionLayout:
    pos_hw: torch.Tensor
    image_sizes: tuple[int, ...]
    # SDPA over windows padded to the longest, masked
    window_gather: torch.Tensor | None = None
    window_scatter: torch.Tensor | None = None
    window_mask: torch.Tensor | None = None  # additive [W, 1, 1, L]
    # where a varlen kernel runs instead: the windows packed without padding (patches in
    # window order, and back), and the images' spans for the full-attention blocks
    window_spans: VarlenSpans | None = None
    window_order: torch.Tensor | None = None
    window_inverse: torch.Tensor | None = None
    image_spans: VarlenSpans | None = None


def _host_layout(grids: Grids, merge: int, window_units: int) -> _HostLayout:
    """Positions and window indices for a list of (t, h, w) patch grids.

    Windows tile each frame's merge-unit grid in squares of `window_units` units (edge
    windows smaller), ordered like transformers' get_vision_window_index."""
    unit = merge * merge
    pos, unit_window, sizes = [], [], []
    num_windows = 0
    for t, h, w in grids:
        uh, uw = h // merge, w // merge
        pos.append(patch_positions(t, h, w, merge))
        wh, ww = -(-uh // window_units), -(-uw // window_units)
        win = (np.arange(uh)[:, None] // window_units) * ww + np.arange(uw)[None, :] // window_units
        frames = np.arange(t)[:, None] * (wh * ww) + win.reshape(1, -1)
        unit_window.append(frames.reshape(-1) + num_windows)
        num_windows += t * wh * ww
        sizes.append(t * h * w)
    unit_window = np.concatenate(unit_window)
    counts = np.bincount(unit_window, minlength=num_windows)
    # Windows that hold no units (none here, but keep the math honest) are dropped.
    keep = counts > 0
    remap = np.cumsum(keep) - 1
    unit_window = remap[unit_window]
    counts = counts[keep]
    order = np.argsort(unit_window, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    unit_slot = np.empty_like(order)
    unit_slot[order] = np.arange(order.size) - np.repeat(starts, counts)
    length = int(counts.max()) * unit
    num_units = unit_window.size
    patch_window = np.repeat(unit_window, unit)
    patch_slot = (unit_slot[:, None] * unit + np.arange(unit)[None, :]).reshape(-1)
    scatter = patch_window * length + patch_slot
    gather = np.zeros(counts.size * length, dtype=np.int64)
    gather[scatter] = np.arange(num_units * unit)
    valid = None
    if (counts * unit != length).any():
        valid = np.zeros(counts.size * length, dtype=bool)
        valid[scatter] = True
        valid = valid.reshape(counts.size, length)
    pos_hw = np.concatenate(pos)
    return _HostLayout(
        pos_hw=pos_hw,
        window_gather=gather.reshape(counts.size, length),
        window_scatter=scatter.astype(np.int64),
        window_valid=valid,
        window_lengths=counts * unit,
        image_sizes=tuple(sizes),
        max_side=int(max(max(h, w) for _, h, w in grids)),
    )


_cached_host_layout = lru_cache(maxsize=32)(_host_layout)


def host_layout(grids: Grids, merge: int, window_units: int) -> _HostLayout:
    """Cached for small grid lists (frequent, cheap to keep); built fresh for big ones
    (about 10 ms for 65k patches, next to seconds of vision compute)."""
    if sum(t * h * w for t, h, w in grids) <= CACHED_LAYOUT_MAX_PATCHES:
        return _cached_host_layout(grids, merge, window_units)
    return _host_layout(grids, merge, window_units)


class WindowAttention(VisionAttention):
    """Vision attention within windows (window blocks) or within images (full blocks)."""

    def attend(self, qkv: torch.Tensor, layout: VisionLayout, windowed: bool) -> torch.Tensor:
        if not windowed:
            return super().attend(qkv, layout)
        if layout.window_spans is not None:
            packed = qkv.index_select(0, layout.window_order)
            out = layout.window_spans.attend(packed, self.head_dim**-0.5)
            return out.index_select(0, layout.window_inverse)
        num_windows, length = layout.window_gather.shape
        padded = qkv.index_select(0, layout.window_gather.view(-1)).view(
            num_windows, length, 3, self.num_heads, self.head_dim
        )
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # [W, heads, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.window_mask)
        out = out.transpose(1, 2).reshape(num_windows * length, self.num_heads, self.head_dim)
        return out.index_select(0, layout.window_scatter)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = WindowAttention(cfg)
        self.mlp = Qwen2MLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, layout: VisionLayout, windowed: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, layout, windowed=windowed)
        return x + self.mlp(self.norm2(x))


class Qwen2_5_VisionTransformer(VisionTower):
    def __init__(self, cfg: VisionConfig, device: torch.device, max_side: int = 256) -> None:
        super().__init__(cfg, device, max_side)
        self.window_units = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, lambda size: RMSNorm(size, eps=1e-6))

    def block_kwargs(self, index: int) -> dict:
        return {"windowed": index not in self.fullatt}

    def layout(self, grids: Grids, dtype: torch.dtype) -> VisionLayout:
        host = host_layout(grids, self.merge, self.window_units)
        self.rotary.ensure_side(host.max_side)
        n_pos = host.pos_hw.size
        window_spans = self.varlen_spans(dtype, host.window_lengths)
        if window_spans is not None:
            # the windows packed without padding: patches in the padded layout's order (its
            # padding slots hold no patch), and back; one copy with the positions
            order = np.argsort(host.window_scatter, kind="stable")
            flat = to_device(np.concatenate([host.pos_hw.reshape(-1), order, np.argsort(order)]),
                             self.device)
            window_order, window_inverse = flat[n_pos:].split(len(order))
            return VisionLayout(
                pos_hw=flat[:n_pos].view(-1, 2), image_sizes=host.image_sizes,
                window_spans=window_spans, window_order=window_order,
                window_inverse=window_inverse,
                image_spans=self.varlen_spans(dtype, np.asarray(host.image_sizes)))
        flat = to_device(np.concatenate(
            [host.pos_hw.reshape(-1), host.window_gather.reshape(-1), host.window_scatter]),
            self.device)
        n_gather = host.window_gather.size
        mask = None
        if host.window_valid is not None:
            valid = to_device(host.window_valid, self.device)
            mask = torch.zeros(valid.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :]
        return VisionLayout(
            pos_hw=flat[:n_pos].view(-1, 2),
            image_sizes=host.image_sizes,
            window_gather=flat[n_pos : n_pos + n_gather].view(host.window_gather.shape),
            window_scatter=flat[n_pos + n_gather :],
            window_mask=mask,
        )
