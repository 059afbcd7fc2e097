"""A step's arrays through the staging arenas: every upload of a step keeps its values
through the next step (growth included), and the arenas stay the size of the largest step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_proc.step_staging import ALIGN, NUM_ARENAS, StepStaging

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.gpu)]


def _step_arrays(rng: np.random.Generator, scale: int) -> list[np.ndarray]:
    return [
        rng.integers(0, 1 << 40, size=7 * scale, dtype=np.int64),  # input ids
        np.broadcast_to(rng.integers(0, 99, size=scale), (3, scale)),  # positions: a view
        rng.integers(-1, 500, size=(scale, 5), dtype=np.int32),  # block tables
        np.zeros(0, dtype=np.int64),  # no state restores
        rng.random(scale, dtype=np.float32),  # temperatures
        rng.random(scale) < 0.5,  # greedy rows
        np.asarray(3, dtype=np.int64).reshape(1),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_every_upload_of_a_step_keeps_its_values_through_the_next_step(device):
    rng = np.random.default_rng(0)
    staging = StepStaging(torch.device(device), capacity=256)
    previous = []
    for scale in (3, 50, 2000, 40, 7):  # 2000 grows an arena in the middle of a step
        staging.reset()
        arrays = _step_arrays(rng, scale)
        tensors = [staging(a) for a in arrays]
        for array, tensor in [*previous, *zip(arrays, tensors, strict=True)]:
            assert tensor.device.type == device
            assert tensor.dtype == torch.from_numpy(np.ascontiguousarray(array)).dtype
            np.testing.assert_array_equal(tensor.cpu().numpy(), array)
        previous = list(zip(arrays, tensors, strict=True))


def test_the_arena_is_reused_from_the_start_each_step():
    staging = StepStaging(torch.device("cpu"), capacity=256)
    big = np.arange(300, dtype=np.int64)  # 2,400 bytes: grows each arena to 4,096
    arenas = set()
    for _ in range(5):
        staging.reset()
        first = staging(big)
        staging(np.arange(10, dtype=np.int32))
        assert first.storage_offset() == 0 and staging.capacity == 4096
        arenas.add(first.untyped_storage().data_ptr())
    assert len(arenas) == NUM_ARENAS  # each grown once, then taking turns
    staging.reset()
    a, b = staging(np.ones(1, dtype=np.int8)), staging(np.ones(1, dtype=np.float64))
    offset = b.storage_offset() * b.element_size() - a.storage_offset() * a.element_size()
    assert offset == ALIGN  # each array starts on its own aligned offset
