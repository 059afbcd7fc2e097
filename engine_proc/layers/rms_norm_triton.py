"""RMSNorm, with the residual add before it, in one Triton launch: the GPU path for 16-bit
models (layers/rms_norm.py's torch form is the reference and the CPU path).

The torch form of a decoder norm in bf16 is nine launches (the add, the cast to fp32, the
square, the mean, eps, rsqrt, the scale, the cast back, the weight): with two norms a layer
that is half of an eager layer's launches, and an eager GPU step (a prefill chunk beside
decodes) is bound by its launches. Here one program normalises one row:

    s = x + residual, rounded to the input dtype (as the torch add rounds)
    h = s * rsqrt(mean(s^2) + eps), statistics in fp32
    standard: (h rounded to the dtype) * w, rounded      (HF's Qwen2RMSNorm rounding)
    zero-centred (Qwen3.5): h * (1 + w) in fp32, rounded once
    gated (Qwen3.5's Gated DeltaNet output): the standard form, then * silu(gate) in fp32,
        rounded once (silu's exp is the hardware's approximate one)

The only difference from the torch form is the order of the mean's sum (and rsqrt's last
bit): a bf16 output can differ by one rounding where the fp32 value sits on a tie.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, gate_ptr,
    stride_x, stride_residual, stride_out, stride_residual_out, stride_gate,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, GATED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_residual_out + cols, x, mask=mask)
    s = x.to(tl.float32)
    mean_square = tl.sum(s * s, axis=0) / n_cols
    h = s * (1.0 / tl.sqrt_rn(mean_square + eps))  # torch's form: s * rsqrt(...)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if ZERO_CENTERED:
        y = h * (w.to(tl.float32) + 1.0)
    else:
        y = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    if GATED:
        gate = tl.load(gate_ptr + row * stride_gate + cols, mask=mask, other=0.0).to(tl.float32)
        y = y.to(x.dtype).to(tl.float32) * tl.math.div_rn(gate, 1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out + cols, y.to(x.dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, *, zero_centered: bool = False,
             gate: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., H] (rows may be strided, columns contiguous) -> norm(x) [..., H], or with
    `residual`: (norm(x + residual), x + residual), both new tensors; with `gate` (x's
    shape): norm(x) * silu(gate)."""
    shape = x.shape
    rows = _rows(x)
    n, width = rows.shape
    out = torch.empty((n, width), dtype=x.dtype, device=x.device)
    res_in = res_out = out  # unused without a residual
    if residual is not None:
        res_in = _rows(residual)
        res_out = torch.empty_like(out)
    gates = out if gate is None else _rows(gate)  # unused without a gate
    if n:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(n,)](
            rows, res_in, weight, out, res_out, gates,
            rows.stride(0), res_in.stride(0), out.stride(0), res_out.stride(0),
            gates.stride(0), width, eps,
            HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered,
            GATED=gate is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [N, H] with contiguous columns (a view where it can be)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()
