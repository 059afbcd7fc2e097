"""Rotary embedding applied in place in one pass on a CPU in float32.

`apply_rotary_`'s torch form is four element-wise ops and two temporaries over the query and
key heads (x2 * sin, x1 * sin, then x1 * cos - ..., x2 * cos + ...); in a 448px request's
vision tower and prefill that was ~5% of the served engine's samples. This kernel reads
each head's halves once and writes them back, with the same products and sums rounded in
the same order (no fused multiply-add), so its results are bit-identical to torch's. Built
on first use (engine_proc/layers/native_build.py); where it cannot be, `library()` is None
and torch's ops run.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine_proc.layers import native_build
from engine_proc.layers.native_build import V8F_HELPERS

SOURCE = V8F_HELPERS + r"""
#define PARALLEL_MIN 65536 /* elements below which one thread does the whole call */

/* x: rows x heads heads of 2 * half floats (row stride rs, head stride hs, each head
   contiguous); cos, sin: rows x half, contiguous. Rotates each head in place:
   x1' = x1 * c - x2 * s, x2' = x2 * c + x1 * s, every product rounded before the sum as
   torch's separate ops do (fp-contract off: no FMA). half % 8 == 0. */
__attribute__((optimize("fp-contract=off")))
void rotary_f32(float *x, const float *cos, const float *sin, int64_t rows, int64_t heads,
                int64_t half, int64_t rs, int64_t hs) {
    #pragma omp parallel for schedule(static) if (rows * heads * half * 2 >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos + r * half, *s = sin + r * half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + r * rs + h * hs, *x2 = x1 + half;
            for (int64_t j = 0; j < half; j += 8) {
                const v8f a = load8(x1 + j), b = load8(x2 + j);
                const v8f cj = load8(c + j), sj = load8(s + j);
                const v8f b_s = b * sj, a_s = a * sj, a_c = a * cj, b_c = b * cj;
                store8(x1 + j, a_c - b_s);
                store8(x2 + j, b_c + a_s);
            }
        }
    }
}
"""


@functools.cache
def library():
    """The compiled kernel, or None where it cannot be built or loaded here
    (FLATSERVE_ROTARY_KERNEL=0 turns it off, to measure what it changes)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return native_build.load(
        "rotary", SOURCE, "FLATSERVE_ROTARY_KERNEL", "rotary embedding runs torch's ops",
        {"rotary_f32": ([ptr, ptr, ptr, i64, i64, i64, i64, i64], None)})


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
