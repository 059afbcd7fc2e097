"""The vision tower against transformers' `model.visual` on the same weights, for every
family case; grids are written in merge units (`vl.grid`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.vision_utils import get_vision_window_index

from engine_proc.image_processor import pixels_to_patches
from engine_proc.models.qwen2_5_vl_vision import _host_layout
from engine_proc.models.vision_tower import stage_bounds
from tests.tolerance import tolerance_for

pytestmark = pytest.mark.numeric


def _patches(vl, grids, seed=0):
    grids = [vl.grid(*g) if len(g) == 2 else g for g in grids]
    images = [vl.pixels(g, seed=seed + i) for i, g in enumerate(grids)]
    patches = torch.cat(
        [pixels_to_patches(px, g, vl.cfg.image) for px, g in zip(images, grids, strict=True)]
    )
    return images, patches, grids


@pytest.mark.parametrize(
    "grids",
    [
        [(4, 4)],  # exactly one window (Qwen2.5-VL)
        [(8, 12)],  # whole windows only: no mask
        [(5, 7)],  # partial edge windows
        [(1, 20)],  # one row of merge units
        [(3, 3), (3, 3)],  # equal sizes: batched full attention
        [(4, 6), (7, 3), (2, 2)],  # different sizes
    ],
)
def test_vision_tower_matches_hf(vl, grids):
    images, patches, grids = _patches(vl, grids)
    with torch.no_grad():
        expected = vl.hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
    ours = vl.model.visual(patches, tuple(grids))
    torch.testing.assert_close(ours, expected, **vl.vision_tolerance(expected, grids))
    split = vl.model.encode_images(images, grids)
    unit = vl.cfg.vision.spatial_merge_size**2
    assert [e.shape[0] for e in split] == [t * h * w // unit for t, h, w in grids]
    # one image's rows at a time take other GEMM blockings than the whole batch's
    torch.testing.assert_close(torch.cat(split), ours, **vl.vision_tolerance(ours, grids))


@pytest.mark.parametrize("grids", [[(5, 7)], [(4, 6), (7, 3), (2, 2)]])
def test_vision_tower_through_varlen_spans_matches_hf(vl, grids, monkeypatch):
    """Images (and Qwen2.5-VL's windows, edge windows short) packed back to back for one
    varlen call per block, as on a GPU, here through the SDPA reference: the spans' offsets
    and the windows' order and its inverse give transformers' tower."""
    from engine_proc.layers import varlen_attention
    from engine_proc.models import vision_tower

    calls = []

    def reference(*args, **kwargs):
        calls.append(args[3].tolist())
        return varlen_attention.varlen_reference(*args, **kwargs)

    monkeypatch.setattr(vision_tower, "varlen_kernel", lambda device, dtype, head_dim: reference)
    images, patches, grids = _patches(vl, grids)
    with torch.no_grad():
        expected = vl.hf.model.visual(patches, grid_thw=torch.tensor(grids)).pooler_output
    ours = vl.model.visual(patches, tuple(grids))
    torch.testing.assert_close(ours, expected, **vl.vision_tolerance(expected, grids))
    image_spans = [0, *np.cumsum([t * h * w for t, h, w in grids]).tolist()]
    assert len(calls) == len(vl.model.visual.blocks) and image_spans in calls
    if hasattr(vl.model.visual, "window_units"):  # windowed blocks took the windows' spans
        assert any(c != image_spans for c in calls)


@pytest.mark.gpu
def test_cuda_bf16_tower_through_flash_varlen_follows_its_sdpa_path(vl, monkeypatch):
    """On a GPU in bf16 the images and windows go through FlashAttention's varlen call; the
    same tower through SDPA (padded windows, masks) gives the same embeddings within bf16's
    rounding (each path rounds every op once: ~20 a block)."""
    from engine_proc.layers.varlen_attention import varlen_kernel
    from engine_proc.models import vision_tower
    from engine_proc.models.registry import model_class
    from tests.tolerance import rms, tolerance

    device = torch.device("cuda")
    assert varlen_kernel(device, torch.bfloat16, vl.cfg.vision.head_dim) is not None
    model = model_class(vl.cfg)(vl.cfg, device, torch.bfloat16)
    model.load_weights(vl.path)
    _, patches, grids = _patches(vl, [(5, 7), (4, 6), (2, 2)])
    patches = patches.to(device, torch.bfloat16)
    with torch.no_grad():
        flash = model.visual(patches, tuple(grids)).float()
        monkeypatch.setattr(vision_tower, "varlen_kernel", lambda device, dtype, head_dim: None)
        sdpa = model.visual(patches, tuple(grids)).float()
    bound = tolerance(torch.bfloat16, 1, depth=20 * (vl.cfg.vision.depth + 1), scale=rms(sdpa))
    torch.testing.assert_close(flash, sdpa, **bound)


def test_encode_images_embeds_large_images_piece_by_piece(vl, monkeypatch):
    import engine_proc.models.qwen_vl as qwen

    images, patches, grids = _patches(vl, [(8, 12), (5, 7)])
    ours = vl.model.visual(patches, tuple(grids))
    chunk = 2 * grids[0][2] * vl.cfg.vision.spatial_merge_size
    monkeypatch.setattr(qwen, "PATCH_CHUNK", chunk)  # two merge-unit rows of the first image
    pieces = []
    embed = vl.model.visual.patch_embed.forward
    monkeypatch.setattr(vl.model.visual.patch_embed, "forward",
                        lambda x: pieces.append(len(x)) or embed(x))
    split = vl.model.encode_images(images, grids)
    assert max(pieces) <= chunk and sum(pieces) == len(patches)
    torch.testing.assert_close(torch.cat(split), ours, **vl.vision_tolerance(ours, grids))


def test_still_images_are_embedded_from_one_frame(vl, monkeypatch):
    # An image's temporal patch is two copies of it: the tower embeds one frame with the
    # kernel summed over time, and gets what the conv over both copies gives.
    images, patches, grids = _patches(vl, [(4, 6), (3, 3)])
    embed = vl.model.visual.patch_embed
    widths = []
    forward = embed.forward
    monkeypatch.setattr(embed, "forward", lambda x: widths.append(x.shape[1]) or forward(x))
    split = vl.model.encode_images(images, grids)
    p = vl.cfg.vision.patch_size
    assert set(widths) == {3 * p * p} and patches.shape[1] == 3 * 2 * p * p
    whole = vl.model.visual(patches, tuple(grids))
    torch.testing.assert_close(torch.cat(split), whole, **vl.vision_tolerance(whole, grids))
    frame = torch.cat([pixels_to_patches(px, g, vl.cfg.image, still=True)
                       for px, g in zip(images, grids, strict=True)])
    # the summed kernel rounds once more and the conv sums half the terms: the conv's bound
    two_frames = forward(patches)
    torch.testing.assert_close(forward(frame), two_frames,
                               **tolerance_for(two_frames, patches.shape[1]))


def test_bf16_patch_embedding_keeps_both_frames(vl):
    bf16 = type(vl.model.visual.patch_embed)(vl.cfg.vision).to(torch.bfloat16)
    assert not bf16.takes_still  # summing the kernel in bf16 would round it once more


def test_encode_images_gives_each_image_its_own_storage(vl):
    images, _, grids = _patches(vl, [(2, 2), (2, 4)])
    embeds = vl.model.encode_images(images, grids)
    for e in embeds:
        assert e.untyped_storage().nbytes() == e.numel() * e.element_size()
    assert vl.model.encode_images([], []) == []


@pytest.mark.parametrize("grids", [[(5, 7)], [(8, 8), (1, 3), (11, 4)]])
def test_windows_hold_the_same_patches_as_hf(vl, grids):
    if not vl.cfg.vision.window_size:
        pytest.skip("no window attention in this family")
    grids = [vl.grid(*g) for g in grids]
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
    images, patches, (grid,) = _patches(vl, [(2, 20)])
    with torch.no_grad():
        expected = vl.hf.model.visual(patches, grid_thw=torch.tensor([grid])).pooler_output
    torch.testing.assert_close(vl.model.visual(patches, (grid,)), expected,
                               **vl.vision_tolerance(expected, [grid]))
    assert rotary.max_side >= grid[2]


def test_stages_run_the_whole_tower(vl):
    """A large image encoded stage by stage (`encode_stage`, as the runner does over several
    steps) gives the embeddings of one pass."""
    images, _, (grid,) = _patches(vl, [(6, 8)])
    whole = vl.model.encode_images(images, [grid])[0]
    stages = vl.model.visual.stages
    assert vl.model.num_vision_stages == len(stages) >= 2
    assert [a for a, _ in stages[1:]] == [b for _, b in stages[:-1]]
    assert stages[0][0] == 0 and stages[-1][1] == vl.cfg.vision.depth
    with torch.no_grad():
        hidden = vl.model.embed_patches(images[0], grid)
        for stage in range(vl.model.num_vision_stages):
            hidden = vl.model.encode_stage(hidden, grid, stage)
    torch.testing.assert_close(hidden, whole, **vl.vision_tolerance(whole, [grid]))


def test_stage_bounds():
    # windowed towers end each stage at a full-attention block
    assert stage_bounds(4, frozenset({1, 3})) == [(0, 2), (2, 4)]
    assert stage_bounds(32, frozenset({7, 15, 23, 31})) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    # full attention everywhere: about four runs of equal blocks, not one per block
    assert stage_bounds(32, frozenset(range(32))) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert stage_bounds(4, frozenset(range(4))) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [b - a for a, b in stage_bounds(5, frozenset(range(5)))] == [1, 1, 2, 1]
    assert stage_bounds(2, frozenset(range(2))) == [(0, 1), (1, 2)]
