"""Qwen2.5-VL vision tower: patch embedding, 2-D rotary, window/full attention blocks,
patch merger.

Hidden states stay in the processor's patch order (block-major over merge units) for the
whole tower. Window blocks gather each window's patches into a padded [windows, len]
batch and scatter the result back; full blocks attend per image. Transformers instead
permutes the sequence into window order and back; attention is the same either way, and
this saves both permutations and the merger's final reorder.

All layout (rotary positions, window gather/scatter indices) comes from the grids, which
are host ints: it is built with numpy (cached for small grid lists) and copied to the device in
one non-blocking transfer, so the forward never waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers.rms_norm import RMSNorm
from engine_proc.layers.rotary_embedding import VisionRotaryEmbedding, apply_rotary_
from engine_proc.models.qwen2 import Qwen2MLP
from shared.model_config import VisionConfig

VISION_ROPE_THETA = 10000.0

Grids = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class _HostLayout:
    """Layout of one vision forward, as numpy arrays (see `_host_layout`)."""

    pos_hw: np.ndarray  # [N, 2] row/column of each patch
    window_gather: np.ndarray  # [W, L] patch index at each padded window slot
    window_scatter: np.ndarray  # [N] flat padded slot of each patch
    window_valid: np.ndarray | None  # [W, L] bool; None when every window is full
    image_sizes: tuple[int, ...]  # patches per image (full-attention spans)
    max_side: int


@dataclass
class VisionLayout:
    pos_hw: torch.Tensor
    window_gather: torch.Tensor
    window_scatter: torch.Tensor
    window_mask: torch.Tensor | None  # additive [W, 1, 1, L]
    image_sizes: tuple[int, ...]


def _host_layout(grids: Grids, merge: int, window_units: int) -> _HostLayout:
    """Positions and window indices for a list of (t, h, w) patch grids.

    Windows tile each frame's merge-unit grid in squares of `window_units` units (edge
    windows smaller), ordered like transformers' get_vision_window_index."""
    unit = merge * merge
    pos, unit_window, sizes = [], [], []
    num_windows = 0
    for t, h, w in grids:
        uh, uw = h // merge, w // merge
        # patch (row, col) in block-major order: [t, uh, uw, merge, merge]
        rows = np.arange(uh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None]
        cols = np.arange(uw)[None, :, None, None] * merge + np.arange(merge)[None, None, None, :]
        rows, cols = np.broadcast_arrays(rows, cols)
        frame = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)
        pos.append(np.tile(frame, (t, 1)))
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
    pos_hw = np.concatenate(pos).astype(np.int64)
    return _HostLayout(
        pos_hw=pos_hw,
        window_gather=gather.reshape(counts.size, length),
        window_scatter=scatter.astype(np.int64),
        window_valid=valid,
        image_sizes=tuple(sizes),
        max_side=int(max(max(h, w) for _, h, w in grids)),
    )


_cached_host_layout = lru_cache(maxsize=32)(_host_layout)
CACHED_LAYOUT_MAX_PATCHES = 16384  # R4: the layout cache stays under ~20 MB


