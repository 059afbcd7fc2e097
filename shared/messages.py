"""Every message that crosses the API <-> engine process boundary.

Small typed structs only. Image pixels travel as resized uint8 arrays (R6) that the rpc codec
sends as out-of-band zmq frames; nothing here is ever pickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.sampling_params import SamplingParams


@dataclass
class ImageInput:
    """One resized image: uint8 pixels of shape (H, W, 3); H and W are multiples of
    patch_size * merge_size. grid_thw is (1, H // patch_size, W // patch_size)."""

    pixels: np.ndarray
    grid_thw: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return int(self.pixels.nbytes)


@dataclass
class GenerateRequest:
    """Sent by the API process to start a request (a server-streaming `generate` call).

    prompt_token_ids already has each image's placeholder expanded to its token count."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = field(default_factory=list)


@dataclass
class RequestOutput:
    """One item of a `generate` stream: the tokens a request gained in one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    error: str | None = None


@dataclass
class EngineStats:
    """Answer to the `stats` call."""

    num_waiting: int
    num_running: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    mm_bytes_held: int
    num_requests_finished: int = 0


WIRE_TYPES: tuple[type, ...] = (
    SamplingParams,
    ImageInput,
    GenerateRequest,
    RequestOutput,
    EngineStats,
)
