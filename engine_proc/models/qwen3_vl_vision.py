"""Qwen3-VL vision tower: patch embedding (with bias), learned position embeddings
resampled to each image's grid, 2-D rotary, full-attention LayerNorm blocks, the patch
merger and the DeepStack mergers fed by the blocks in `deepstack_visual_indexes`.

Hidden states stay in the processor's patch order (block-major over merge units), as in
the Qwen2.5-VL tower. Between blocks the tower carries one tensor [N, width * (1 + j)]:
the hidden states, then the j DeepStack block outputs taken so far, so an image encoded
in stages over several steps holds its DeepStack features with it and nothing else. The
last step merges all of it into [N / merge^2, out_hidden * (1 + k)]: the image embeddings,
then the k DeepStack features, in decoder-layer order.

Layout (position-embedding taps and weights, rotary rows) comes from the host-int grids,
built on the host per frame shape (cached for small ones), and reaches the device in
non-blocking copies: no host sync in the forward.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers.activation import activation
from engine_proc.layers.rotary_embedding import VisionRotaryEmbedding
from engine_proc.models.vision_tower import (
    CACHED_LAYOUT_MAX_PATCHES,
    VISION_ROPE_THETA,
    Grids,
    PatchEmbed,
    VarlenSpans,
    VisionAttention,
    patch_positions,
    stage_bounds,
    to_device,
    varlen_spans,
)
from shared.model_config import VisionConfig


def _frame_rows_cols(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """Row and column of each patch of an h x w frame, block-major over merge units."""
    positions = patch_positions(1, h, w, merge)
    return positions[:, 0], positions[:, 1]


def _axis_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) taps into a `side`-long table for positions `index` of an
    axis `size` long, and their weights: transformers' arithmetic, in fp32 on the CPU."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device="cpu")
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


def _frame_positions(h: int, w: int, merge: int) -> torch.Tensor:
    """int64 [h*w, 2]: (row, column) of each patch of one frame, for the rotary."""
    return torch.from_numpy(patch_positions(1, h, w, merge))


def _frame_interpolation(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, ...]:
    """One frame's taps int64 [h*w, 4] into the side x side position table and their
    bilinear weights fp32 [h*w, 4]."""
    rows, cols = _frame_rows_cols(h, w, merge)
    h_taps, h_weights = _axis_taps(torch.from_numpy(rows), h, side)
    w_taps, w_weights = _axis_taps(torch.from_numpy(cols), w, side)
    taps = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return taps, weights


# R4: a bounded number of small grids is kept (under ~1 MB each); big grids are built
# fresh (milliseconds, next to the tower's work on them).
_cached_positions = lru_cache(maxsize=32)(_frame_positions)
_cached_interpolation = lru_cache(maxsize=32)(_frame_interpolation)


def frame_positions(h: int, w: int, merge: int) -> torch.Tensor:
    small = h * w <= CACHED_LAYOUT_MAX_PATCHES
    return (_cached_positions if small else _frame_positions)(h, w, merge)


def frame_interpolation(h: int, w: int, merge: int, side: int) -> tuple[torch.Tensor, ...]:
    small = h * w <= CACHED_LAYOUT_MAX_PATCHES
    return (_cached_interpolation if small else _frame_interpolation)(h, w, merge, side)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = activation(cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionAttention(VisionAttention):
    """Full attention within each image (Qwen3-VL has no window blocks)."""

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sizes: tuple[int, ...],
        spans: VarlenSpans | None = None,
    ) -> torch.Tensor:
        out = self._images(self.rotated_qkv(x, cos, sin), sizes, spans)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = Qwen3VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sizes: tuple[int, ...],
        spans: VarlenSpans | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, sizes, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one token. The main merger normalizes each patch; the
    DeepStack mergers (`postshuffle`) normalize the concatenated unit."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.linear_fc2 = nn.Linear(self.hidden_size, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle:
            x = self.norm(x.reshape(-1, self.hidden_size))
        else:
            x = self.norm(x).view(-1, self.hidden_size)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig, device: torch.device, max_side: int = 256) -> None:
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.spatial_merge_size
        self.width = cfg.hidden_size
        self.side = int(cfg.num_position_embeddings**0.5)
        self.device = torch.device(device)
        self.patch_embed = PatchEmbed(cfg, bias=True)
        # no random init (the checkpoint fills it; see layers/vocab_parallel.py: under the
        # meta device nn.Embedding's init imports torch._dynamo, 0.9 s of an engine start)
        self.pos_embed = nn.Embedding(
            cfg.num_position_embeddings, cfg.hidden_size,
            _weight=torch.empty(cfg.num_position_embeddings, cfg.hidden_size))
        self.blocks = nn.ModuleList([VisionBlock(cfg) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            [PatchMerger(cfg, postshuffle=True) for _ in cfg.deepstack_visual_indexes]
        )
        # DeepStack feature i (added after decoder layer i) is the i-th tapped block in
        # block order; its merger is the one listed with that block.
        taps = sorted(cfg.deepstack_visual_indexes)
        self.deepstack_blocks = frozenset(taps)
        self.deepstack_mergers = tuple(cfg.deepstack_visual_indexes.index(b) for b in taps)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, VISION_ROPE_THETA, max_side, self.device)

    @property
    def num_deepstack(self) -> int:
        return len(self.deepstack_mergers)

    @property
    def stages(self) -> list[tuple[int, int]]:
        """The pieces a large image is encoded in over several steps (every block is full
        attention: near-equal runs, 27 blocks -> 7, 7, 6, 7)."""
        depth = len(self.blocks)
        return stage_bounds(depth, frozenset(range(depth)))

    def forward(self, patches: torch.Tensor, grids: Grids) -> torch.Tensor:
        """patches [N, C*T*P*P] in processor order -> [N / merge^2, out_hidden * (1 + k)]:
        embeddings, then DeepStack features, images in order."""
        return self.forward_embedded(self.patch_embed(patches), grids)

    def forward_embedded(self, x: torch.Tensor, grids: Grids) -> torch.Tensor:
        """`forward` from the patch embeddings [N, width] on."""
        x = self.add_position_embeddings(x, grids)
        return self._merge(*self._blocks(x, grids, 0, len(self.blocks)))

    def add_position_embeddings(self, x: torch.Tensor, grids: Grids) -> torch.Tensor:
        """Patch embeddings [N, width] + the learned table resampled to each grid."""
        taps, weights = [], []
        for t, h, w in grids:
            frame_taps, frame_weights = frame_interpolation(int(h), int(w), self.merge, self.side)
            taps += [frame_taps] * int(t)
            weights += [frame_weights] * int(t)
        taps = to_device(torch.cat(taps), self.device)
        weights = to_device(torch.cat(weights), self.device)
        pos = (self.pos_embed(taps) * weights[:, :, None]).sum(1)
        return x + pos.to(x.dtype)

    def run_blocks(self, carried: torch.Tensor, grids: Grids, first: int, end: int) -> torch.Tensor:
        """Blocks [first, end) over the carried tensor [N, width * (1 + j)] of the images
        in `grids` (one stage); DeepStack block outputs are appended as columns."""
        x, taken = self._blocks(carried[:, : self.width], grids, first, end)
        earlier = carried[:, self.width :]
        parts = [x, earlier, *taken] if earlier.shape[1] else [x, *taken]
        return torch.cat(parts, dim=1) if len(parts) > 1 else x

    def merge_all(self, carried: torch.Tensor) -> torch.Tensor:
        """The carried tensor after the last block -> [N / merge^2, out_hidden * (1 + k)]."""
        x, *taken = carried.split(self.width, dim=1)
        return self._merge(x, taken)

    def _blocks(
        self, x: torch.Tensor, grids: Grids, first: int, end: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Blocks [first, end) over hidden states [N, width] -> (hidden states, outputs of
        the DeepStack blocks among them)."""
        grids = tuple(tuple(int(v) for v in g) for g in grids)
        self.rotary.ensure_side(max(max(h, w) for _, h, w in grids))
        pos_hw = torch.cat([frame_positions(h, w, self.merge) for t, h, w in grids for _ in range(t)])
        cos, sin = self.rotary(to_device(pos_hw, self.device))
        sizes = tuple(t * h * w for t, h, w in grids)
        spans = varlen_spans(self.device, x.dtype, self.cfg.head_dim, np.asarray(sizes))
        taken = []
        for i in range(first, end):
            x = self.blocks[i](x, cos, sin, sizes, spans)
            if i in self.deepstack_blocks:
                taken.append(x)
        return x, taken

    def _merge(self, x: torch.Tensor, taken: list[torch.Tensor]) -> torch.Tensor:
        if len(taken) != self.num_deepstack:
            raise ValueError(f"{len(taken)} DeepStack features carried, "
                             f"{self.num_deepstack} expected")
        merged = [self.merger(x)]
        merged += [self.deepstack_merger_list[m](t)
                   for m, t in zip(self.deepstack_mergers, taken, strict=True)]
        return torch.cat(merged, dim=1)
