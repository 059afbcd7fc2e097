"""Process memory helpers: glibc allocator settings and RSS readings."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# glibc settings of the API process (see docs/design.md, "glibc").
API_MALLOC_ENV = {
    # A fixed mmap threshold: glibc's dynamic threshold otherwise rises after the first large
    # free, so later image-sized buffers land on the heap, where freeing them rarely returns
    # memory to the OS.
    "MALLOC_MMAP_THRESHOLD_": str(256 * 1024),
    # Fewer per-thread arenas: each arena keeps its own freed memory.
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_TRIM_THRESHOLD_": str(1 << 20),
}

# glibc settings of engine processes: fewer arenas only. A fixed mmap threshold (or trim
# threshold, which also turns the dynamic threshold off) makes every activation above it a
# fresh mmap that the kernel zero-fills page by page on each forward: measured on the tiny
# model, 32 decoding requests, 1 thread, 8.0 req/s and 2.9 M page faults against 14.5 req/s
# and 0.5 M with glibc's dynamic threshold. Freed image memory is handed back by
# `release_freed_memory` after each step that freed images instead.
ENGINE_MALLOC_ENV = {"MALLOC_ARENA_MAX": "2"}

# mallopt parameter numbers from glibc's malloc.h
_MALLOPT = {"MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8, "MALLOC_TRIM_THRESHOLD_": -1}

# Bounds on oneDNN's kernel caches, set by every engine process (see docs/design.md,
# "oneDNN's kernel caches"). On a CPU, torch runs bf16 matmuls through oneDNN, which JIT-compiles a kernel for each distinct
# input shape and keeps it, with its buffers, in two caches of 1,024 entries each (oneDNN's
# own and ideep's). An engine sees a new token count almost every step, so with the defaults
# its RSS climbs by up to ~0.5 MB per new shape for thousands of steps. 64 entries each hold
# it to ~100 MB, measured no slower. An explicit setting in the environment wins.
KERNEL_CACHE_ENV = {
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    "LRU_CACHE_CAPACITY": "64",
}


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()

def glibc_tuning_enabled() -> bool:
    """FLATSERVE_GLIBC_TUNING=0 turns the settings off, to measure what they change."""
    return os.environ.get("FLATSERVE_GLIBC_TUNING", "1") != "0"


def apply_malloc_settings(settings: dict[str, str]) -> None:
    """Apply API_MALLOC_ENV or ENGINE_MALLOC_ENV to this already-running process through
    mallopt (the environment variables only take effect in processes started with them)."""
    if _LIBC is None or not glibc_tuning_enabled() or not hasattr(_LIBC, "mallopt"):
        return
    for name, value in settings.items():
        _LIBC.mallopt(_MALLOPT[name], int(value))


def bound_kernel_caches() -> None:
    """Set KERNEL_CACHE_ENV in this process unless already set. oneDNN reads the variables
    when it creates its first kernel, so call this before the process runs any torch op."""
    for key, value in KERNEL_CACHE_ENV.items():
        os.environ.setdefault(key, value)


def release_freed_memory() -> None:
    """Hand memory that glibc holds after large frees back to the OS (malloc_trim)."""
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)

