from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from shared.random_checkpoints import ensure_tiny_checkpoint

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter, on CPU tensors. Triton reads this when
    # it is first imported (its own library functions are defined then): before any test.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def no_garbage_collector():
    """Payloads must die by reference counting, the moment their last holder lets go: a
    reference cycle (a stored exception whose traceback holds the frame that stored it, say)
    keeps them until a full collection, which under load comes minutes and gigabytes later.
    Lifetime tests run with the collector off so that such a cycle fails them (R1, R5)."""
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny default Qwen2.5-VL checkpoint (generated once into the user cache)."""
    return ensure_tiny_checkpoint()
