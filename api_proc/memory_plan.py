"""The API process's memory plan (shared/memory_plan.py): its RSS ceiling from its budgets.

Its RSS at start (the app built, the tokenizer loaded) plus what its
budgets let it hold: the image bytes admission lets in (R4: bodies, decoding and resizing,
resized pixels, all in one budget), the small bodies read below that budget's threshold, the
state of every request the engines can hold (R2: ids, counters, detokenizer state), the
media pool's threads and what glibc may keep freed. Admission keeps the first term, the
engines' capacity (max seqs + max waiting) the third.
"""

from __future__ import annotations

import resource
from collections.abc import Sequence
from dataclasses import dataclass

from api_proc.config import ApiConfig
from api_proc.request_body import BODY_ADMISSION_MIN_BYTES
from shared.engine_config import EngineConfig
from shared.memory import API_MALLOC_ENV
from shared.memory_plan import MemoryPart, MemoryPlan

# The objects a request keeps in this process while an engine runs it: its HTTP connection
# (uvicorn's protocol and transport buffers), its task and coroutine frames, its stream and
# response writer. tests/api_proc/test_memory_plan.py measures 31 KiB of Python allocations
# per streamed request held at an engine (tracemalloc); twice that leaves room for the native
# buffers tracemalloc does not see.
REQUEST_OBJECTS_BYTES = 64 << 10
# Per completion token of a running request: its id in the detokenizer's window or in the
# outputs merged for a slow reader (a list entry and an int object, 36 bytes), and its text
# in a non-streamed response (a few bytes of str).
TOKEN_STATE_BYTES = 48
DEFAULT_THREAD_STACK_BYTES = 8 << 20  # glibc's when RLIMIT_STACK is unlimited


@dataclass(frozen=True)
class EngineCapacity:
    """What one engine holds at once: running sequences and all requests (running + waiting)."""

    max_num_seqs: int
    max_requests: int

    @classmethod
    def of(cls, config: EngineConfig) -> EngineCapacity:
        return cls(config.max_num_seqs, config.max_num_seqs + config.max_waiting)


def api_plan(config: ApiConfig, engines: Sequence[EngineCapacity], start_rss: int) -> MemoryPlan:
    requests = sum(e.max_requests for e in engines) + config.max_unread_bodies
    running = sum(e.max_num_seqs for e in engines)
    parts = (
        MemoryPart("runtime", start_rss, "RSS at start"),
        MemoryPart("media in flight", config.mm_inflight_budget, "--mm-inflight-budget"),
        MemoryPart("small bodies", config.max_unread_bodies * BODY_ADMISSION_MIN_BYTES,
                   "--max-unread-bodies x 64 KiB (larger ones are in the budget)"),
        MemoryPart("request state",
                   requests * REQUEST_OBJECTS_BYTES
                   + running * config.max_model_len * TOKEN_STATE_BYTES,
                   "requests engines hold x 64 KiB + running x max len x 48 B"),
        MemoryPart("media pool", config.num_media_workers * thread_stack_bytes(),
                   "--media-workers x thread stack"),
        MemoryPart("allocator slack", allocator_slack_bytes(), "arenas x trim threshold"),
    )
    return MemoryPlan("api", parts)


def thread_stack_bytes() -> int:
    """The most stack one thread may touch: RLIMIT_STACK, glibc's size for new threads."""
    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    return DEFAULT_THREAD_STACK_BYTES if soft == resource.RLIM_INFINITY else soft


def allocator_slack_bytes() -> int:
    """Freed memory glibc may keep: up to the trim threshold at the top of each arena."""
    return int(API_MALLOC_ENV["MALLOC_ARENA_MAX"]) * int(API_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"])
