"""RMSNorm, with the residual add before it, in one pass per row on a CPU in float32.

torch 2.13's CPU `F.rms_norm` runs as five element-wise ops (pow, mean, add, rsqrt, mul)
plus the weight's, each a pass over the activations with its own dispatch; with the
decoder's residual add before it, seven. At a decode step's 32 rows of 256 that is ~16 us
a norm, against ~6 us for this kernel; at 2,048 rows 1.1x, at 1,024 x 2,048 1.6x. Written
in C (rms_norm_cpu.c) and built on first use (engine_proc/layers/native_build.py); where it
cannot be, `library()` is None and RMSNorm keeps torch's ops. Results differ from torch's
by float32 rounding (another summation order for the mean of squares).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine_proc.layers import native_build

SOURCE = Path(__file__).with_suffix(".c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {"rms_norm_f32": ([_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_float], None)}


@functools.cache
def library():
    """The compiled kernel, or None where it cannot be built or loaded here
    (FLATSERVE_RMS_NORM_KERNEL=0 turns it off, to measure what it changes)."""
    return native_build.load(SOURCE, "FLATSERVE_RMS_NORM_KERNEL", "RMSNorm runs torch's ops",
                             SIGNATURES)


def applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the kernel takes this call: CPU, float32, contiguous rows of a multiple of 8."""
    return (x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.shape[-1] % 8 == 0 and x.is_contiguous()
            and (residual is None or residual.dtype == torch.float32
                 and residual.shape == x.shape and residual.is_contiguous())
            and library() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x), or with `residual` (norm(x + residual), x + residual), as RMSNorm.forward;
    only where `applies`."""
    n = x.shape[-1]
    rows = x.numel() // n if n else 0
    out = torch.empty_like(x)
    total = None if residual is None else torch.empty_like(x)
    library().rms_norm_f32(x.data_ptr(), 0 if residual is None else residual.data_ptr(),
                           0 if total is None else total.data_ptr(), out.data_ptr(),
                           weight.data_ptr(), rows, n, eps)
    return out if residual is None else (out, total)
