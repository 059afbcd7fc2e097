"""The CPU RMSNorm kernel against torch's ops, and the norms that must not take it."""

import pytest
import torch
import torch.nn.functional as F

from engine_proc.layers import rms_norm_cpu
from engine_proc.layers.rms_norm import RMSNorm, ZeroCenteredRMSNorm
from tests.tolerance import tolerance

pytestmark = [pytest.mark.skipif(rms_norm_cpu.library() is None,
                                 reason="no C compiler to build the kernel"),
              pytest.mark.numeric]


@pytest.mark.parametrize("rows, width", [(1, 8), (3, 128), (32, 256), (2048, 256), (300, 2048)])
def test_matches_torch_with_and_without_the_residual(rows, width):
    gen = torch.Generator().manual_seed(rows + width)
    norm = RMSNorm(width, eps=1e-6)
    norm.weight.data = torch.randn(width, generator=gen)
    x = torch.randn(rows, width, generator=gen) * 3
    residual = torch.randn(rows, width, generator=gen)
    assert rms_norm_cpu.applies(x, norm.weight, residual)
    # the kernel's 8 running sums of squares against torch's mean: the same `width` positive
    # terms in another order; the rest are products, so the error is relative
    bound = tolerance(torch.float32, width)
    torch.testing.assert_close(norm(x), F.rms_norm(x, (width,), norm.weight, 1e-6), **bound)
    out, total = norm(x, residual)
    assert torch.equal(total, x + residual)  # the sum the next layer adds to, exactly
    torch.testing.assert_close(out, F.rms_norm(x + residual, (width,), norm.weight, 1e-6),
                               **bound)


def test_other_layouts_and_formulas_keep_torch():
    x = torch.randn(6, 4, 32)
    view = x[:, 1]  # rows 128 floats apart: not contiguous
    assert not rms_norm_cpu.applies(view, torch.ones(32), None)
    assert not rms_norm_cpu.applies(torch.randn(4, 12), torch.ones(12), None)  # width % 8
    norm = RMSNorm(32)
    # torch's ops on both sides (its CPU rms_norm is the steps ZeroCenteredRMSNorm writes out)
    assert torch.equal(norm(view), F.rms_norm(view, (32,), norm.weight, 1e-6))
    centred = ZeroCenteredRMSNorm(32)
    centred.weight.data = torch.randn(32)
    h = x.reshape(-1, 32)
    want = F.rms_norm(h, (32,), None, 1e-6) * (1 + centred.weight)
    assert torch.equal(centred(h), want)
