"""RMSNorm's fp32 paths: torch's fused op rounds exactly as transformers' steps; the CPU
kernel (rms_norm_cpu.py) within float32 rounding of them."""

import pytest
import torch

from engine_proc.layers import rms_norm_cpu
from engine_proc.layers.rms_norm import RMSNorm
from tests.tolerance import tolerance

pytestmark = pytest.mark.numeric


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("width", [64, 128, 256, 1280, 2048, 3584])
def test_fp32_rms_norm_is_bit_identical_to_transformers(width, monkeypatch):
    monkeypatch.setattr(rms_norm_cpu, "applies", lambda *args: False)  # torch's op
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, eps=1e-6)
    norm.weight.data = torch.rand(width, generator=gen) + 0.5
    for rows in (1, 7, 333):
        x = torch.randn(rows, width, generator=gen) * 3
        assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))
        out, summed = norm(x, residual=x)
        assert torch.equal(summed, x + x) and torch.equal(out, hf_rms_norm(x + x, norm.weight, 1e-6))


def test_bf16_keeps_transformers_rounding():
    norm = RMSNorm(256).to(torch.bfloat16)
    norm.weight.data = (torch.rand(256) + 0.5).to(torch.bfloat16)
    x = (torch.randn(9, 256) * 3).to(torch.bfloat16)
    assert torch.equal(norm(x), hf_rms_norm(x, norm.weight, 1e-6))


@pytest.mark.skipif(rms_norm_cpu.library() is None, reason="no C compiler to build the kernel")
@pytest.mark.parametrize("width", [64, 256, 2048, 3584])
def test_fp32_cpu_kernel_is_within_rounding_of_transformers(width):
    """Another summation order for the mean of squares (`width` positive terms; the rest are
    products, so the error is relative): within its rounding; the residual's sum exact."""
    gen = torch.Generator().manual_seed(width)
    norm = RMSNorm(width, eps=1e-6)
    norm.weight.data = torch.rand(width, generator=gen) + 0.5
    bound = tolerance(torch.float32, width)
    for rows in (1, 7, 333):
        x = torch.randn(rows, width, generator=gen) * 3
        assert rms_norm_cpu.applies(x, norm.weight, x)
        torch.testing.assert_close(norm(x), hf_rms_norm(x, norm.weight, 1e-6), **bound)
        out, summed = norm(x, residual=x)
        assert torch.equal(summed, x + x)
        torch.testing.assert_close(out, hf_rms_norm(x + x, norm.weight, 1e-6), **bound)
