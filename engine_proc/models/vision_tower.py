"""What the Qwen-VL vision towers share: patch embedding, 2-D rotary positions, per-image
full attention, the patch merger's shape, the stage cuts and the tower's skeleton.

A family's tower (qwen2_vl_vision.py, qwen2_5_vl_vision.py) supplies its blocks, its
merger norm and its layout; everything here runs on hidden states kept in the processor's
patch order (block-major over merge units) for the whole tower.

Layout comes from the grids, which are host ints: it is built with numpy and copied to the
device in one non-blocking transfer, so the forward never waits on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers.rotary_embedding import VisionRotaryEmbedding, apply_rotary_
from engine_proc.layers.varlen_attention import VarlenFn, varlen_kernel
from shared.model_config import VisionConfig

VISION_ROPE_THETA = 10000.0
NUM_EQUAL_STAGES = 4  # stages of a tower whose every block is full attention

Grids = tuple[tuple[int, int, int], ...]


def patch_positions(t: int, h: int, w: int, merge: int) -> np.ndarray:
    """(row, column) int64 [t*h*w, 2] of each patch of one image, in block-major order
    ([t, h/merge, w/merge, merge, merge])."""
    uh, uw = h // merge, w // merge
    rows = np.arange(uh)[:, None, None, None] * merge + np.arange(merge)[None, None, :, None]
    cols = np.arange(uw)[None, :, None, None] * merge + np.arange(merge)[None, None, None, :]
    rows, cols = np.broadcast_arrays(rows, cols)
    frame = np.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)
    return np.tile(frame, (t, 1)).astype(np.int64)


def to_device(array: np.ndarray | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host array or tensor on `device`, pinned and copied without blocking on CUDA."""
    tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def stage_bounds(depth: int, full_attention: frozenset[int]) -> list[tuple[int, int]]:
    """(first, end) block ranges a large image is encoded in over several steps.

    A full-attention block costs the square of the image's patches, a windowed one a
    multiple of them: with windows, each stage ends with a full-attention block (2 stages
    for the tiny Qwen2.5-VL, 4 for 3B/7B). With full attention everywhere, the blocks are
    cut into NUM_EQUAL_STAGES runs of equal length (a stage per block would be a step per
    block)."""
    if full_attention >= set(range(depth)):
        count = min(NUM_EQUAL_STAGES, depth)
        ends = [round((i + 1) * depth / count) for i in range(count)]
    else:
        ends = sorted({i + 1 for i in full_attention if i < depth} | {depth})
    return list(zip([0, *ends[:-1]], ends, strict=True))


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride, run as the equivalent (much faster) matmul; Qwen3-VL's
    has a bias.

    A still image fills the temporal patch with copies of itself, so its product with the
    kernel equals one frame's product with the kernel summed over time: `forward` takes
    such patches with one frame ([N, C * p * p], `pixels_to_patches(still=True)`) and runs
    half the FLOPs on half the bytes. Only for float32 weights: summed in bf16 the kernel
    would be rounded once more than transformers' conv."""

    def __init__(self, cfg: VisionConfig, bias: bool = False) -> None:
        super().__init__()
        p, t = cfg.patch_size, cfg.temporal_patch_size
        self.proj = nn.Conv3d(
            cfg.in_channels, cfg.hidden_size, (t, p, p), stride=(t, p, p), bias=bias
        )
        self._still: tuple[tuple[int, int], torch.Tensor] | None = None

    @property
    def takes_still(self) -> bool:
        return self.proj.weight.dtype == torch.float32

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        if patches.shape[-1] != weight[0].numel():  # one frame of a still image
            weight = self._still_weight()
        return F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1), self.proj.bias)

    def _still_weight(self) -> torch.Tensor:
        """The kernel summed over its temporal axis [out, C * p * p], kept while the weight
        is the same tensor at the same version (loading weights in place bumps it)."""
        weight = self.proj.weight
        if not self.takes_still:
            raise ValueError(f"still-image patches need float32 weights, not {weight.dtype}")
        key = (weight.data_ptr(), weight._version)
        if self._still is None or self._still[0] != key:
            self._still = (key, weight.detach().sum(dim=2).reshape(weight.shape[0], -1))
        return self._still[1]


