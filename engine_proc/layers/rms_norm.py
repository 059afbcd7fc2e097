"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers import rms_norm_cpu


class RMSNorm(nn.Module):
    # norm(x) = w * x / rms(x): the CPU kernel's formula (a subclass with another sets False)
    cpu_kernel = True

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
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return h.to(x.dtype).mul_(self.weight)  # h is a temporary: scale it in place

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
        if self.cpu_kernel and rms_norm_cpu.applies(x, self.weight, residual):
            return rms_norm_cpu.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(RMSNorm):
    """Qwen3.5's decoder norm: the checkpoint's weight is centred on zero and the output is
    norm(x) * (1 + w), all in fp32 with one cast at the end (HF's rounding, as vLLM's
    GemmaRMSNorm). The weight keeps the checkpoint's values."""

    cpu_kernel = False  # norm(x) * (1 + w)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.eps))
        return h.mul_(self.weight.float() + 1.0).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """A Gated DeltaNet layer's output norm: w * norm(x), then * silu(gate), statistics
    and gate in fp32 (the norm before the gate, HF's order and rounding)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).add_(self.eps))
        h = self.weight * h.to(x.dtype)
        return (h * torch.nn.functional.silu(gate.float())).to(x.dtype)
