"""Where the Triton kernels' tests run: natively on a CUDA device, else in Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 before Triton is
first imported); `runs_triton` skips them where neither holds."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
runs_triton = pytest.mark.skipif(not ON_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="no CUDA device, and TRITON_INTERPRET is not 1")
