"""3-D (temporal, height, width) rotary positions of a Qwen2-VL prompt, vectorized.

Same values as transformers' `get_rope_index` for images: text tokens count up by one on
all three axes; an image's placeholder tokens take (start + t, start + row, start + col)
over its merged grid, where start is the position the next text token would have had;
text after an image resumes at start + max(rows, cols). A decode token at index p gets
p + delta on every axis.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    shift = np.zeros(length + 1, dtype=np.int64)  # added to the index of tokens after a point
    starts = np.flatnonzero((ids[:-1] == vision_start_token_id) & (ids[1:] == image_token_id)) + 1
    if len(starts) != len(image_grids):
        raise ValueError(f"{len(starts)} images in the prompt but {len(image_grids)} grids")
    m = spatial_merge_size
    spans = []
    for start, (t, h, w) in zip(starts.tolist(), image_grids, strict=True):
        gh, gw = h // m, w // m
        count = t * gh * gw
        end = start + count
        if end > length or not (ids[start:end] == image_token_id).all():
            raise ValueError(f"image at token {start} needs {count} placeholder tokens")
        spans.append((start, end, t, gh, gw))
        shift[end] += max(gh, gw) - count  # the image takes max(gh, gw) positions, not count
    positions = np.arange(length, dtype=np.int64) + np.cumsum(shift[:length])
    positions = np.broadcast_to(positions, (3, length)).copy()
    for start, end, t, gh, gw in spans:
        base = positions[0, start]
        grid = np.indices((t, gh, gw), dtype=np.int64).reshape(3, -1)
        positions[:, start:end] = grid + base
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta
