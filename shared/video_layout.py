"""How a family turns a video's sampled frames into tokens: which frames, what size, what
positions, what text.

Pure arithmetic on the container header (no frame is decoded), so the API process sizes a
video, builds its prompt and admits it before decoding starts, and the tests build the
same inputs for the transformers reference.

    settings = VideoSettings.of(model_config, image_config)
    indices = sample_indices(total_frames, source_fps, num_frames, fps)
    height, width = settings.resized_size(h, w, len(indices))
    layout = settings.layout(indices, source_fps, total_frames, height, width)

Every family patches 2 frames at a time (a temporal group); the last frame repeats when the
count is odd. The towers attend within one group, so a group is encoded exactly as an image
of grid (1, h, w) whose two temporal slices hold two frames. The families differ in:

- size: Qwen2-VL and Qwen2.5-VL bound each frame's pixels (the image bounds, at most
  VIDEO_MAX_PIXELS a frame); Qwen3-VL and Qwen3.5 bound the whole clip's (t x h x w) by
  the video processor's `size` (else the image processor's);
- positions: a Qwen2-VL video is one run of placeholders whose group g sits at temporal
  position g; Qwen2.5-VL scales it to seconds (g x tokens_per_second x seconds a group
  spans, truncated); Qwen3-VL and Qwen3.5 make each group its own run (temporal position
  0) after a `<{t:.1f} seconds>` text naming the group's mean time.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.image_resize import MAX_ASPECT_RATIO
from shared.image_resize import smart_resize as image_smart_resize
from shared.model_config import ImageProcessorConfig, ModelConfig

# qwen-vl-utils' VIDEO_MAX_PIXELS and transformers' class default for Qwen2-VL videos
# (the checkpoints ship no video_preprocessor_config.json, and the image bound, 12.8 M
# pixels a frame, would make one 32-frame clip 760 MB of resized pixels)
VIDEO_MAX_PIXELS = 768 * 28 * 28
TIMESTAMP_FAMILIES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
DEFAULT_TOKENS_PER_SECOND = 4  # transformers' Qwen2.5-VL default (published configs: 2)


def sample_indices(total: int, source_fps: float, num_frames: int,
                   fps: float | None = None) -> list[int]:
    """vLLM's rule: `num_frames` frame indices spread uniformly over the whole clip
    (np.linspace(0, total - 1, n) truncated), all of them when the clip has no more; with
    `fps`, at most `fps` frames a second of the clip. At least 2 frames (one temporal
    group) when the clip has them."""
    n = num_frames
    if fps:
        n = min(n, math.floor(total / source_fps * fps))
    n = max(n, min(2, total))
    if n >= total:
        return list(range(total))
    return np.linspace(0, total - 1, n, dtype=int).tolist()


@dataclass(frozen=True)
class VideoLayout:
    """One video as the model sees it: (groups, grid_h, grid_w) in patches, each group's
    temporal mRoPE position (relative to the video's first token), and with timestamp
    families each group's `<t seconds>` text."""

    grid_thw: tuple[int, int, int]
    temporal_positions: tuple[int, ...]
    timestamps: tuple[str, ...] = ()
    merge_size: int = 2

    @property
    def num_groups(self) -> int:
        return self.grid_thw[0]

    @property
    def group_tokens(self) -> int:
        _, h, w = self.grid_thw
        return h * w // (self.merge_size * self.merge_size)

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens of the whole video (timestamp text and markers not counted)."""
        return self.num_groups * self.group_tokens


@dataclass(frozen=True)
class VideoSettings:
    family: str  # the model_type
    min_pixels: int
    max_pixels: int  # a frame's (Qwen2/2.5-VL) or the whole clip's (Qwen3-VL, Qwen3.5)
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    tokens_per_second: int = DEFAULT_TOKENS_PER_SECOND

    @classmethod
    def of(cls, model: ModelConfig, image: ImageProcessorConfig | None = None) -> VideoSettings:
        """The checkpoint's video settings: its video_preprocessor_config.json `size` when
        there is one, else the image processor's bounds (`image`: with
        --mm-processor-kwargs applied), a frame capped at VIDEO_MAX_PIXELS for Qwen2/2.5."""
        image = image or model.image
        folder = Path(model.path)
        video_file = folder / "video_preprocessor_config.json"
        pre = json.loads(video_file.read_text()) if video_file.exists() else {}
        size = pre.get("size") or {}
        min_pixels = int(pre.get("min_pixels") or size.get("shortest_edge") or image.min_pixels)
        max_pixels = int(pre.get("max_pixels") or size.get("longest_edge") or image.max_pixels)
        family = model.model_type
        if family not in TIMESTAMP_FAMILIES and not pre:
            max_pixels = max(min(max_pixels, VIDEO_MAX_PIXELS), min_pixels)
        tps = DEFAULT_TOKENS_PER_SECOND
        config_file = folder / "config.json"
        if family == "qwen2_5_vl" and config_file.exists():
            vision = json.loads(config_file.read_text()).get("vision_config") or {}
            tps = int(vision.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND))
        return cls(family, min_pixels, max_pixels, image.patch_size, image.merge_size,
                   image.temporal_patch_size, tps)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def timestamps(self) -> bool:
        return self.family in TIMESTAMP_FAMILIES

    def resized_size(self, height: int, width: int, num_frames: int) -> tuple[int, int]:
        """(height, width) every sampled frame is resized to; ValueError for a frame the
        model cannot take (aspect ratio)."""
        if not self.timestamps:
            return image_smart_resize(height, width, self.factor, self.min_pixels,
                                      self.max_pixels)
        return clip_smart_resize(num_frames, height, width, self.factor,
                                 self.temporal_patch_size, self.min_pixels, self.max_pixels)

    def layout(self, indices: list[int], source_fps: float, total_frames: int,
               height: int, width: int) -> VideoLayout:
        """The layout of frames `indices` (of a clip of `total_frames` at `source_fps`)
        resized to height x width."""
        tp = self.temporal_patch_size
        groups = -(-len(indices) // tp)
        grid = (groups, height // self.patch_size, width // self.patch_size)
        if self.timestamps:
            padded = list(indices) + [indices[-1]] * (groups * tp - len(indices))
            seconds = [i / source_fps for i in padded]
            stamps = tuple(f"<{(seconds[g * tp] + seconds[g * tp + tp - 1]) / 2:.1f} seconds>"
                           for g in range(groups))
            return VideoLayout(grid, (0,) * groups, stamps, self.merge_size)
        if self.family == "qwen2_5_vl":
            # transformers: second_per_grid_t = temporal_patch / sampled fps, in float32;
            # position = (t * (tokens_per_second * second_per_grid_t)).long(), in float32
            sampled_fps = len(indices) / total_frames * source_fps
            interval = np.float32(self.tokens_per_second) * np.float32(tp / sampled_fps)
            positions = (np.arange(groups, dtype=np.float32) * interval).astype(np.int64)
            return VideoLayout(grid, tuple(int(p) for p in positions), (), self.merge_size)
        return VideoLayout(grid, tuple(range(groups)), (), self.merge_size)


def clip_smart_resize(num_frames: int, height: int, width: int, factor: int,
                      temporal_factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video resize target: like the image rule, with the bounds on the whole
    clip (frames rounded to the temporal patch x height x width). transformers' rounding."""
    if num_frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, it has {num_frames}")
    if height < 1 or width < 1:
        raise ValueError(f"video frames are empty ({width}x{height} pixels)")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"video aspect ratio {max(height, width) / min(height, width):.1f} "
                         f"is above {MAX_ASPECT_RATIO} ({width}x{height} pixels)")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
