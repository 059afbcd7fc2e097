"""Tiny video clips made in the tests with PyAV (no file ships with the project)."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
from PIL import Image


def frame_pixels(i: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """Frame `i`: noise (so every codec keeps detail) with the frame index in red and a
    white mark in the top-left corner (to see rotations)."""
    rng = np.random.default_rng(seed * 1000 + i)
    img = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    img[..., 0] = (i * 37) % 256
    img[: height // 4, : width // 4] = 255
    return img


def make_clip(num_frames: int = 6, width: int = 96, height: int = 64, fps: int = 4,
              codec: str = "libx264", container: str = "mp4", rotation: int | None = None,
              seed: int = 0, audio_only: bool = False) -> bytes:
    if audio_only:
        return _audio_clip(container)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = "rgb24" if codec == "png" else "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "g": "4"}
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, width, height, seed),
                                               format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _audio_clip(container: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream("aac", rate=8000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 4096), dtype=np.float32), format="fltp",
                                           layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def decoded_frames(data: bytes) -> list[np.ndarray]:
    """Every frame of a clip as rgb24, as stored (no rotation)."""
    with av.open(io.BytesIO(data)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def frame_list_url(frames: list[bytes]) -> str:
    """vLLM's frame-list form: data:video/jpeg;base64,<f1>,<f2>,..."""
    return "data:video/jpeg;base64," + ",".join(base64.b64encode(f).decode() for f in frames)
