"""The CPU rotary kernel against torch's ops: the same bits, in every layout the models
hand it, and the layouts it must leave to torch."""

import pytest
import torch

from engine_proc.layers import rotary_cpu
from engine_proc.layers.rotary_embedding import apply_rotary_

pytestmark = [pytest.mark.skipif(rotary_cpu.library() is None,
                                 reason="no C compiler to build the kernel"),
              pytest.mark.numeric]


def _torch_rotary(x, cos, sin, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(rotary_cpu, "applies", lambda *a: False)
        return apply_rotary_(x, cos, sin)


def _tables(rows, half, gen, transposed=False):
    angles = torch.randn(rows, half, generator=gen) * 20
    if transposed:  # the decoder's mRoPE tables are [half, rows] transposed
        return angles.t().contiguous().cos().t(), angles.t().contiguous().sin().t()
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("rows", [0, 1, 7, 300, 1024])
@pytest.mark.parametrize("layout", ["plain", "vision_qkv", "decoder_qkv", "partial", "transposed"])
def test_bit_identical_to_torch(rows, layout, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    heads, dim = 4, 32
    if layout == "vision_qkv":  # q and k of a [N, 3, heads, D] projection
        base = torch.randn(rows, 3, heads, dim, generator=gen)
        view = lambda t: t[:, :2].view(rows, 2 * heads, dim)  # noqa: E731
    elif layout == "decoder_qkv":  # q and k heads of [N, q + 2 kv heads, D]
        base = torch.randn(rows, heads + 4, dim, generator=gen)
        view = lambda t: t[:, :heads + 2]  # noqa: E731
    elif layout == "partial":  # Qwen3.5 rotates the first 64 of 128
        dim = 64
        base = torch.randn(rows, heads, 128, generator=gen)
        view = lambda t: t[..., :dim]  # noqa: E731
    else:
        base = torch.randn(rows, heads, dim, generator=gen) * 5
        view = lambda t: t  # noqa: E731
    cos, sin = _tables(rows, dim // 2, gen, transposed=layout == "transposed")
    ours, want = base.clone(), base.clone()
    assert rotary_cpu.applies(view(ours), cos, sin)
    out = apply_rotary_(view(ours), cos, sin)
    _torch_rotary(view(want), cos, sin, monkeypatch)
    assert out.data_ptr() == view(ours).data_ptr()  # in place
    assert torch.equal(ours, want)  # the rest of the projection untouched too


def test_other_layouts_keep_torch(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    cos, sin = _tables(5, 4, gen)
    x = torch.randn(5, 2, 8, generator=gen)  # half 4: not a whole vector
    assert not rotary_cpu.applies(x, cos, sin)
    # both sides are torch's ops on the same tensors
    assert torch.equal(apply_rotary_(x.clone(), cos, sin),
                       _torch_rotary(x.clone(), cos, sin, monkeypatch))
    strided = torch.randn(5, 2, 64, generator=gen)[..., ::2]  # elements not contiguous
    assert not rotary_cpu.applies(strided, *_tables(5, 16, gen))
    assert not rotary_cpu.applies(torch.randn(5, 2, 32).double(), *_tables(5, 16, gen))
