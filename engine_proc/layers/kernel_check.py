"""The GPU kernels' first-use checks, in one shape for all of them.

Each device path (the paged decode attention, Qwen3.5's decode kernels, flash-linear-
attention's prefill rule, FlashAttention's varlen call, the norm, rotary) is looked up
through a `functools.cache`d function of the device that runs `checked(probe, ...)` once:
the probe imports the kernel, runs it on small inputs against its torch form and returns
it. One that raises (a compile error, no Triton) or disagrees is off: None, with a warning
naming it and what runs instead, so the engine serves on the torch path rather than
failing every step. The engine runs every lookup at start (ModelRunner._check_gpu_kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_DTYPE = torch.bfloat16  # the 16-bit checks run in serving's dtype


def checked(probe: Callable[[], T], device: torch.device, instead: str, kernel: str
            ) -> T | None:
    """`probe()`'s kernel, or None with "<instead> on <device>: <kernel> off (<why>)"."""
    try:
        return probe()
    except Exception as e:  # ImportError included: no Triton, or no fla-core
        logger.warning("%s on %s: %s off (%s)", instead, device, kernel, e)
        return None


def agree(ok: bool, what: str = "its probe disagrees with the torch form") -> None:
    if not ok:
        raise RuntimeError(what)


def generator() -> torch.Generator:
    """The probes' inputs come from a generator of their own, not the global one that
    unseeded sampling draws from."""
    return torch.Generator().manual_seed(0)