class VisionAttention(nn.Module):
    """qkv with 2-D rotary, attention within each image, output projection. Subclasses
    attend within other spans (windows) by overriding `attend`."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout,
                **kwargs) -> torch.Tensor:
        out = self.attend(self.rotated_qkv(x, cos, sin), layout, **kwargs)
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

    def attend(self, qkv: torch.Tensor, layout) -> torch.Tensor:
        """qkv [N, 3, heads, D] -> [N, heads, D], each image attending to itself."""
        return self._images(qkv, layout.image_sizes, layout.image_spans)

    def _images(self, qkv: torch.Tensor, sizes: tuple[int, ...],
                spans: VarlenSpans | None = None) -> torch.Tensor:
        """Full attention within each image of `sizes` patches (`spans`: their offsets, for
        the varlen kernel where it runs)."""
        if spans is not None:
            return spans.attend(qkv, self.head_dim**-0.5)
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


class PatchMerger(nn.Module):
    """Norm, then each merge unit's patches concatenated through a 2-layer GELU MLP."""

    def __init__(self, cfg: VisionConfig, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.hidden_size = cfg.hidden_size * cfg.spatial_merge_size**2
        self.ln_q = norm(cfg.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size),
            nn.GELU(),
            nn.Linear(self.hidden_size, cfg.out_hidden_size),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden_size))


@dataclass
class VarlenSpans:
    """Packed spans of patches (images, windows) for one varlen attention call per block:
    no padding to the longest, no mask (on GPUs in fp16/bf16: layers/varlen_attention.py)."""

    kernel: VarlenFn
    cu: torch.Tensor  # int32 [spans + 1] on the device
    max_len: int

    @classmethod
    def of(cls, kernel: VarlenFn | None, lengths: np.ndarray, device: torch.device
           ) -> VarlenSpans | None:
        if kernel is None:
            return None
        cu = np.zeros(len(lengths) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu[1:])
        return cls(kernel, to_device(cu, device), int(np.max(lengths)))

    def attend(self, qkv: torch.Tensor, scale: float) -> torch.Tensor:
        """qkv [N, 3, heads, D], spans back to back -> [N, heads, D]."""
        q, k, v = qkv.unbind(1)
        return self.kernel(q, k, v, self.cu, self.cu, self.max_len, self.max_len, scale=scale,
                           causal=False)


def varlen_spans(device: torch.device, dtype: torch.dtype, head_dim: int,
                 lengths: np.ndarray) -> VarlenSpans | None:
    """Spans of `lengths` patches for the varlen kernel, where one runs for this device,
    dtype and head size (else None: the towers' SDPA paths)."""
    return VarlenSpans.of(varlen_kernel(device, dtype, head_dim), lengths, device)


@dataclass
class FullLayout:
    """Layout of a tower without windows: patch positions and the images' spans."""

    pos_hw: torch.Tensor  # [N, 2] row/column of each patch
    image_sizes: tuple[int, ...]  # patches per image
    image_spans: VarlenSpans | None = None  # where a varlen kernel runs


@lru_cache(maxsize=32)
def _cached_positions(grids: Grids, merge: int) -> np.ndarray:
    return np.concatenate([patch_positions(t, h, w, merge) for t, h, w in grids])


CACHED_LAYOUT_MAX_PATCHES = 16384  # R4: the layout cache stays under ~20 MB


class VisionTower(nn.Module):
    """Patch embedding, blocks, merger. A subclass builds `blocks` and `merger` and may
    override `layout` (and the blocks' keyword arguments, `block_kwargs`)."""

    def __init__(self, cfg: VisionConfig, device: torch.device, max_side: int = 256) -> None:
        super().__init__()
        self.cfg = cfg
        self.merge = cfg.spatial_merge_size
        self.fullatt = frozenset(cfg.fullatt_block_indexes)
        self.device = torch.device(device)
        self.patch_embed = PatchEmbed(cfg)
        self.rotary = VisionRotaryEmbedding(cfg.head_dim, VISION_ROPE_THETA, max_side, self.device)

    def layout(self, grids: Grids, dtype: torch.dtype) -> FullLayout:
        if sum(t * h * w for t, h, w in grids) <= CACHED_LAYOUT_MAX_PATCHES:
            pos = _cached_positions(grids, self.merge)
        else:
            pos = _cached_positions.__wrapped__(grids, self.merge)
        self.rotary.ensure_side(max(max(h, w) for _, h, w in grids))
        sizes = tuple(t * h * w for t, h, w in grids)
        return FullLayout(to_device(pos, self.device), sizes,
                          self.varlen_spans(dtype, np.asarray(sizes)))

    def varlen_spans(self, dtype: torch.dtype, lengths: np.ndarray) -> VarlenSpans | None:
        return varlen_spans(self.device, dtype, self.cfg.head_dim, lengths)

    def block_kwargs(self, index: int) -> dict:
        return {}

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
        """The tower cut into (first, end) block ranges (see `stage_bounds`)."""
        return stage_bounds(len(self.blocks), self.fullatt)

    def run_blocks(self, x: torch.Tensor, grids: Grids, first: int, end: int) -> torch.Tensor:
        """Blocks [first, end) over hidden states [N, hidden] of the images in `grids`."""
        layout = self.layout(tuple(tuple(int(v) for v in g) for g in grids), x.dtype)
        cos, sin = self.rotary(layout.pos_hw)
        for i in range(first, end):
            x = self.blocks[i](x, cos, sin, layout, **self.block_kwargs(i))
        return x
