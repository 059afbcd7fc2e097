"""One request's state inside the engine: tokens, KV blocks, progress and its images (a
video's temporal groups are images here: each its own span, encoded and freed alone)."""

from __future__ import annotations

import time
from enum import Enum, auto
from itertools import count

import numpy as np
import torch

from engine_proc.thinking_budget import ThinkingBudget
from shared.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class ImageSpan:
    """One image of a prompt: its uint8 pixels until encoded, its embeddings until the
    chunk that covers its last placeholder token has run, then nothing (R3). An image
    encoded over several steps (see `Scheduler`) holds, between them, the vision tower's
    hidden states instead of its pixels. An image whose placeholder tokens all lie in a
    cached prefix (prefix caching) is released at admission, never encoded."""

    __slots__ = ("grid_thw", "offset", "length", "key", "pixels", "hidden", "stages_done",
                 "embeds", "video", "temporal_pos", "__weakref__")

    def __init__(
        self, pixels: np.ndarray, grid_thw: tuple[int, int, int], offset: int, length: int,
        key: bytes = b"", video: bool = False, temporal_pos: int = 0,
    ):
        self.key = key  # content key (shared/image_key.py): what caches look it up by
        # a video's temporal group (pixels [frames, H, W, 3]): its mRoPE temporal position
        # from its video's first token (shared/messages.py ImageInput)
        self.video = video
        self.temporal_pos = temporal_pos
        self.pixels: np.ndarray | None = pixels
        self.grid_thw = grid_thw
        self.offset = offset  # prompt index of the first placeholder token
        self.length = length  # number of placeholder tokens
        self.hidden: torch.Tensor | None = None  # vision hidden states between stages
        self.stages_done = 0
        self.embeds: torch.Tensor | None = None  # [length, hidden * (1 + DeepStack taps)], device

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def released(self) -> bool:
        return self.pixels is None and self.hidden is None and self.embeds is None

    @property
    def nbytes(self) -> int:
        n = 0 if self.pixels is None else int(self.pixels.nbytes)
        for tensor in (self.hidden, self.embeds):
            if tensor is not None:
                n += tensor.numel() * tensor.element_size()
        return n

    def release(self) -> None:
        self.pixels = None
        self.hidden = None
        self.embeds = None


class Sequence:
    _ids = count()

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        images: list[ImageSpan] | None = None,
    ):
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling = sampling
        # thinking_token_budget: what it has thought (engine_proc/thinking_budget.py)
        self.thinking = (None if sampling.thinking_token_budget is None
                         else ThinkingBudget(sampling, self.token_ids))
        # whether sampling changes its logits (engine_proc/logits_adjustments.py)
        self.adjusts_logits = bool(
            sampling.has_penalties or sampling.logit_bias or sampling.min_tokens
            or self.thinking is not None
        )
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V is in the cache
        self.block_table: list[int] = []
        # prefix caching: hashes of the full blocks hashed so far (engine_proc/block_hash.py),
        # and how many leading blocks of block_table the block manager holds as cached
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.state_slot = -1  # hybrid models: its recurrent state slot while running
        # hybrid prefix caching: (snapshot, block hash) of its latest decoding snapshot
        self.decode_snapshot: tuple[int, bytes] | None = None
        self.images: list[ImageSpan] = images or []
        self.has_images = bool(self.images)
        # mRoPE positions of the prompt ([3, num_prompt_tokens]) and the offset for later
        # tokens; None for text-only prompts, whose positions are plain indices.
        self.mrope_positions: np.ndarray | None = None
        self.mrope_delta = 0
        self.generator: torch.Generator | None = None
        self.num_preemptions = 0
        self.arrived_at = time.monotonic()
        self.scheduled_at: float | None = None  # first admitted to the running batch
        self.num_cached_tokens = 0  # of its prompt, found in the prefix cache then
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.error_code = 0  # shared.messages.ErrorCode, when error is set (0: INTERNAL)
        # structured outputs: the compile of its grammar until done, then its matcher
        self.grammar_future = None
        self.grammar = None
        # prompt_logprobs: one entry per prompt token after the first, computed chunk by
        # chunk during prefill; handed to the first output, then None
        self.prompt_logprobs: list | None = [] if sampling.prompt_logprobs is not None else None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities are still to be computed (its prefill needs them)."""
        return (self.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def mm_bytes(self) -> int:
        return sum(image.nbytes for image in self.images) if self.has_images else 0

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def release_multimodal(self) -> None:
        """R3: drop every reference to pixels and embeddings this sequence holds."""
        for image in self.images:
            image.release()

    def release_consumed_images(self) -> None:
        """R3: drop the images whose placeholder tokens are all in the KV cache now."""
        for image in self.images:
            if image.end <= self.num_computed_tokens and not image.released:
                image.release()
