"""Generated test images: a small pool made up front, and a distinct variant per request.

Nothing is downloaded. Each variant stamps a request-specific block into a copy of a pool
image and encodes it (JPEG and PNG alternating), so every request carries new pixels and new
bytes while the client's own memory stays at the pool's size.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

KINDS = ("shapes", "noise", "stripes", "gradient")
FORMATS = ("JPEG", "PNG")
MIME = {"JPEG": "image/jpeg", "PNG": "image/png"}
POOL_BYTES = 64 << 20  # keep the decoded pool below this, whatever the image size


@dataclass(frozen=True)
class EncodedImage:
    data: bytes
    format: str  # "JPEG" or "PNG"

    @property
    def mime(self) -> str:
        return MIME[self.format]

    def data_url(self) -> str:
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"


def make_image(kind: str, size: int, rng: np.random.Generator) -> np.ndarray:
    """One (size, size, 3) uint8 image of the given kind."""
    if kind == "noise":
        return rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    if kind == "gradient":
        ramp = np.linspace(0, 255, size, dtype=np.float32)
        x, y = np.meshgrid(ramp, ramp)
        phase = rng.uniform(0, 255)
        channels = (x, y, (x + y + phase) % 256)
        return np.stack(channels, axis=-1).astype(np.uint8)
    image = Image.new("RGB", (size, size), tuple(int(c) for c in rng.integers(160, 256, 3)))
    draw = ImageDraw.Draw(image)
    if kind == "shapes":
        for _ in range(12):
            x0, y0 = (int(v) for v in rng.integers(0, size, 2))
            w, h = (int(v) for v in rng.integers(size // 16 + 1, size // 3 + 2, 2))
            color = tuple(int(c) for c in rng.integers(0, 256, 3))
            box = (x0, y0, x0 + w, y0 + h)
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
        return np.asarray(image)
    if kind == "stripes":  # text-like: lines of dark dashes of word-like lengths
        line = max(4, size // 40)
        ink = tuple(int(c) for c in rng.integers(0, 80, 3))
        for top in range(line, size - line, 2 * line):
            x = line
            while x < size - line:
                word = int(rng.integers(line, 6 * line))
                draw.rectangle((x, top, min(x + word, size - line), top + line - 1), fill=ink)
                x += word + line
        return np.asarray(image)
    raise ValueError(f"unknown image kind {kind!r}")


class ImagePool:
    """Base images made once; `variant(index)` encodes a distinct image for each index."""

    def __init__(self, size: int, count: int = 8, seed: int = 0):
        self.size = size
        count = max(2, min(count, POOL_BYTES // (size * size * 3)))
        rng = np.random.default_rng(seed)
        self.images = [make_image(KINDS[i % len(KINDS)], size, rng) for i in range(count)]
        self.seed = seed

    def __len__(self) -> int:
        return len(self.images)

    def format_of(self, index: int) -> str:
        return FORMATS[index % len(FORMATS)]

    def variant(self, index: int) -> EncodedImage:
        # Consecutive indices share a base image in both formats, then move on to the next.
        base = self.images[(index // len(FORMATS)) % len(self.images)]
        pixels = base.copy()
        rng = np.random.default_rng((self.seed, index))
        block = max(4, self.size // 32)
        y, x = (int(v) for v in rng.integers(0, self.size - block + 1, 2))
        pixels[y:y + block, x:x + block] = rng.integers(0, 256, (block, block, 3), dtype=np.uint8)
        fmt = self.format_of(index)
        buffer = io.BytesIO()
        if fmt == "JPEG":
            Image.fromarray(pixels).save(buffer, format="JPEG", quality=90)
        else:
            Image.fromarray(pixels).save(buffer, format="PNG", compress_level=1)
        return EncodedImage(buffer.getvalue(), fmt)