def host_layout(grids: Grids, merge: int, window_units: int) -> _HostLayout:
    """Cached for small grid lists (frequent, cheap to keep); built fresh for big ones
    (about 10 ms for 65k patches, next to seconds of vision compute)."""
    if sum(t * h * w for t, h, w in grids) <= CACHED_LAYOUT_MAX_PATCHES:
        return _cached_host_layout(grids, merge, window_units)
    return _host_layout(grids, merge, window_units)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride, run as the equivalent (much faster) matmul."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        p, t = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.hidden_size, (t, p, p), stride=(t, p, p), bias=False
        )

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1))


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: VisionLayout,
        windowed: bool,
    ) -> torch.Tensor:
        qkv = self.rotated_qkv(x, cos, sin)
        if windowed:
            out = self._windows(qkv, layout)
        else:
            out = self._images(qkv, layout.image_sizes)
        return self.proj(out.reshape(x.shape[0], -1))

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> q, k, v [N, 3, heads, head_dim], q and k rotated."""
        n = x.shape[0]
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        # Rotary in fp32 like transformers (in place when the model is fp32 already).
        if qkv.dtype == torch.float32:
            apply_rotary_(qkv[:, :2].view(n, 2 * self.num_heads, self.head_dim), cos, sin)
        else:
            qk = apply_rotary_(
                qkv[:, :2].reshape(n, 2 * self.num_heads, self.head_dim).float(), cos, sin
            )
            qkv[:, :2] = qk.view(n, 2, self.num_heads, self.head_dim).to(qkv.dtype)
        return qkv

    def _windows(self, qkv: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        num_windows, length = layout.window_gather.shape
        padded = qkv.index_select(0, layout.window_gather.view(-1)).view(
            num_windows, length, 3, self.num_heads, self.head_dim
        )
        q, k, v = padded.permute(2, 0, 3, 1, 4).unbind(0)  # [W, heads, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.window_mask)
        out = out.transpose(1, 2).reshape(num_windows * length, self.num_heads, self.head_dim)
        return out.index_select(0, layout.window_scatter)

    def _images(self, qkv: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
        """Full attention within each image of `sizes` patches."""
        if len(set(sizes)) == 1:  # equal sizes (one image included): one batched call
            q, k, v = qkv.view(len(sizes), sizes[0], 3, self.num_heads, self.head_dim).permute(
                2, 0, 3, 1, 4
            )
            out = F.scaled_dot_product_attention(q, k, v)
            return out.transpose(1, 2).reshape(qkv.shape[0], self.num_heads, self.head_dim)
        outs = []
        for chunk in qkv.split(sizes):
            q, k, v = chunk.permute(1, 2, 0, 3).unsqueeze(1).unbind(0)  # [1, heads, n, D]
            outs.append(F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1))
        return torch.cat(outs)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = Qwen2MLP(cfg.hidden_size, cfg.intermediate_size, bias=True)

    def forward(self, x, cos, sin, layout: VisionLayout, windowed: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, layout, windowed)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


class Qwen2_5_VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig, device: torch.device, max_side: int = 256) -> None:
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.spatial_merge_size
        self.window_units = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size
        self.fullatt = frozenset(cfg.fullatt_block_indexes)
        self.device = torch.device(device)
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, VISION_ROPE_THETA, max_side, self.device)

    def layout(self, grids: Grids, dtype: torch.dtype) -> VisionLayout:
        host = host_layout(grids, self.merge, self.window_units)
        self.rotary.ensure_side(host.max_side)
        packed = np.concatenate(
            [host.pos_hw.reshape(-1), host.window_gather.reshape(-1), host.window_scatter]
        )
        flat = _to_device(packed, self.device)
        n_pos, n_gather = host.pos_hw.size, host.window_gather.size
        mask = None
        if host.window_valid is not None:
            valid = _to_device(host.window_valid, self.device)
            mask = torch.zeros(valid.shape, dtype=dtype, device=self.device)
            mask.masked_fill_(~valid, float("-inf"))
            mask = mask[:, None, None, :]
        return VisionLayout(
            pos_hw=flat[:n_pos].view(-1, 2),
            window_gather=flat[n_pos : n_pos + n_gather].view(host.window_gather.shape),
            window_scatter=flat[n_pos + n_gather :],
            window_mask=mask,
            image_sizes=host.image_sizes,
        )

    def forward(self, patches: torch.Tensor, grids: Grids) -> torch.Tensor:
        """patches [N, C*T*P*P] in processor order, grids ((t, h, w), ...) in patches ->
        merged embeddings [N / merge^2, out_hidden_size], images in order."""
        return self.forward_embedded(self.patch_embed(patches), grids)

    def forward_embedded(self, x: torch.Tensor, grids: Grids) -> torch.Tensor:
        """`forward` from the patch embeddings [N, hidden] on (see `encode_images`, which
        embeds large images piece by piece)."""
        return self.merger(self.run_blocks(x, grids, 0, len(self.blocks)))

    @property
    def stages(self) -> list[tuple[int, int]]:
        """The tower cut into (first, end) block ranges that each end with a
        full-attention block (the last one with the last block): the pieces a large
        image is encoded in over several steps. A full-attention block costs the square of
        the image's patches, a windowed one a multiple of them, so the stages cost about
        the same: 2 for the tiny model, 4 for Qwen2.5-VL 3B/7B (32 blocks)."""
        ends = sorted({i + 1 for i in self.fullatt if i < len(self.blocks)} | {len(self.blocks)})
        return list(zip([0, *ends[:-1]], ends, strict=True))

    def run_blocks(self, x: torch.Tensor, grids: Grids, first: int, end: int) -> torch.Tensor:
        """Blocks [first, end) over hidden states [N, hidden] of the images in `grids`."""
        layout = self.layout(tuple(tuple(int(v) for v in g) for g in grids), x.dtype)
        cos, sin = self.rotary(layout.pos_hw)
        for i in range(first, end):
            x = self.blocks[i](x, cos, sin, layout, windowed=i not in self.fullatt)
        return x
