"""A step's small host arrays (ids, positions, block tables, sampling settings) to the GPU
through a pinned arena, instead of a pinned block per array.

`torch.Tensor.pin_memory()` per array takes a block from torch's pinned-memory cache (a
lock, an event query, a copy) and gives it back with an event recorded: a dozen of those
per step is host time the GPU waits on at small batches. Here every array of a step is
written into a pinned host arena at the next aligned offset and copied to the same offset
of a device arena with a non-blocking copy; the tensor returned is a view of the device
arena, valid for the step (a step's device inputs live for its step).

Two arenas take turns, a step each: `reset()` at the start of a step switches to the other
one and waits for that arena's last copy, two steps back, which is long done. Waiting on
the step just before would wait for its whole forward when its last copy came after it
(a hybrid model's state saves) and nothing synced since (a step that sampled nothing).

An arena grows (to a power of two) when a step needs more; the old one stays alive while a
view or an in-flight copy uses it (torch's refcounts and its pinned-memory cache's events).
Bounded by the largest step's arrays: torch's pinned cache keeps the blocks it outgrew, at
most as much again (1 + 1/2 + 1/4 ...), so 2 x 2 x the largest arena in all.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes: every dtype's alignment, and a cache line
INITIAL_BYTES = 1 << 20
NUM_ARENAS = 2


class _Arena:
    def __init__(self, device: torch.device, capacity: int) -> None:
        pin = device.type == "cuda"
        self.host = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
        self.host_bytes = self.host.numpy()
        self.device = torch.empty(capacity, dtype=torch.uint8, device=device)
        self.used = 0
        # after the arena's last copy, on the stream copies to `device` take
        self.copied = torch.cuda.Event() if pin else None


class StepStaging:
    def __init__(self, device: torch.device, capacity: int = INITIAL_BYTES) -> None:
        self.device = torch.device(device)
        self._arenas = [_Arena(self.device, capacity) for _ in range(NUM_ARENAS)]
        self._turn = 0

    @property
    def capacity(self) -> int:
        """The current arena's bytes."""
        return self._arenas[self._turn].host.numel()

    def reset(self) -> None:
        """Start a step on the other arena, free again once its copies (two steps back) are
        done."""
        self._turn = (self._turn + 1) % NUM_ARENAS
        arena = self._arenas[self._turn]
        if arena.copied is not None:
            arena.copied.synchronize()
        arena.used = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, valid until the step after next starts."""
        array = np.ascontiguousarray(array)
        dtype = torch.from_numpy(array[:0]).dtype
        if not array.nbytes:
            return torch.empty(array.shape, dtype=dtype, device=self.device)
        arena = self._arenas[self._turn]
        start = -(-arena.used // ALIGN) * ALIGN
        end = start + array.nbytes
        if end > arena.host.numel():
            # a fresh arena: earlier views keep the old device one alive, and torch's cache
            # does not reuse the old pinned one before the copies from it are done
            arena = self._arenas[self._turn] = _Arena(self.device, 1 << (end - 1).bit_length())
            start, end = 0, array.nbytes
        arena.host_bytes[start:end] = array.reshape(-1).view(np.uint8)
        out = arena.device[start:end]
        out.copy_(arena.host[start:end], non_blocking=True)
        if arena.copied is not None:
            arena.copied.record(torch.cuda.current_stream(self.device))
        arena.used = end
        return out.view(dtype).view(array.shape)
