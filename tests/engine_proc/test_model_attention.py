"""Paged attention against a plain per-sequence reference, on random tensors."""

from __future__ import annotations

import pytest
import torch

from engine_proc.context import Context
from engine_proc.layers.attention import Attention, build_attention_metadata
from tests.tolerance import tolerance

pytestmark = pytest.mark.numeric

HEADS, KV_HEADS, DIM, BLOCK = 8, 2, 16, 4


def _bound(max_seq_len: int) -> dict[str, float]:
    """Paged attention (the CPU kernels, SDPA, padded batches) against the einsum reference:
    q.k sums DIM terms, the softmax's sum and p.v sum up to max_seq_len; scores and values
    are N(0, 1)."""
    return tolerance(torch.float32, DIM + 2 * max_seq_len, scale=1.0)


def _reference(q, k, v):
    """q [q_len, H, D] against the whole history k/v [seq_len, KV, D], causal at the end."""
    q_len, seq_len = q.shape[0], k.shape[0]
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    allowed = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + seq_len - q_len
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q_len, HEADS * DIM)


class _Cache:
    def __init__(self, attn, num_blocks=64):
        attn.k_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
        attn.v_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, DIM)
        self.attn = attn
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        self.tables, self.history = {}, {}

    def step(self, spans, num_decodes=None, all_decode=None, host_lens=False):
        """spans: (key, q_len). Runs one forward; returns (output, reference output)."""
        qs, ks, vs, qsl, seq_lens, slots, tables = [], [], [], [0], [], [], []
        for key, q_len in spans:
            q = torch.randn(q_len, HEADS, DIM)
            k, v = torch.randn(q_len, KV_HEADS, DIM), torch.randn(q_len, KV_HEADS, DIM)
            old_k, old_v = self.history.get(key, (torch.zeros(0, KV_HEADS, DIM),) * 2)
            self.history[key] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
            start, end = old_k.shape[0], old_k.shape[0] + q_len
            table = self.tables.setdefault(key, [])
            while len(table) * BLOCK < end:
                table.append(self.free.pop())
            slots += [table[i // BLOCK] * BLOCK + i % BLOCK for i in range(start, end)]
            qs.append(q), ks.append(k), vs.append(v)
            qsl.append(qsl[-1] + q_len), seq_lens.append(end), tables.append(table)
        block_tables = torch.full((len(tables), 1 + max(map(len, tables))), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            block_tables[i, : len(t)] = torch.tensor(t)
        ctx = Context(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            slot_mapping=torch.tensor(slots),
            block_tables=block_tables,
            max_q_len=max(q for _, q in spans),
            max_seq_len=max(seq_lens),
            all_decode=all(q == 1 for _, q in spans) if all_decode is None else all_decode,
        )
        if num_decodes is not None:
            ctx.num_decodes = num_decodes
        if host_lens:
            ctx.q_lens_host = [q_len for _, q_len in spans]
            ctx.seq_lens_host = seq_lens
        q = torch.cat(qs)
        meta = build_attention_metadata(ctx, q.shape[0], BLOCK, q.dtype)
        out = self.attn(q, torch.cat(ks), torch.cat(vs), meta)
        expected = torch.cat(
            [_reference(qq, *self.history[key]) for qq, (key, _) in zip(qs, spans, strict=True)]
        )
        return out, expected, meta

    def max_seq_len(self) -> int:
        return max(k.shape[0] for k, _ in self.history.values())


@pytest.mark.parametrize("host_lens", [False, True])
@pytest.mark.parametrize("num_decodes", [0, None, 3])
def test_mixed_flat_batches_match_reference(num_decodes, host_lens):
    """num_decodes 0: everything padded together; None: leading decodes found from the
    host copy of query_start_loc; 3: the runner says. host_lens: prefills one sequence
    at a time instead of padded."""
    torch.manual_seed(0)
    cache = _Cache(Attention(HEADS, KV_HEADS, DIM))
    prefill = "seqs" if host_lens else "padded"
    cases = [
        ([("a", 13)], "seqs" if host_lens else "causal"),  # a whole prompt (the CPU kernel's)
        ([("b", 6), ("c", 9), ("d", 2)], "padded"),  # several first chunks
        ([("a", 1), ("b", 1), ("c", 1)], "decode"),
        ([("d", 5)], "padded"),  # a later chunk of one sequence
        ([("a", 1), ("b", 1), ("c", 1), ("d", 7), ("e", 3)], None),  # decodes + chunks
    ]
    for spans, kind in cases:
        mixed = kind is None
        out, expected, meta = cache.step(spans, num_decodes if mixed else None, host_lens=host_lens)
        torch.testing.assert_close(out, expected, **_bound(cache.max_seq_len()))
        kinds = [p.kind for p in meta.parts]
        if mixed:
            assert kinds == ([prefill] if num_decodes == 0 else ["decode", prefill])
        else:
            assert kinds == [prefill if kind == "padded" else kind]


def test_one_token_spans_not_flagged_all_decode_take_the_decode_path():
    torch.manual_seed(0)
    cache = _Cache(Attention(HEADS, KV_HEADS, DIM))
    cache.step([("a", 7), ("b", 3)])
    out, expected, meta = cache.step([("a", 1), ("b", 1)], all_decode=False)
    torch.testing.assert_close(out, expected, **_bound(cache.max_seq_len()))
    assert [p.kind for p in meta.parts] == ["decode"]


@pytest.mark.parametrize("host_lens,varlen", [(False, False), (True, False), (True, True)])
def test_without_cache_each_sequence_sees_only_itself(host_lens, varlen, monkeypatch):
    """Padded, one SDPA call per sequence, or (varlen) one packed call as on a GPU."""
    if varlen:
        _varlen_through_the_reference(monkeypatch)
    torch.manual_seed(0)
    attn = Attention(HEADS, KV_HEADS, DIM)
    lens = [5, 1, 8]
    q = torch.randn(sum(lens), HEADS, DIM)
    k, v = torch.randn(sum(lens), KV_HEADS, DIM), torch.randn(sum(lens), KV_HEADS, DIM)
    qsl = torch.tensor([0, 5, 6, 14], dtype=torch.int32)
    ctx = Context(
        qsl,
        torch.tensor(lens, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int64),
        torch.zeros(3, 0, dtype=torch.int32),
        max_q_len=8,
        max_seq_len=8,
    )
    if host_lens:
        ctx.q_lens_host = ctx.seq_lens_host = lens
    meta = build_attention_metadata(ctx, q.shape[0], 0, q.dtype)
    assert [p.kind for p in meta.parts] == [
        "varlen" if varlen else "seqs" if host_lens else "padded"]
    out = attn(q, k, v, meta)
    expected = torch.cat(
        [_reference(*(t[a:b] for t in (q, k, v))) for a, b in ((0, 5), (5, 6), (6, 14))]
    )
    torch.testing.assert_close(out, expected, **_bound(max(lens)))


def _varlen_through_the_reference(monkeypatch):
    """Prefill chunks take the varlen part on the CPU, through the SDPA reference: the
    part's offsets and key gather index are what a GPU's FlashAttention call would read."""
    from engine_proc.layers import attention, varlen_attention
    monkeypatch.setattr(attention, "varlen_kernel",
                        lambda device, dtype, head_dim: varlen_attention.varlen_reference)


def test_varlen_prefill_parts_match_reference(monkeypatch):
    """First chunks (their own keys), later chunks after cached keys (gathered through the
    block tables, out of order), and decodes before them, in one packed call."""
    _varlen_through_the_reference(monkeypatch)
    torch.manual_seed(0)
    cache = _Cache(Attention(HEADS, KV_HEADS, DIM))
    for spans, key_index in (
        ([("b", 6), ("c", 9), ("d", 2)], False),  # first chunks: their own keys
        ([("d", 5), ("b", 3)], True),  # later chunks: keys gathered from the cache
        ([("a", 11), ("c", 4)], True),  # a first chunk beside a later one
        ([("b", 1), ("c", 1), ("d", 7), ("e", 3)], True),  # decodes, then chunks
    ):
        num_decodes = sum(q == 1 for _, q in spans)
        out, expected, meta = cache.step(spans, num_decodes, host_lens=True)
        torch.testing.assert_close(out, expected, **_bound(cache.max_seq_len()))
        varlen = meta.parts[-1]
        assert varlen.kind == "varlen" and (varlen.key_index is not None) == key_index
        assert [p.kind for p in meta.parts[:-1]] == (["decode"] if num_decodes else [])
