"""API-side resize + engine-side patchify == transformers' PIL image processor (R6)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil

from engine_proc.image_processor import pixels_to_patch_chunks, pixels_to_patches
from shared.image_resize import resize_image, smart_resize
from shared.model_config import ImageProcessorConfig, load_model_config
from shared.random_checkpoints import ensure_checkpoint
from tests.engine_proc.families import CASE_IDS, CASES

CFG = ImageProcessorConfig(
    min_pixels=56 * 56,
    max_pixels=28 * 28 * 1280,
    patch_size=14,
    merge_size=2,
    temporal_patch_size=2,
    image_mean=(0.48145466, 0.4578275, 0.40821073),
    image_std=(0.26862954, 0.26130258, 0.27577711),
)


def _image(rng, width, height, mode):
    if mode == "P":
        img = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8), "L").convert(
            "P"
        )
        img.info["transparency"] = 7
        return img
    bands = len(Image.new(mode, (1, 1)).getbands())
    data = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if bands == 1 else data, mode)


def _assert_matches_hf(img, cfg, hf=None):
    hf = hf or Qwen2VLImageProcessorPil(
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        image_mean=list(cfg.image_mean),
        image_std=list(cfg.image_std),
    )
    expected = hf(images=img, return_tensors="np")
    pixels, grid = resize_image(img, cfg)
    assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
    assert grid == tuple(int(v) for v in expected["image_grid_thw"][0])
    patches = pixels_to_patches(torch.from_numpy(pixels), grid, cfg)
    assert patches.dtype == torch.float32
    # a table lookup computed with transformers' arithmetic (image_processor.py): no sums
    np.testing.assert_array_equal(patches.numpy(), expected["pixel_values"])


@pytest.mark.parametrize(
    "width,height,mode",
    [
        (448, 448, "RGB"),
        (640, 480, "RGB"),
        (517, 333, "RGBA"),  # alpha over white
        (90, 1600, "L"),  # tall, grayscale
        (3000, 64, "P"),  # wide, palette with a transparent index
        (57, 29, "LA"),
        (1, 1, "RGB"),  # upscaled to min_pixels
        (1500, 2000, "RGB"),  # downscaled to max_pixels
        (31, 6000, "CMYK"),
    ],
)
def test_resize_and_patchify_equal_hf(rng, width, height, mode):
    _assert_matches_hf(_image(rng, width, height, mode), CFG)


@pytest.mark.parametrize(
    "min_pixels,max_pixels",
    [(28 * 28 * 4, 28 * 28 * 16), (200 * 200, 400 * 400), (56 * 56, 12845056)],
)
def test_pixel_bounds_equal_hf(rng, min_pixels, max_pixels):
    cfg = dataclasses.replace(CFG, min_pixels=min_pixels, max_pixels=max_pixels)
    for width, height in ((300, 200), (50, 70), (1000, 900)):
        _assert_matches_hf(_image(rng, width, height, "RGB"), cfg)


@pytest.mark.parametrize("preset", CASES, ids=CASE_IDS)
def test_each_family_checkpoint_equals_its_hf_processor(rng, preset):
    """The processor transformers loads from each family's checkpoint folder (its
    preprocessor_config.json, patch and merge sizes included) against ours from the same
    folder."""
    path = ensure_checkpoint(preset)
    cfg = load_model_config(path).image
    hf = Qwen2VLImageProcessorPil.from_pretrained(path)
    assert (hf.patch_size, hf.merge_size) == (cfg.patch_size, cfg.merge_size)
    for width, height, mode in ((448, 448, "RGB"), (517, 333, "RGBA"), (57, 29, "L")):
        _assert_matches_hf(_image(rng, width, height, mode), cfg, hf)


def test_smart_resize_keeps_factor_and_bounds():
    for height, width in ((448, 448), (1024, 1024), (100, 20000), (3000, 17), (28, 28)):
        h, w = smart_resize(height, width, 28, CFG.min_pixels, CFG.max_pixels)
        assert h % 28 == 0 and w % 28 == 0
        assert h * w <= CFG.max_pixels
    assert smart_resize(448, 448, 28, CFG.min_pixels, CFG.max_pixels) == (448, 448)
    assert smart_resize(1024, 1024, 28, CFG.min_pixels, CFG.max_pixels) == (980, 980)
    assert smart_resize(1024, 1024, 28, CFG.min_pixels, 28 * 28 * 16384) == (1036, 1036)


def test_smart_resize_refuses_extreme_aspect_and_empty_images():
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2001, 28, CFG.min_pixels, CFG.max_pixels)
    with pytest.raises(ValueError, match="empty"):
        smart_resize(0, 100, 28, CFG.min_pixels, CFG.max_pixels)
    with pytest.raises(ValueError, match="aspect ratio"):
        resize_image(Image.new("RGB", (4000, 10)), CFG)


def test_pixels_to_patches_checks_shape_and_dtype():
    pixels = torch.zeros(56, 84, 3, dtype=torch.uint8)
    assert pixels_to_patches(pixels, (1, 4, 6), CFG).shape == (24, 3 * 2 * 14 * 14)
    with pytest.raises(ValueError, match="shape"):
        pixels_to_patches(pixels, (1, 6, 4), CFG)
    with pytest.raises(ValueError, match="uint8"):
        pixels_to_patches(pixels.float(), (1, 4, 6), CFG)


@pytest.mark.parametrize("max_patches", [1, 24, 25, 100, 10_000])
def test_patch_chunks_are_the_whole_result_in_order(rng, max_patches):
    pixels, grid = resize_image(_image(rng, 300, 200, "RGB"), CFG)
    whole = pixels_to_patches(torch.from_numpy(pixels), grid, CFG)
    chunks = list(pixels_to_patch_chunks(torch.from_numpy(pixels), grid, CFG, max_patches))
    band = CFG.merge_size * grid[2]  # patches in one row of merge units
    assert all(len(c) <= max(max_patches, band) for c in chunks)
    torch.testing.assert_close(torch.cat(chunks), whole, rtol=0, atol=0)


def test_patch_chunks_check_the_grid():
    pixels = torch.zeros(56, 84, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="shape"):
        next(pixels_to_patch_chunks(pixels, (1, 6, 4), CFG, 8))
    with pytest.raises(ValueError, match="merge units"):
        next(pixels_to_patch_chunks(torch.zeros(42, 84, 3, dtype=torch.uint8), (1, 3, 6), CFG, 8))


@pytest.mark.gpu
def test_pixels_to_patches_on_cuda_equals_cpu(rng):
    pixels, grid = resize_image(_image(rng, 640, 480, "RGB"), CFG)
    host = pixels_to_patches(torch.from_numpy(pixels), grid, CFG)
    device = pixels_to_patches(torch.from_numpy(pixels).cuda(), grid, CFG)
    assert device.is_cuda
    torch.testing.assert_close(device.cpu(), host, rtol=0, atol=0)
