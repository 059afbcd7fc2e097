"""RMSNorm, optionally fused with the residual add that precedes it.

Where it runs: on a CPU in float32 the C kernel (rms_norm_cpu.py); on a GPU in 16 bits one
Triton launch (rms_norm_triton.py, the add included); elsewhere the torch form below, which
is the reference of both."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers import kernel_check, rms_norm_cpu

HALF_DTYPES = (torch.float16, torch.bfloat16)


def triton_norm(x: torch.Tensor):
    """rms_norm_triton's module for 16-bit tensors on a GPU (None elsewhere, without
    Triton, or where its first run on the device disagreed with the torch form)."""
    if not x.is_cuda or x.dtype not in HALF_DTYPES:
        return None
    return _triton_module(x.device)


@functools.cache
def _triton_module(device: torch.device):
    return kernel_check.checked(lambda: _probe(device), device, "RMSNorm runs as torch ops",
                                "the Triton kernel is")


def _probe(device: torch.device):
    """The kernel module after small runs against the torch form: a decoder's width across
    warps and a head's in one; standard and zero-centred, with and without the residual,
    and gated."""
    from engine_proc.layers import rms_norm_triton

    gen, dtype = kernel_check.generator(), kernel_check.PROBE_DTYPE
    rtol = 2 * torch.finfo(dtype).eps  # rsqrt against 1 / sqrt: an ulp on h, two on h * w
    for width in (1536, 128):
        x, r, gate = (torch.randn(3, width, generator=gen).to(device, dtype) for _ in range(3))
        w = torch.rand(width, generator=gen).to(device, dtype)
        for zero_centered in (False, True):
            for residual in (None, r):
                got = rms_norm_triton.rms_norm(x, w, 1e-6, residual, zero_centered=zero_centered)
                if residual is not None:
                    got, summed = got
                    kernel_check.agree(torch.equal(summed, x + r),
                                       "its residual sum disagrees with torch's")
                h = _normalized(x if residual is None else x + r)
                want = (h * (w.float() + 1.0)).to(dtype) if zero_centered else h.to(dtype) * w
                kernel_check.agree(torch.allclose(got.float(), want.float(), atol=0.0,
                                                  rtol=rtol))
        # gated (the Gated DeltaNet output norm): silu's exp adds a few float32 ulps
        got = rms_norm_triton.rms_norm(x, w, 1e-6, gate=gate)
        want = ((_normalized(x).to(dtype) * w).float() * F.silu(gate.float())).to(dtype)
        kernel_check.agree(torch.allclose(got.float(), want.float(), atol=0.0, rtol=rtol))
    return rms_norm_triton


def _normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / rms(x) in float32: the statistics every form here shares."""
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(eps))


class RMSNorm(nn.Module):
    # norm(x) = w * x / rms(x): the CPU kernel's formula (a subclass with another sets False)
    cpu_kernel = True
    zero_centered = False  # norm(x) * (1 + w) in fp32 (Qwen3.5): the Triton kernel's flag

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: bit-identical to the steps below in fp32 (checked for
            # widths 64-5120), one pass instead of five (~25% faster on 5,476 x 128)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Statistics in fp32, scale applied in the input dtype: the same rounding as HF.
        h = _normalized(x, self.eps)
        return h.to(x.dtype).mul_(self.weight)  # h is a temporary: scale it in place

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.cpu_kernel and rms_norm_cpu.applies(x, self.weight, residual):
            return rms_norm_cpu.rms_norm(x, self.weight, self.eps, residual)
        kernel = triton_norm(x)
        if (kernel is not None and x.dtype == self.weight.dtype
                and (residual is None or residual.dtype == x.dtype)):
            return kernel.rms_norm(x, self.weight, self.eps, residual,
                                   zero_centered=self.zero_centered)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's decoder norm: the checkpoint's weight is centred on zero and the output is
    norm(x) * (1 + w), all in fp32 with one cast at the end (HF's rounding, as vLLM's
    GemmaRMSNorm). The weight keeps the checkpoint's values."""

    cpu_kernel = False  # norm(x) * (1 + w)
    zero_centered = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = _normalized(x, self.eps)
        return h.mul_(self.weight.float() + 1.0).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """A Gated DeltaNet layer's output norm: w * norm(x), then * silu(gate), statistics
    and gate in fp32 (the norm before the gate, HF's order and rounding)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        kernel = triton_norm(x)
        if kernel is not None and gate.dtype == x.dtype == self.weight.dtype:
            return kernel.rms_norm(x, self.weight, self.eps, gate=gate)
        h = self.weight * _normalized(x, self.eps).to(x.dtype)
        return (h * F.silu(gate.float())).to(x.dtype)
