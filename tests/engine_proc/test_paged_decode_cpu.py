"""The CPU paged decode kernel against the portable path (gather + SDPA) it stands in for."""

import pytest
import torch
import torch.nn.functional as F

from engine_proc.layers import paged_decode_cpu

pytestmark = pytest.mark.skipif(paged_decode_cpu.kernel() is None,
                                reason="no C compiler to build the kernel")


def reference(q, k_cache, v_cache, tables, seq_lens, scale):
    """What attention.py does without the kernel: gather the blocks, mask, SDPA."""
    b, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    n = tables.shape[1]
    k = k_cache[tables.reshape(-1)].view(b, n * bs, kvh, d).transpose(1, 2)
    v = v_cache[tables.reshape(-1)].view(b, n * bs, kvh, d).transpose(1, 2)
    mask = torch.zeros(b, 1, 1, n * bs)
    mask.masked_fill_(torch.arange(n * bs)[None, None, None, :] >= seq_lens[:, None, None, None],
                      float("-inf"))
    out = F.scaled_dot_product_attention(q.view(b, kvh, heads // kvh, d), k, v,
                                         attn_mask=mask, scale=scale)
    return out.reshape(b, heads, d)


@pytest.mark.parametrize("heads, kvh, d, bs", [(8, 2, 32, 16), (16, 2, 128, 16), (4, 4, 64, 32),
                                               (14, 2, 64, 16), (12, 1, 80, 8)])
def test_matches_gather_and_sdpa(heads, kvh, d, bs):
    gen = torch.Generator().manual_seed(heads * 1000 + d)
    seq_lens = torch.tensor([1, bs - 1, bs, bs + 1, 5 * bs + 3, 37, 200, 1])
    b = len(seq_lens)
    n = int(-(-seq_lens.max() // bs)) + 2  # tables wider than the longest sequence needs
    num_blocks = b * n + 5
    tables = torch.randperm(num_blocks, generator=gen)[: b * n].view(b, n)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen) * 3
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    qkv = torch.randn(b, heads + 2 * kvh, d, generator=gen)
    q = qkv[:, :heads]  # a view, as the model hands it over
    scale = d ** -0.5
    got = paged_decode_cpu.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    want = reference(q.contiguous(), k_cache, v_cache, tables, seq_lens, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reads_only_the_blocks_a_sequence_covers():
    """Blocks past a sequence's length, and other sequences' blocks, may hold anything."""
    k_cache = torch.randn(8, 16, 2, 32)
    v_cache = torch.randn(8, 16, 2, 32)
    tables = torch.tensor([[3, 5]])
    q = torch.randn(1, 8, 32)
    lens = torch.tensor([20])
    before = paged_decode_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.2)
    k_cache[5, 4:].fill_(1e30)  # rows 20.. of the sequence: past its length
    v_cache[5, 4:] = float("nan")
    v_cache[[0, 1, 2, 4, 6, 7]] = float("inf")
    after = paged_decode_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(before, after) and torch.isfinite(after).all()
