"""The vision tower against transformers' `model.visual` on the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.vision_utils import get_vision_window_index

from engine_proc.image_processor import pixels_to_patches
from engine_proc.models.qwen2_5_vl_vision import _host_layout


def _patches(vl, grids, seed=0):
    images = [vl.pixels(g, seed=seed + i) for i, g in enumerate(grids)]
    patches = torch.cat(
        [pixels_to_patches(px, g, vl.cfg.image) for px, g in zip(images, grids, strict=True)]
    )
    return images, patches


@pytest.mark.parametrize(
    "grids",
    [
        [(1, 8, 8)],  # exactly one window
        [(1, 16, 24)],  # whole windows only: no mask
        [(1, 10, 14)],  # partial edge windows
        [(1, 2, 40)],  # one row of merge units
        [(1, 6, 6), (1, 6, 6)],  # equal sizes: batched full attention
        [(1, 8, 12), (1, 14, 6), (1, 4, 4)],  # different sizes
    ],
)
def test_vision_tower_matches_hf(vl, grids):
    images, patches = _patches(vl, grids)
    with torch.no_grad():
        expected = vl.hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
    ours = vl.model.visual(patches, tuple(grids))
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    split = vl.model.encode_images(images, grids)
    assert [e.shape[0] for e in split] == [t * h * w // 4 for t, h, w in grids]
    torch.testing.assert_close(torch.cat(split), ours)


def test_encode_images_embeds_large_images_piece_by_piece(vl, monkeypatch):
    import engine_proc.models.qwen2_5_vl as qwen

    grids = [(1, 16, 24), (1, 10, 14)]
    images, patches = _patches(vl, grids)
    ours = vl.model.visual(patches, tuple(grids))
    monkeypatch.setattr(qwen, "PATCH_CHUNK", 48)  # two merge-unit rows of the first image
    pieces = []
    embed = vl.model.visual.patch_embed.forward
    monkeypatch.setattr(vl.model.visual.patch_embed, "forward",
                        lambda x: pieces.append(len(x)) or embed(x))
    split = vl.model.encode_images(images, grids)
    assert max(pieces) <= 48 and sum(pieces) == len(patches)
    torch.testing.assert_close(torch.cat(split), ours, atol=1e-5, rtol=1e-5)


def test_encode_images_gives_each_image_its_own_storage(vl):
    grids = [(1, 4, 4), (1, 4, 8)]
    images, _ = _patches(vl, grids)
    embeds = vl.model.encode_images(images, grids)
    for e in embeds:
        assert e.untyped_storage().nbytes() == e.numel() * e.element_size()
    assert vl.model.encode_images([], []) == []


@pytest.mark.parametrize("grids", [[(1, 10, 14)], [(1, 16, 16), (1, 2, 6), (1, 22, 8)]])
def test_windows_hold_the_same_patches_as_hf(vl, grids):
    merge, vcfg = vl.cfg.vision.spatial_merge_size, vl.cfg.vision
    units = vcfg.window_size // merge // vcfg.patch_size
    layout = _host_layout(tuple(grids), merge, units)
    window_index, cu = get_vision_window_index(
        torch.tensor(grids), merge, vcfg.window_size, vcfg.patch_size
    )
    unit_order = window_index.numpy()
    expected = [
        set((unit_order[a // 4 : b // 4, None] * 4 + np.arange(4)).reshape(-1).tolist())
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)
    ]
    got = []
    for w, row in enumerate(layout.window_gather):
        valid = (
            layout.window_valid[w] if layout.window_valid is not None else np.ones(len(row), bool)
        )
        got.append(set(row[valid].tolist()))
    assert got == expected
    # every patch sits in exactly one slot and the scatter index reads it back
    flat = layout.window_gather.reshape(-1)
    assert np.array_equal(flat[layout.window_scatter], np.arange(len(layout.window_scatter)))


def test_rotary_table_grows_for_long_grids(vl):
    rotary = vl.model.visual.rotary
    rotary._build(16)  # as if built for small images; grows on demand
    grid = (1, 4, 40)
    images, patches = _patches(vl, [grid])
    with torch.no_grad():
        expected = vl.hf.model.visual(patches, grid_thw=torch.tensor([grid])).pooler_output
    torch.testing.assert_close(vl.model.visual(patches, (grid,)), expected, atol=1e-4, rtol=1e-4)
    assert rotary.max_side >= 40
