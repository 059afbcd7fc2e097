"""3-D (temporal, height, width) rotary positions of a Qwen2-VL prompt, vectorized.

Same values as transformers' `get_rope_index` for images: text tokens count up by one on
all three axes; an image's placeholder tokens take (start + t, start + row, start + col)
over its merged grid, where start is the position the next text token would have had;
text after an image resumes at start + max(rows, cols). A video is a run of temporal groups
(`vision_positions`). A decode token at index p gets p + delta on every axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


def compute_mrope_positions(
    token_ids: Sequence[int] | np.ndarray,
    image_grids: list[tuple[int, int, int]],
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int,
) -> tuple[np.ndarray, int]:
    """-> (positions int64 [3, L], delta) with delta = max(positions) + 1 - L.

    Each image's placeholders start right after a vision_start token; images are matched
    to grids in order."""
    ids = np.asarray(token_ids, dtype=np.int64)
    length = ids.shape[0]
    starts = np.flatnonzero((ids[:-1] == vision_start_token_id) & (ids[1:] == image_token_id)) + 1
    if len(starts) != len(image_grids):
        raise ValueError(f"{len(starts)} images in the prompt but {len(image_grids)} grids")
    m = spatial_merge_size
    spans = []
    for start, (t, h, w) in zip(starts.tolist(), image_grids, strict=True):
        count = t * (h // m) * (w // m)
        if start + count > length or not (ids[start:start + count] == image_token_id).all():
            raise ValueError(f"image at token {start} needs {count} placeholder tokens")
        spans.append(VisionSpan(start, (t, h, w)))
    return vision_positions(length, spans, m)


class VisionSpan(NamedTuple):
    """One image, or one temporal group of a video, at prompt index `offset`."""

    offset: int
    grid_thw: tuple[int, int, int]
    temporal_pos: int = 0  # a video group's, from its video's first token
    joins_previous: bool = False  # continues the previous span's run (a Qwen2/2.5 video)


def vision_positions(length: int, spans: list[VisionSpan], merge: int) -> tuple[np.ndarray, int]:
    """-> (positions int64 [3, length], delta) for a prompt of `length` tokens whose vision
    placeholders are `spans` (in prompt order).

    Spans that join form one run (a Qwen2/2.5-VL video: its groups follow each other, group
    g at temporal position start + temporal_pos); a run's tokens sit at start + (t, row,
    col), start being the position the next text token would have had, and text after the
    run resumes at its largest position + 1 (for an image: start + max(rows, cols)). That
    is the original Qwen rule and vLLM's; transformers 5.24 resumes after a video at start
    + max(rows, cols) instead, which differs only when the temporal positions outrun the
    rows and columns (a long video)."""
    runs: list[list[VisionSpan]] = []
    for span in spans:
        if span.joins_previous and runs and _end(runs[-1][-1], merge) == span.offset:
            runs[-1].append(span)
        else:
            runs.append([span])
    shift = np.zeros(length + 1, dtype=np.int64)  # added to the index of tokens after a point
    for run in runs:
        first, last = run[0], run[-1]
        end = _end(last, merge)
        if end > length:
            raise ValueError(f"vision span at token {last.offset} runs past the prompt")
        extent = 1 + max(max(s.temporal_pos + s.grid_thw[0] - 1, s.grid_thw[1] // merge - 1,
                             s.grid_thw[2] // merge - 1) for s in run)
        shift[end] += extent - (end - first.offset)
    positions = np.arange(length, dtype=np.int64) + np.cumsum(shift[:length])
    positions = np.broadcast_to(positions, (3, length)).copy()
    for run in runs:
        base = positions[0, run[0].offset]
        for span in run:
            t, h, w = span.grid_thw
            grid = np.indices((t, h // merge, w // merge), dtype=np.int64).reshape(3, -1)
            grid[0] += span.temporal_pos
            positions[:, span.offset:_end(span, merge)] = grid + base
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def _end(span: VisionSpan, merge: int) -> int:
    t, h, w = span.grid_thw
    return span.offset + t * (h // merge) * (w // merge)
