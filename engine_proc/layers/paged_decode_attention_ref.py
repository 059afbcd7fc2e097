"""Decode attention over the paged KV cache, in plain torch: the readable definition of the op
that engine_proc/layers/paged_decode_attention_triton.py computes on a GPU, and the reference
its tests compare against. A loop over sequences that reads their lengths on the host: for
tests, never for a serving step."""

from __future__ import annotations

import torch


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against all of its cached keys.

    q            [num_seqs, num_q_heads, head_dim]
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim] (v_cache alike): the layout
                 engine_proc/layers/attention.py documents
    block_tables int [num_seqs, max_blocks]: sequence i's token t is in block
                 block_tables[i, t // block_size], row t % block_size; entries past the
                 sequence's last block are never read (-1 padding allowed)
    seq_lens     int [num_seqs]: keys of each sequence, the query's own included
    scale        the scores' factor (head_dim ** -0.5)
    returns      [num_seqs, num_q_heads, head_dim] in q's dtype: softmax(q.k * scale).v, each
                 query head i seeing kv head i // (num_q_heads / num_kv_heads) (GQA); zeros
                 for a sequence of no keys. Computed in float32.
    """
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        blocks = block_tables[i, : -(-n // block_size)].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, num_q_heads, head_dim]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out
