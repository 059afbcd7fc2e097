"""Rotary embedding applied in place in one Triton launch: the GPU path for 16-bit models
(layers/rotary_embedding.py's `apply_rotary_` torch form is the reference and the CPU path).

The torch form is six launches a layer (two products for the temporaries, then a multiply
and a subtract, a multiply and an add in place); one program here rotates one token's
heads. The rounding is the torch form's: each product rounded to the dtype, then the
difference or sum of the rounded values rounded. The casts alone do not keep that: compiled
for sm_90, LLVM narrows a product cast to 16 bits into a 16-bit multiply and Triton then
fuses it into the subtract as an fma (one rounding, not two; read in the PTX), so the kernel
is launched with `enable_fp_fusion=False`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,
    stride_x_token, stride_x_head, stride_cos, stride_sin,
    num_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < half)
    cos = tl.load(cos_ptr + token * stride_cos + cols, mask=cols < half, other=0.0)
    sin = tl.load(sin_ptr + token * stride_sin + cols, mask=cols < half, other=0.0)
    first = x_ptr + token * stride_x_token + heads * stride_x_head + cols
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    c, s = cos.to(tl.float32), sin.to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    x2_sin = (a2 * s).to(dtype).to(tl.float32)
    x1_sin = (a1 * s).to(dtype).to(tl.float32)
    x1_cos = (a1 * c).to(dtype).to(tl.float32)
    x2_cos = (a2 * c).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + half, (x2_cos + x1_sin).to(dtype), mask=mask)


def rotate_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [N, heads, D] in place (heads and the last dim strided as they are, the last
    dim contiguous) with half tables cos/sin [N, D/2] of x's dtype; returns x."""
    n, num_heads, dim = x.shape
    if n:
        half = dim // 2
        block_h, block_d = triton.next_power_of_2(num_heads), triton.next_power_of_2(half)
        _rotary_kernel[(n,)](
            x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            num_heads, half,
            BLOCK_H=block_h, BLOCK_D=block_d,
            # a 128 x 64 tile (72 heads) spills at 4 warps: a warp per 1,024 elements
            num_warps=min(max(block_h * block_d // 1024, 4), 16),
            enable_fp_fusion=False,
        )
    return x
