"""Attention straight from the paged KV cache, on a CPU in float32: decodes and prefills.

torch has no paged attention for the CPU: the portable path (engine_proc/layers/attention.py)
copies each sequence's cached keys and values out of their blocks (`index_select`), then
runs SDPA over the copy. At image-sized contexts that copy and the second read of it are
most of a decode step (32 sequences at 1,408 tokens of context, tiny model: 21 ms a step,
70% of it in the gather and SDPA); and SDPA's CPU flash kernel is slow on the short prompts
of a serving step (one call per prompt, ~35 GFLOP/s on 130 tokens of the tiny model's
heads, against ~100 on long ones).

Both kernels read keys and values in place, through the block tables, in parallel with
OpenMP (torch's own runtime, so torch's thread count):
- `paged_decode`: one task per sequence, all its heads; the dot products of each query with
  8 keys at a time summed together by a transpose-and-add tree (not one horizontal sum per
  key), an exp over 8 scores at a time, then each head's weighted sum of values held in
  registers over a block's rows; the next block's lines asked for a slice at a time.
- `paged_prefill`: one task per (span, 16 queries, kv head): the head's query group times
  16 queries are the rows of small matrix products with 64 keys at a time (keys transposed
  into a local tile), an online softmax (flash attention's), causal within the span and
  after its cached prefix. On the tiny model 2x SDPA on 130-token prompts, level on 1,400.
Written in C (paged_attention_cpu.c) and built on first use
(engine_proc/layers/native_build.py). Without a compiler, or if the build fails, `library()`
is None and attention keeps the gather + SDPA path. Results differ from SDPA's by float32
rounding (another summation order; an exp accurate to ~2 ulp).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from engine_proc.layers import native_build

SOURCE = Path(__file__).with_suffix(".c")
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
SIGNATURES = {
    "paged_decode_f32": ([_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64,
                          _I64, _F32], None),
    "paged_prefill_f32": ([_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR,
                           _I64, _I64, _I64, _I64, _F32], ctypes.c_int),
}


@functools.cache
def library():
    """The compiled kernels, or None where they cannot be built or loaded here
    (FLATSERVE_PAGED_ATTENTION_KERNEL=0 turns them off, to measure what they change)."""
    return native_build.load(SOURCE, "FLATSERVE_PAGED_ATTENTION_KERNEL",
                             "attention gathers its KV for SDPA", SIGNATURES)


def supports(head_dim: int, block_size: int) -> bool:
    """Whether the kernels run these shapes (they work in vectors of 8 floats), and are
    built."""
    return head_dim % 8 == 0 and block_size % 8 == 0 and library() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, heads, D] (one query per sequence), caches [blocks, block_size, kv_heads, D],
    block_tables int64 [B, n] (valid ids for every block a sequence's seq_lens covers),
    seq_lens int64 [B] -> [B, heads, D]. float32 on the CPU, contiguous caches (as the
    model runner allocates them), and `supports(D, block_size)`."""
    b, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    library().paged_decode_f32(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                               tables.data_ptr(), tables.stride(0), lens.data_ptr(),
                               out.data_ptr(), b, kvh, heads // kvh, d, bs, scale)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, spans: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of query spans over their sequences' cached keys (their new keys
    already written to the cache). q [T, heads, D] (rows may be strided, the head and dim
    axes contiguous), caches [blocks, block_size, kv_heads, D], block_tables int64 [S, n],
    spans int64 [3, S]: each span's first row in q, its query count and its sequence's
    length; query i of a span sees keys 0 .. seq_len - q_len + i. -> [T, heads, D]."""
    t, heads, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    spans = spans.contiguous()
    out = q.new_empty(t, heads, d)
    s = spans.shape[1]
    failed = library().paged_prefill_f32(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), spans[0].data_ptr(), spans[1].data_ptr(), spans[2].data_ptr(), s,
        out.data_ptr(), kvh, heads // kvh, d, bs, scale)
    if failed:
        raise MemoryError("paged prefill attention: its scratch could not be allocated")
    return out
