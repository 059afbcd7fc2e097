"""Qwen-VL image resizing for the API process (numpy and PIL only, no torch).

The API process resizes; what crosses to the engine is the resized uint8 image and its
patch grid (R6), and the engine normalizes and patchifies on its device
(engine_proc/image_processor.py). Together they equal transformers' PIL-backend
Qwen2VLImageProcessor `pixel_values`: same RGB conversion (transparency composited on
white), same `smart_resize` target, same PIL bicubic resize.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from shared.model_config import ImageProcessorConfig

MAX_ASPECT_RATIO = 200


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels,
    max_pixels] (up to the rounding to multiples), aspect ratio kept as well as possible.
    Transformers' rules and rounding, so results match its processor exactly."""
    if height < 1 or width < 1:
        raise ValueError(f"image is empty ({width}x{height} pixels)")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image aspect ratio {max(height, width) / min(height, width):.1f} is above "
            f"{MAX_ASPECT_RATIO} ({width}x{height} pixels)"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB the way transformers converts: anything with transparency over white. An RGB
    image without transparency comes back as it is (convert would copy it: 4 bytes a pixel,
    67 MB for a 4096x4096 photo, for nothing)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    if img.mode == "RGB":
        return img
    return img.convert("RGB")


def resize_image(
    img: Image.Image, cfg: ImageProcessorConfig
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """-> (uint8 [H, W, 3] resized RGB pixels, (grid_t, grid_h, grid_w) in patches)."""
    rgb = to_rgb(img)
    height, width = smart_resize(rgb.height, rgb.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    # Already at the model's size: no resize (PIL's would return a full copy).
    resized = rgb if rgb.size == (width, height) else rgb.resize(
        (width, height), resample=Image.Resampling.BICUBIC)
    pixels = np.asarray(resized, dtype=np.uint8)
    if not pixels.flags.writeable:  # Pillow's array interface hands out read-only bytes
        pixels = pixels.copy()
    return pixels, (1, height // cfg.patch_size, width // cfg.patch_size)
