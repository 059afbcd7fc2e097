"""Generated test videos: a distinct short clip per request, for the video workloads of the
soak test and the serving benchmark.

Nothing is downloaded. Each variant takes frames of a pool image, stamps a request-specific
block into each frame (moving a little every frame) and encodes them as H.264 in MP4 with
PyAV, so every request carries new frames and new bytes while the client's own memory stays
at the pool's size.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import av
import numpy as np

from flatserve.soak.images import ImagePool


@dataclass(frozen=True)
class EncodedVideo:
    data: bytes

    def data_url(self) -> str:
        return f"data:video/mp4;base64,{base64.b64encode(self.data).decode('ascii')}"


class VideoPool:
    """`variant(index)`: a distinct clip of `frames` frames of size x size at `fps`."""

    def __init__(self, size: int, frames: int = 16, fps: int = 4, seed: int = 0):
        self.size = size - size % 2  # H.264 in 4:2:0 takes even sides
        self.frames = frames
        self.fps = fps
        self.seed = seed
        self.images = ImagePool(self.size, count=4, seed=seed)

    def variant(self, index: int) -> EncodedVideo:
        base = self.images.images[index % len(self.images)]
        rng = np.random.default_rng((self.seed, index))
        block = max(4, self.size // 16)
        y, x = (int(v) for v in rng.integers(0, self.size - block + 1, 2))
        stamp = rng.integers(0, 256, (block, block, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        with av.open(buffer, mode="w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=self.fps)
            stream.width = stream.height = self.size
            stream.pix_fmt = "yuv420p"
            stream.options = {"preset": "ultrafast"}
            for i in range(self.frames):
                pixels = base.copy()
                top, left = (y + i) % (self.size - block + 1), (x + 2 * i) % (self.size - block + 1)
                pixels[top:top + block, left:left + block] = stamp
                for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        return EncodedVideo(buffer.getvalue())
