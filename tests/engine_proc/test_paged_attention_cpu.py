"""The CPU paged attention kernels against the portable path (gather + SDPA) they stand
in for."""

import pytest
import torch
import torch.nn.functional as F

from engine_proc.layers import paged_attention_cpu
from tests.tolerance import tolerance

pytestmark = [pytest.mark.skipif(paged_attention_cpu.library() is None,
                                 reason="no C compiler to build the kernels"),
              pytest.mark.numeric]


def attention_bound(d: int, max_seq_len: int, score_scale: float) -> dict[str, float]:
    """The kernels (8-float vectors, an online softmax block by block) against SDPA's own
    blocking: q.k sums d terms, the softmax's sum and p.v sum up to max_seq_len. An error in
    a score moves its weight by as much relatively, so the scores' size sets the scale (the
    values are N(0, 1))."""
    return tolerance(torch.float32, d + 2 * max_seq_len, scale=score_scale)


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
    got = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale)
    want = reference(q.contiguous(), k_cache, v_cache, tables, seq_lens, scale)
    # scores q.k / sqrt(d) ~ N(0, 3^2) for keys 3 times the queries' size
    torch.testing.assert_close(got, want, **attention_bound(d, int(seq_lens.max()), 3.0))


def test_reads_only_the_blocks_a_sequence_covers():
    """Blocks past a sequence's length, and other sequences' blocks, may hold anything."""
    k_cache = torch.randn(8, 16, 2, 32)
    v_cache = torch.randn(8, 16, 2, 32)
    tables = torch.tensor([[3, 5]])
    q = torch.randn(1, 8, 32)
    lens = torch.tensor([20])
    before = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.2)
    k_cache[5, 4:].fill_(1e30)  # rows 20.. of the sequence: past its length
    v_cache[5, 4:] = float("nan")
    v_cache[[0, 1, 2, 4, 6, 7]] = float("inf")
    after = paged_attention_cpu.paged_decode(q, k_cache, v_cache, tables, lens, 0.2)
    assert torch.equal(before, after) and torch.isfinite(after).all()


def prefill_reference(q, k_cache, v_cache, tables, spans, scale):
    """Each span alone: its sequence's keys gathered, a bottom-right causal mask, SDPA."""
    _, bs, kvh, d = k_cache.shape
    out = torch.empty_like(q)
    for first, q_len, seq_len in spans.t().tolist():
        n = -(-seq_len // bs)
        row = spans[0].tolist().index(first)
        k = k_cache[tables[row, :n]].reshape(n * bs, kvh, d)[:seq_len].transpose(0, 1)
        v = v_cache[tables[row, :n]].reshape(n * bs, kvh, d)[:seq_len].transpose(0, 1)
        allowed = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
        o = F.scaled_dot_product_attention(q[first : first + q_len].transpose(0, 1)[None], k[None],
                                           v[None], attn_mask=allowed, scale=scale,
                                           enable_gqa=True)
        out[first : first + q_len] = o[0].transpose(0, 1)
    return out


@pytest.mark.parametrize("heads, kvh, d, bs", [(8, 2, 32, 16), (16, 2, 128, 16), (4, 4, 64, 32),
                                               (14, 2, 64, 16), (12, 1, 80, 8), (28, 4, 128, 16)])
def test_prefill_matches_gather_and_sdpa(heads, kvh, d, bs):
    """Whole prompts, chunks after a cached prefix (a query block may see none of a chunk of
    keys), single queries, spans longer than a task's 16 queries and a chunk's 64 keys."""
    gen = torch.Generator().manual_seed(heads * 100 + d)
    q_lens = [1, 5, 17, 130, 64, 33, 200, 8]
    cached = [0, 0, 3, 0, 100, 700, 16, 8]
    seq_lens = [q + c for q, c in zip(q_lens, cached, strict=True)]
    firsts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    n = -(-max(seq_lens) // bs) + 1  # tables wider than the longest sequence needs
    num_blocks = len(q_lens) * n + 3
    tables = torch.randperm(num_blocks, generator=gen)[: len(q_lens) * n].view(len(q_lens), n)
    k_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen) * 2
    v_cache = torch.randn(num_blocks, bs, kvh, d, generator=gen)
    qkv = torch.randn(sum(q_lens), heads + 2 * kvh, d, generator=gen)
    q = qkv[:, :heads]  # strided rows, as the model hands them over
    spans = torch.tensor([firsts, q_lens, seq_lens])
    scale = d ** -0.5
    got = paged_attention_cpu.paged_prefill(q, k_cache, v_cache, tables, spans, scale)
    want = prefill_reference(q.contiguous(), k_cache, v_cache, tables, spans, scale)
    # scores q.k / sqrt(d) ~ N(0, 2^2) for keys twice the queries' size
    torch.testing.assert_close(got, want, **attention_bound(d, max(seq_lens), 2.0))


def test_prefill_reads_only_the_keys_a_query_may_see():
    """Keys after a query's own position (its later tokens, written to the cache in the same
    step) and blocks past the sequence never reach its output."""
    k_cache = torch.randn(8, 16, 2, 32)
    v_cache = torch.randn(8, 16, 2, 32)
    tables = torch.tensor([[3, 5, 1]])
    q = torch.randn(10, 8, 32)
    spans = torch.tensor([[0], [10], [30]])  # 20 cached keys, then these 10 queries
    before = paged_attention_cpu.paged_prefill(q, k_cache, v_cache, tables, spans, 0.2)
    k_cache[1].fill_(1e30)  # rows 32.. of the sequence: past its length
    v_cache[1] = float("nan")
    v_cache[5, 14:] = float("inf")  # keys 30-31: past its length
    v_cache[[0, 2, 4, 6, 7]] = float("inf")
    after = paged_attention_cpu.paged_prefill(q, k_cache, v_cache, tables, spans, 0.2)
    assert torch.equal(before, after) and torch.isfinite(after).all()
    first = paged_attention_cpu.paged_prefill(q[:1], k_cache, v_cache, tables,
                                              torch.tensor([[0], [1], [21]]), 0.2)
    assert torch.equal(first, after[:1])  # query 0 sees keys 0..20 alone, as with 21 keys
