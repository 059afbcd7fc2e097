"""Decode attention reading the paged KV cache in place: the project's Triton kernel for GPUs.

Same op as engine_proc/layers/paged_decode_attention_ref.py (its readable definition): one
query token per sequence against every key of the sequence, found through its block table in
the cache layout engine_proc/layers/attention.py documents ([num_blocks, block_size,
kv_heads, head_dim]). No gather into a padded copy, no mask, no host sync.

Two launches, the split-K ("flash decoding") form that SGLang's and vLLM's Triton decode
backends also use:
1. `_split_kernel`, one program per (sequence, kv head, split): the sequence's keys are cut
   into `num_splits` contiguous ranges, each a multiple of BLOCK_N keys, so a short sequence
   fills only its first splits and the rest exit at once. A program loads the kv head's
   query group as the rows of one tile (GQA: keys and values are read once per group, not
   once per query head; the rows are padded to 16 for tl.dot), runs an online softmax over
   its range BLOCK_N keys at a time (each key's block id read from the block table), and
   writes its normalised partial output and its log-sum-exp (base 2) to a float32 workspace.
2. `_merge_kernel`, one program per (sequence, query head): the splits' partials weighted by
   their share of the softmax's sum. It recomputes each sequence's split ranges from
   seq_lens, so splits that held no keys are skipped without any flag written for them.

Graph capture: the launch shapes depend only on num_seqs, the heads and `num_splits` (a
fixed parameter, not chosen from the lengths), the workspace's only on those; the lengths
and block tables are read on the device. A sequence of length 0 gets zeros.

Head dims that are not a power of two (Qwen3-VL's tiny 48, 80, ...) run in tiles padded to
the next one, masked. float32 inputs use IEEE dot products (no TF32) and the divisions
round to nearest (`div_rn`); exp2 is the hardware's approximate one (a few float32 ulps), so
float32 results agree with the reference within a few ulps; bf16/fp16 probabilities are
rounded to the values' dtype before the p.v product, as flash attention does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Splits of each sequence's keys. With 2-4 kv heads (the Qwen2.5-VL 3B/7B decoders) one
# sequence makes 16-32 programs; larger batches fill the card anyway. To be measured on a
# GPU against 4 and 16 (the workspace grows with it: num_seqs * heads * splits * (D + 1) * 4
# bytes, 32 MiB at 512 sequences, 16 heads, 8 splits, D 128).
DEFAULT_NUM_SPLITS = 8
BLOCK_N = 32  # keys per tile
MIN_GROUP_ROWS = 16  # tl.dot's smallest M: a query group is padded to it
LOG2E = 1.4426950408889634


@triton.jit
def _split_length(seq_lens_ptr, seq, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the sequence's keys, the keys of each of its splits): each split a multiple of
    BLOCK_N keys, so the split kernel and the merge kernel cut a sequence alike."""
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    return seq_len, tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, seq_lens_ptr, partial_ptr,
    scale_log2,
    stride_q_seq, stride_q_head,
    stride_k_block, stride_k_row, stride_k_head,
    stride_v_block, stride_v_row, stride_v_head,
    stride_table,
    stride_p_seq, stride_p_head, stride_p_split,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len, split_len = _split_length(seq_lens_ptr, seq, NUM_SPLITS, BLOCK_N)
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        rows = tl.arange(0, BLOCK_H)
        row_ok = rows < GROUP
        heads = kv_head * GROUP + rows
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
                    mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 units)
        l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of 2^(s - m)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_table
        for tile in range(start, end, BLOCK_N):
            keys = tile + tl.arange(0, BLOCK_N)
            key_ok = keys < end
            block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
            row = keys % BLOCK_SIZE
            kv_mask = key_ok[:, None] & dim_ok[None, :]
            k = tl.load(k_ptr + (block * stride_k_block + row * stride_k_row
                                 + kv_head * stride_k_head)[:, None] + dims[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(key_ok[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + (block * stride_v_block + row * stride_v_row
                                 + kv_head * stride_v_head)[:, None] + dims[None, :],
                        mask=kv_mask, other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        partial = (partial_ptr + seq.to(tl.int64) * stride_p_seq + heads * stride_p_head
                   + split * stride_p_split)
        tl.store(partial[:, None] + dims[None, :], tl.math.div_rn(acc, l_sum[:, None]),
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(partial + HEAD_DIM, m + tl.log2(l_sum), mask=row_ok)


@triton.jit
def _merge_kernel(
    partial_ptr, seq_lens_ptr, out_ptr,
    stride_p_seq, stride_p_head, stride_p_split,
    stride_o_seq, stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len, split_len = _split_length(seq_lens_ptr, seq, NUM_SPLITS, BLOCK_N)
    splits = tl.arange(0, BLOCK_S)
    used = (splits < NUM_SPLITS) & (splits * split_len < seq_len)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    partial = (partial_ptr + seq.to(tl.int64) * stride_p_seq + head * stride_p_head
               + splits * stride_p_split)
    # unused splits read as a finite floor, not -inf: with no split used (seq_len 0) the
    # shift below stays finite instead of -inf - -inf
    lse = tl.load(partial + HEAD_DIM, mask=used, other=-1.0e30)
    weight = tl.where(used, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(partial[:, None] + dims[None, :], mask=used[:, None] & dim_ok[None, :],
                    other=0.0)
    total = tl.sum(weight, 0)
    out = tl.math.div_rn(tl.sum(weight[:, None] * parts, 0), tl.where(total > 0, total, 1.0))
    tl.store(out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_ok)


def workspace_shape(num_seqs: int, num_heads: int, head_dim: int,
                    num_splits: int = DEFAULT_NUM_SPLITS) -> tuple[int, int, int, int]:
    """The float32 workspace of one call: each split's partial output and, in the last
    column, its log-sum-exp. Callers that keep one (a captured graph) allocate it once."""
    return (num_seqs, num_heads, num_splits, head_dim + 1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int = DEFAULT_NUM_SPLITS,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over the paged cache, keys and values read in place.

    q            [num_seqs, num_q_heads, head_dim], last dim contiguous (a view of the
                 model's qkv is fine)
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache alike), last dim
                 contiguous, q's dtype
    block_tables int32 or int64 [num_seqs, max_blocks] (-1 past each sequence's blocks;
                 never read there)
    seq_lens     int32 or int64 [num_seqs]: keys of each sequence, the query's own included
    scale        the scores' factor
    num_splits   how many ranges each sequence's keys are cut into (a fixed launch shape)
    out          [num_seqs, num_q_heads, head_dim] to write into (else allocated)
    workspace    float32 of `workspace_shape(...)` (else allocated)
    returns      out: softmax(q.k * scale).v per query head, GQA; zeros where seq_len is 0.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not split into {num_kv_heads} kv heads")
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit "
                         f"head_dim {head_dim}")
    if out is None:
        out = q.new_empty(num_seqs, num_heads, head_dim)
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, out, block_tables, seq_lens)):
        raise ValueError("q, the caches, out, block_tables and seq_lens need a contiguous last "
                         "dimension")
    if num_seqs == 0:
        return out
    shape = workspace_shape(num_seqs, num_heads, head_dim, num_splits)
    if workspace is None:
        workspace = torch.empty(shape, dtype=torch.float32, device=q.device)
    elif (tuple(workspace.shape) != shape or workspace.dtype != torch.float32
          or workspace.stride(-1) != 1):
        raise ValueError(f"workspace must be float32 {shape}, last dimension contiguous, got "
                         f"{workspace.dtype} {tuple(workspace.shape)}")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, workspace,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(MIN_GROUP_ROWS, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        IEEE=q.dtype == torch.float32,
        # float32's IEEE dots are FMA loops: at 4 warps they spill at d128 with GQA (255
        # registers) and d256 (~10 KB); 8 warps hold them (sm_90, Triton 3.6, compiled)
        num_warps=8 if q.dtype == torch.float32 else 4,
    )
    _merge_kernel[(num_seqs, num_heads)](
        workspace, seq_lens, out,
        workspace.stride(0), workspace.stride(1), workspace.stride(2),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out
