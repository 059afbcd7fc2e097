"""Every message that crosses the API <-> engine process boundary, grouped by receiver.

Small typed structs only (rpc/codec.py puts them on the wire). An image travels as its
resized uint8 pixels (R6), sent as an out-of-band zmq frame; nothing here is ever pickled.

    API -> engine   AddRequest, AbortRequests, Ping
    engine -> API   StepOutputs: every request's new tokens of one engine step, plus stats
                    (also the answer to a Ping, then with the engine's memory plan)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from shared.memory_plan import MemoryPlan
from shared.sampling_params import SamplingParams


class ErrorCode(IntEnum):
    """Why the engine ended a request with finish_reason "error"; the API maps it to an
    HTTP status, never a message text."""

    NONE = 0
    REJECTED = 1  # the request cannot run on this engine (too long, malformed): 400
    BUSY = 2  # the engine holds as many requests as it takes: 503
    STOPPING = 3  # the engine is shutting down: 503
    INTERNAL = 4  # the model step failed: 500
    IMAGE_MISSING = 5  # an image sent without pixels is not in the encoder cache (any more):
    #                    the API sends the request again with the pixels; never reaches a client
    DROPPED = 6  # the engine aborted it when its API process went silent or stopped reading: 503


# ---- API -> engine ------------------------------------------------------------------------


@dataclass
class ImageInput:
    """One resized image (or one temporal group of a video, below): uint8 pixels of shape
    (H, W, 3); H and W are multiples of
    patch_size * merge_size. grid_thw is (1, H // patch_size, W // patch_size).
    `key` names the image's content (shared/image_key.py); empty, the engine hashes the
    pixels itself. Caches key on it: same key, same embeddings.
    `pixels` None: the engine's encoder cache holds this key (the API's mirror says so); the
    engine takes the cached embeddings or refuses with ErrorCode.IMAGE_MISSING."""

    pixels: np.ndarray | None
    grid_thw: tuple[int, int, int]
    key: bytes = b""
    # A video's temporal group (2 frames, the last one may have 1) is one of these too:
    # pixels [frames, H, W, 3], grid_thw (1, h, w), its placeholders are video tokens, and
    # `temporal_pos` is its mRoPE temporal position relative to the video's first token.
    # Groups whose placeholder runs touch (Qwen2/2.5-VL) form one run of positions.
    video: bool = False
    temporal_pos: int = 0

    def __post_init__(self) -> None:
        self.grid_thw = tuple(self.grid_thw)

    @property
    def nbytes(self) -> int:
        return 0 if self.pixels is None else int(self.pixels.nbytes)


@dataclass
class AddRequest:
    """Start a request. prompt_token_ids has each image's placeholder expanded to its
    token count. The engine answers with the request's outputs in later StepOutputs."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageInput] = field(default_factory=list)


@dataclass
class AbortRequests:
    """Stop these requests and free what they hold; no further output is sent for them."""

    request_ids: list[str]


@dataclass
class Ping:
    """Liveness probe; the engine answers with an empty StepOutputs."""


# ---- engine -> API ------------------------------------------------------------------------


# One generated token's log-probabilities: [of the token, [top ids], [their log-probs]]
TokenLogprobs = list
# One prompt token's (the second on): [its log-prob, its rank, [top ids], [their log-probs]]
PromptTokenLogprobs = list


@dataclass
class RequestOutput:
    """The tokens one request gained in one engine step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    error: str | None = None  # for logs and the client's message; the code decides
    error_code: int = ErrorCode.NONE
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked
    queued_s: float | None = None  # with its first token: seconds it waited to be scheduled
    # with its first token, when the request asked: one per prompt token after the first
    prompt_logprobs: list[PromptTokenLogprobs] | None = None


# vLLM's buckets of vllm:iteration_tokens_total (vllm/v1/metrics/buckets.py)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    mm_bytes_held: int
    num_requests_finished: int = 0
    max_requests: int = 0  # requests the engine takes at once (running + waiting)
    # prefix caching, cumulative since the engine started: prompt tokens looked up at
    # admission, and those found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    encoder_cache_bytes: int = 0
    encoder_cache_entries: int = 0
    encoder_cache_queries: int = 0  # images looked up, since the engine started
    encoder_cache_hits: int = 0  # images that skipped the vision tower
    num_preemptions: int = 0  # cumulative
    rss_bytes: int = 0  # of the engine process, refreshed about once a second
    kv_cache_bytes: int = 0  # allocated at start (this rank's share under TP)
    state_cache_bytes: int = 0  # hybrid models' recurrent state slots, allocated at start
    num_state_slots_free: int = 0
    # of num_waiting, those held back until their grammar compiles (vLLM's reason "deferred";
    # the others wait for room, its "capacity")
    num_waiting_deferred: int = 0
    # vllm:iteration_tokens_total, cumulative: steps that gave tokens, counted in the first
    # of ITERATION_TOKENS_BUCKETS they fit (one more count for those past the last), and the
    # sum of their token figures (engine_proc/iteration_tokens.py)
    iteration_tokens_counts: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # the KV cache's settings, for vllm:cache_config_info (fixed at start)
    block_size: int = 0
    enable_prefix_caching: bool = False  # in effect (hybrid models may turn it off)
    gpu_memory_utilization: float = 0.0  # as given; 0: not given
    cuda_graph_bytes: int = 0  # device memory the graphs took at capture (--no-enforce-eager)
    # cumulative: forwards the engine ran, those that replayed a decode graph, and those
    # that replayed mixed-step pieces (the others ran eagerly: more tokens than the pieces'
    # largest size, or graphs off)
    num_forward_steps: int = 0
    num_graph_steps: int = 0
    num_piecewise_steps: int = 0


@dataclass
class EncoderKeyNews:
    """What changed in the engine's encoder cache since the last message to this API
    process: forget every key first when `reset` (a first message, or too much news
    missed), then drop `removed`, then add `added`. A hint for skipping pixels, never
    trusted for correctness (see ErrorCode.IMAGE_MISSING)."""

    reset: bool = False
    added: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)


@dataclass
class StepOutputs:
    """One engine step's outputs for one API process, with the engine's current stats.
    An answer to a Ping also carries the engine's memory plan (shared/memory_plan.py),
    computed once at start: the launcher prints it and /metrics exports it."""

    outputs: list[RequestOutput]
    stats: EngineStats | None = None
    encoder_keys: EncoderKeyNews | None = None
    memory_plan: MemoryPlan | None = None


WIRE_TYPES: tuple[type, ...] = (
    SamplingParams, ImageInput, AddRequest, AbortRequests, Ping, RequestOutput, EngineStats,
    StepOutputs,
)
