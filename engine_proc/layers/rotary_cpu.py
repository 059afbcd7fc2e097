"""Rotary embedding applied in place in one pass on a CPU in float32.

`apply_rotary_`'s torch form is four element-wise ops and two temporaries over the query and
key heads (x2 * sin, x1 * sin, then x1 * cos - ..., x2 * cos + ...); in a 448px request's
vision tower and prefill that was ~5% of the served engine's samples. This kernel reads
each head's halves once and writes them back, with the same products and sums rounded in
the same order (no fused multiply-add), so its results are bit-identical to torch's.
Written in C (rotary_cpu.c) and built on first use (engine_proc/layers/native_build.py);
where it cannot be, `library()` is None and torch's ops run.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine_proc.layers import native_build

SOURCE = Path(__file__).with_suffix(".c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {"rotary_f32": ([_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64], None)}


@functools.cache
def library():
    """The compiled kernel, or None where it cannot be built or loaded here
    (FLATSERVE_ROTARY_KERNEL=0 turns it off, to measure what it changes)."""
    return native_build.load(SOURCE, "FLATSERVE_ROTARY_KERNEL",
                             "rotary embedding runs torch's ops", SIGNATURES)


def applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether the kernel takes this call: CPU, float32, x [rows, heads, D] with each head
    contiguous, D / 2 a multiple of 8, tables [rows, D / 2]."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and x.stride(-1) == 1 and x.shape[-1] % 16 == 0
            and cos.shape == sin.shape == (x.shape[0], x.shape[-1] // 2)
            and library() is not None)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_(x, cos, sin) where `applies`."""
    cos, sin = cos.contiguous(), sin.contiguous()  # no copy for the models' own tables
    rows, heads, dim = x.shape
    library().rotary_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), rows, heads, dim // 2,
                         x.stride(0), x.stride(1))
    return x
