from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.tiny_checkpoint import ensure_tiny_checkpoint


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """The tiny default Qwen2.5-VL checkpoint (generated once into the user cache)."""
    return ensure_tiny_checkpoint()
