"""A step's small host arrays (ids, positions, block tables, sampling settings) to the GPU
through one pinned arena, instead of a pinned block per array.

`torch.Tensor.pin_memory()` per array takes a block from torch's pinned-memory cache (a
lock, an event query, a copy) and gives it back with an event recorded: a dozen of those
per step is host time the GPU waits on at small batches. Here every array of a step is
written into one pinned host arena at the next aligned offset and copied to the same offset
of one device arena with a non-blocking copy; the tensor returned is a view of the device
arena. `reset()` at the start of a step waits for the previous step's last copy (done by
then: a step ends with the sampled ids' sync) and starts over at offset 0, so the views of
the previous step must be dead by then: they are, a step's device inputs live for its step.

The arenas grow (to a power of two) when a step needs more; an old one stays alive while a
view or an in-flight copy uses it (torch's refcounts and its pinned-memory cache's events).
Bounded: by the largest step's arrays.
"""

from __future__ import annotations

import numpy as np
import torch

ALIGN = 64  # bytes: every dtype's alignment, and a cache line
INITIAL_BYTES = 1 << 20


class StepStaging:
    def __init__(self, device: torch.device, capacity: int = INITIAL_BYTES) -> None:
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._used = 0
        self._allocate(capacity)
        self._copied = torch.cuda.Event() if self._pin else None

    @property
    def capacity(self) -> int:
        return self._host.numel()

    def reset(self) -> None:
        """Start a step: the arena is free again once the last step's copies are done."""
        if self._copied is not None:
            self._copied.synchronize()
        self._used = 0

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, valid until the next `reset()`."""
        array = np.ascontiguousarray(array)
        dtype = torch.from_numpy(array[:0]).dtype
        if not array.nbytes:
            return torch.empty(array.shape, dtype=dtype, device=self.device)
        start = -(-self._used // ALIGN) * ALIGN
        end = start + array.nbytes
        if end > self.capacity:
            self._allocate(1 << (end - 1).bit_length())
            start, end = 0, array.nbytes
        self._host_bytes[start:end] = array.reshape(-1).view(np.uint8)
        out = self._device[start:end]
        out.copy_(self._host[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        self._used = end
        return out.view(dtype).view(array.shape)

    def _allocate(self, capacity: int) -> None:
        """Fresh arenas: earlier views keep the old device arena alive, and the old pinned
        one is not reused by torch's cache before the copies from it are done."""
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pin)
        self._host_bytes = self._host.numpy()
        self._device = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._used = 0
