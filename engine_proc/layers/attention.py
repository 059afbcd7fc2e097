"""Decoder attention over a paged KV cache, through torch's scaled_dot_product_attention.

One forward runs a flat batch of token spans (see engine_proc/context.py): prefill chunks
(q_len >= 1, possibly after earlier chunks already cached) and decodes (q_len == 1). Each
layer writes its new K/V into `k_cache`/`v_cache` [num_blocks, block_size, kv_heads,
head_dim] at `slot_mapping`, then attends over every sequence's cached keys gathered
through its block table: query i of a span of q_len sees keys 0 .. seq_len - q_len + i.

The layout work (which token belongs to which sequence, the masks) depends only on the
Context, so `build_attention_metadata` does it once per forward for all layers. Nothing
here reads a device tensor on the host: no syncs in the hot path.

Leading decodes (the runner puts them first) run as one unpadded SDPA call: measured on
CPU with the tiny model, one 256-token chunk + 31 decodes took 450 ms padded together and
67 ms split (a python loop per sequence: 100 ms). How many there are comes from
`context.num_decodes` (a host int) when the runner sets it, else from the host copy of
query_start_loc on CPU; on a device without the hint the batch stays padded.

The prefill chunks after them run one SDPA call per sequence on CPU when the Context
carries the host lengths (`q_lens_host`, `seq_lens_host`): padding 32 prompts of 18-95
tokens to the longest costs 2.3x the per-sequence loop there (22 vs 9.5 ms a layer).
On a GPU in fp16/bf16 they run as one varlen FlashAttention call per layer
(layers/varlen_attention.py): no padding, no mask; a chunk after cached keys reads them
through one gather index built per forward. Elsewhere they are padded to the longest query
and key range and masked, one SDPA call per layer.

On a GPU, decodes read the paged cache in place through the project's Triton kernel
(layers/paged_decode_attention_triton.py): no gather, no mask, nothing sized by a host
length, so a decode step can be captured as a CUDA graph (engine_proc/cuda_graphs.py).

On a CPU in float32 decodes and prefill chunks skip the gather and SDPA:
engine_proc/layers/paged_attention_cpu.py reads each sequence's blocks in place (small C
kernels built on first use; a step's prefill chunks in one call per layer, a whole prompt
alone in a step included). Where they cannot be built, or a head size is not a multiple of
8, attention gathers and runs SDPA as above.

The caches must not hold NaN/inf bit patterns (allocate them with torch.zeros, not
torch.empty): padded gathers read slots past a sequence's end, masked out of the softmax,
but 0 * NaN in the value product would still poison the output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.context import Context
from engine_proc.layers import kernel_check, paged_attention_cpu
from engine_proc.layers.eager_op import eager_op
from engine_proc.layers.varlen_attention import varlen_kernel, varlen_reference


@dataclass
class _Span:
    """One sequence of a "seqs" part: tokens [start, end) of the batch, seq_len keys."""

    start: int
    end: int
    seq_len: int
    mask: torch.Tensor | None = None  # bool [q_len, seq_len], built by the first layer to ask


@dataclass
class _Part:
    """A run of sequences over tokens [start, end) of the batch, handled by one SDPA call
    (one per sequence for "seqs")."""

    kind: str  # "decode" | "padded" | "causal" | "seqs" | "varlen"
    start: int
    end: int
    block_tables: torch.Tensor | None = None  # [B, num_blocks] clamped to valid ids
    mask: torch.Tensor | None = None  # additive, broadcast over heads
    seq_lens: torch.Tensor | None = None  # int64 [B] keys of each sequence ("decode")
    block_size: int = 0  # the KV cache's ("decode")
    token_slot: torch.Tensor | None = None  # [T] row of each token in [B * max_q_len] ("padded")
    num_seqs: int = 0
    max_q_len: int = 0
    kernel: str = ""  # "triton": decodes through the paged Triton kernel (GPUs)
    spans: list[_Span] | None = None  # "seqs"
    span_rows: torch.Tensor | None = None  # int64 [3, S] first row, q_len, seq_len ("seqs")
    # "varlen": query and key offsets (int32 [S + 1]), the longest key range, and the flat
    # cache row of every key (None: the chunks' own new keys, nothing cached before them)
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_k_len: int = 0
    key_index: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor | None  # None: no KV cache (profiling run)
    parts: list[_Part]


def _padded_part(
    ctx: Context,
    first_seq: int,
    start: int,
    end: int,
    block_size: int,
    dtype: torch.dtype,
) -> _Part:
    """Sequences first_seq.. (tokens start..end) padded to max_q_len queries x key range."""
    qsl = ctx.query_start_loc[first_seq:].long()
    qsl = qsl - qsl[0]
    q_lens = qsl[1:] - qsl[:-1]
    num_seqs = q_lens.shape[0]
    num_tokens = end - start
    device = qsl.device
    token_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens
    )
    token_slot = (
        token_seq * ctx.max_q_len + torch.arange(num_tokens, device=device) - qsl[token_seq]
    )
    max_q = ctx.max_q_len
    rows = torch.arange(max_q, device=device)
    if block_size:
        num_blocks = -(-ctx.max_seq_len // block_size)
        block_tables = ctx.block_tables[first_seq:, :num_blocks].long().clamp(min=0)
        seq_lens = ctx.seq_lens[first_seq:].long()
        keys = torch.arange(num_blocks * block_size, device=device)
        last = (seq_lens - q_lens)[:, None] + rows  # [B, max_q] last key each query sees
        allowed = (keys <= last[:, :, None]) & (keys < seq_lens[:, None, None])
    else:
        block_tables = None
        allowed = (rows[None, :] <= rows[:, None]).expand(num_seqs, max_q, max_q)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, float("-inf"))
    return _Part(
        "padded",
        start,
        end,
        block_tables=block_tables,
        mask=mask.unsqueeze(1),
        token_slot=token_slot.contiguous(),
        num_seqs=num_seqs,
        max_q_len=max_q,
    )


def _decode_part(ctx: Context, num_seqs: int, block_size: int) -> _Part:
    if triton_decode(ctx.block_tables.device) is not None:
        # the kernel reads the tables and lengths as they are (no slice by a host length):
        # a CUDA graph replays it for any lengths
        return _Part("decode", 0, num_seqs, block_tables=ctx.block_tables[:num_seqs],
                     seq_lens=ctx.seq_lens[:num_seqs], block_size=block_size,
                     num_seqs=num_seqs, kernel="triton")
    num_blocks = -(-ctx.max_seq_len // block_size)
    block_tables = ctx.block_tables[:num_seqs, :num_blocks].long().clamp(min=0)
    # no mask yet: the CPU kernel needs none; the first layer that gathers builds it
    return _Part("decode", 0, num_seqs, block_tables=block_tables,
                 seq_lens=ctx.seq_lens[:num_seqs].long(), block_size=block_size,
                 num_seqs=num_seqs)


def _decode_mask(part: _Part, dtype: torch.dtype) -> torch.Tensor:
    """Additive [B, 1, 1, keys]: -inf past each sequence's length."""
    keys = torch.arange(part.block_tables.shape[1] * part.block_size, device=part.seq_lens.device)
    allowed = keys < part.seq_lens[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, float("-inf"))
    return mask[:, None, None, :]


def _sequence_part(ctx: Context, first_seq: int, start: int, block_size: int) -> _Part:
    """Sequences first_seq.. one at a time: new keys straight from the batch when nothing
    is cached yet, else the sequence's blocks with a bottom-right causal mask. With a cache,
    the part's block tables (a row per span) and span rows, for the CPU kernel as well."""
    spans = []
    token = start
    for seq in range(first_seq, len(ctx.q_lens_host)):
        q_len = ctx.q_lens_host[seq]
        spans.append(_Span(token, token + q_len, ctx.seq_lens_host[seq]))
        token += q_len
    part = _Part("seqs", start, token, spans=spans, num_seqs=len(spans))
    if block_size:
        seq_lens = ctx.seq_lens_host[first_seq:]
        num_blocks = -(-max(seq_lens) // block_size)
        part.block_tables = ctx.block_tables[first_seq:, :num_blocks].long().clamp(min=0)
        part.block_size = block_size
        part.span_rows = torch.tensor(
            [[sp.start - start for sp in spans], [sp.end - sp.start for sp in spans], seq_lens],
            dtype=torch.int64)
    return part


def _varlen_part(ctx: Context, first_seq: int, start: int, end: int, block_size: int) -> _Part:
    """Sequences first_seq.. in one varlen call: queries packed as they are, keys the
    chunks' own when none has cached keys, else each sequence's gathered from its blocks in
    one index (built on the device from host lengths: no sync)."""
    q_lens, seq_lens = ctx.q_lens_host[first_seq:], ctx.seq_lens_host[first_seq:]
    qsl = ctx.query_start_loc[first_seq:]
    cu_q = (qsl - qsl[0]).to(torch.int32)
    part = _Part("varlen", start, end, num_seqs=len(q_lens), max_q_len=max(q_lens), cu_q=cu_q,
                 cu_k=cu_q, max_k_len=max(q_lens))
    if not block_size or q_lens == seq_lens:
        return part
    device = qsl.device
    lens = ctx.seq_lens[first_seq:].long()
    cu_k = torch.zeros(len(seq_lens) + 1, dtype=torch.int64, device=device)
    torch.cumsum(lens, 0, out=cu_k[1:])
    total = sum(seq_lens)
    seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens,
                                     output_size=total)
    pos = torch.arange(total, device=device) - cu_k[seq_of]
    tables = ctx.block_tables[first_seq:].long()
    part.key_index = tables[seq_of, pos // block_size] * block_size + pos % block_size
    part.cu_k, part.max_k_len = cu_k.to(torch.int32), max(seq_lens)
    return part


def _prefill_part(
    ctx: Context, first_seq: int, start: int, end: int, block_size: int, dtype: torch.dtype
) -> _Part:
    if ctx.q_lens_host is not None:
        device = ctx.query_start_loc.device
        if varlen_kernel(device, dtype, 8) is not None:
            return _varlen_part(ctx, first_seq, start, end, block_size)
        if device.type == "cpu":
            return _sequence_part(ctx, first_seq, start, block_size)
    return _padded_part(ctx, first_seq, start, end, block_size, dtype)


def _num_leading_decodes(ctx: Context) -> int:
    """How many leading sequences have q_len == 1: from the Context when the runner says
    (`num_decodes`), else read off host tensors (free on CPU; on a device that would be a
    sync, so the whole batch is padded instead)."""
    known = getattr(ctx, "num_decodes", None)
    if known is not None:
        return int(known)
    qsl = ctx.query_start_loc
    if qsl.device.type != "cpu":
        return 0
    not_decode = torch.nonzero(qsl[1:] - qsl[:-1] != 1)
    return int(not_decode[0, 0]) if not_decode.numel() else qsl.shape[0] - 1


def build_attention_metadata(
    ctx: Context, num_tokens: int, block_size: int, dtype: torch.dtype
) -> AttentionMetadata:
    """Derive the per-forward attention layout from the Context (once, for all layers).

    block_size: the KV cache's, or 0 when the layers have no cache (profiling run: each
    sequence then attends only to its own new tokens)."""
    num_seqs = ctx.query_start_loc.shape[0] - 1
    if not block_size:
        if num_seqs == 1:
            return AttentionMetadata(None, [_Part("causal", 0, num_tokens)])
        return AttentionMetadata(None, [_prefill_part(ctx, 0, 0, num_tokens, 0, dtype)])
    slots = ctx.slot_mapping
    if ctx.all_decode:
        return AttentionMetadata(slots, [_decode_part(ctx, num_seqs, block_size)])
    if num_seqs == 1 and ctx.max_seq_len == num_tokens:
        # A whole prompt in one chunk: attend to the new keys directly, plain causal (on a
        # CPU, as a one-span part: the layer may run it through the kernel).
        if ctx.q_lens_host is not None and ctx.query_start_loc.device.type == "cpu":
            return AttentionMetadata(slots, [_sequence_part(ctx, 0, 0, block_size)])
        return AttentionMetadata(slots, [_Part("causal", 0, num_tokens)])
    num_decodes = _num_leading_decodes(ctx)
    if num_decodes >= num_seqs:
        return AttentionMetadata(slots, [_decode_part(ctx, num_seqs, block_size)])
    parts = []
    if num_decodes:
        parts.append(_decode_part(ctx, num_decodes, block_size))
    parts.append(_prefill_part(ctx, num_decodes, num_decodes, num_tokens, block_size, dtype))
    return AttentionMetadata(slots, parts)


def triton_decode(device: torch.device):
    """The paged Triton decode kernel's module on a CUDA device (None elsewhere, without
    Triton, or where its first run on the device disagreed with the reference: decodes
    then gather and run SDPA)."""
    return _triton_decode_module(torch.device(device)) if device.type == "cuda" else None


@functools.cache
def _triton_decode_module(device: torch.device):
    return kernel_check.checked(lambda: _probe_decode(device), device,
                                "decode attention gathers the KV cache",
                                "the paged Triton kernel is")


def _probe_decode(device: torch.device):
    """The module after one small run (PROBE_DTYPE, GQA, two sequences across blocks)
    against the reference."""
    from engine_proc.layers import paged_decode_attention_triton
    from engine_proc.layers.paged_decode_attention_ref import paged_decode_attention_ref

    gen, dtype = kernel_check.generator(), kernel_check.PROBE_DTYPE
    k_cache, v_cache = (torch.randn(6, 16, 2, 64, generator=gen).to(device, dtype)
                        for _ in range(2))
    q = torch.randn(2, 8, 64, generator=gen).to(device, dtype)
    tables = torch.tensor([[4, 1, 3], [0, -1, -1]], dtype=torch.int32, device=device)
    lens = torch.tensor([40, 5], dtype=torch.int32, device=device)
    got = paged_decode_attention_triton.paged_decode_attention(q, k_cache, v_cache, tables,
                                                               lens, 0.125)
    want = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.125)
    kernel_check.agree(torch.allclose(got.float(), want.float(), rtol=0.02, atol=0.02))
    return paged_decode_attention_triton


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """cache [blocks, block_size, H, D], tables [B, n] -> [B, H, n * block_size, D]."""
    b, n = block_tables.shape
    kv = cache.index_select(0, block_tables.reshape(-1))  # 2-3x faster than cache[tables] on CPU
    return kv.view(b, n * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _gather_seq(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [blocks, block_size, H, D], one sequence's blocks -> its keys [seq_len, H, D]."""
    kv = cache.index_select(0, block_table)
    return kv.view(-1, cache.shape[2], cache.shape[3])[:seq_len]


class Attention(nn.Module):
    """Paged causal attention with GQA. The model runner assigns `k_cache`/`v_cache`."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.k_cache = torch.tensor([])
        self.v_cache = torch.tensor([])

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [T, heads, D], k/v [T, kv_heads, D] -> [T, heads * D]. Eager in a mixed step's
        graphs (layers/eager_op.py): its layout is the step's chunks'."""
        return eager_op(self._attend, (q, k, v), meta)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = q.shape[0]
        if meta.slot_mapping is not None and self.k_cache.numel():
            flat = self.num_kv_heads * self.head_dim
            self.k_cache.view(-1, flat).index_copy_(
                0, meta.slot_mapping, k.reshape(num_tokens, flat)
            )
            self.v_cache.view(-1, flat).index_copy_(
                0, meta.slot_mapping, v.reshape(num_tokens, flat)
            )
        outs = [self._part(part, q, k, v) for part in meta.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def _part(self, part: _Part, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if part.kind == "seqs":
            return self._sequences(part, q, k, v)
        if part.kind == "varlen":
            return self._varlen(part, q, k, v)
        q = q[part.start : part.end]
        if part.kind == "causal":
            k, v = k[part.start : part.end], v[part.start : part.end]
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0),
                k.transpose(0, 1).unsqueeze(0),
                v.transpose(0, 1).unsqueeze(0),
                is_causal=True,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            return out[0].transpose(0, 1)
        if part.kind == "decode":
            if part.kernel == "triton":
                return triton_decode(q.device).paged_decode_attention(
                    q, self.k_cache, self.v_cache, part.block_tables, part.seq_lens, self.scale)
            if part.mask is None:
                if (q.device.type == "cpu" and q.dtype == torch.float32
                        and paged_attention_cpu.supports(self.head_dim, part.block_size)):
                    return paged_attention_cpu.paged_decode(
                        q, self.k_cache, self.v_cache, part.block_tables, part.seq_lens,
                        self.scale)
                part.mask = _decode_mask(part, q.dtype)  # once: the later layers reuse it
            # GQA without repeating keys: a kv head's query group acts as its query rows.
            group = self.num_heads // self.num_kv_heads
            out = F.scaled_dot_product_attention(
                q.view(part.num_seqs, self.num_kv_heads, group, self.head_dim),
                _gather_kv(self.k_cache, part.block_tables),
                _gather_kv(self.v_cache, part.block_tables),
                attn_mask=part.mask,
                scale=self.scale,
            )
            return out.reshape(part.num_seqs, self.num_heads, self.head_dim)
        rows = part.num_seqs * part.max_q_len
        q_pad = q.new_zeros(rows, self.num_heads, self.head_dim).index_copy_(0, part.token_slot, q)
        q_pad = q_pad.view(part.num_seqs, part.max_q_len, self.num_heads, self.head_dim)
        if part.block_tables is not None:
            keys = _gather_kv(self.k_cache, part.block_tables)
            values = _gather_kv(self.v_cache, part.block_tables)
        else:
            k, v = k[part.start : part.end], v[part.start : part.end]
            keys, values = (
                t.new_zeros(rows, self.num_kv_heads, self.head_dim)
                .index_copy_(0, part.token_slot, t)
                .view(part.num_seqs, part.max_q_len, self.num_kv_heads, self.head_dim)
                .transpose(1, 2)
                for t in (k, v)
            )
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=part.mask,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2).reshape(rows, self.num_heads, self.head_dim)
        return out.index_select(0, part.token_slot)

    def _varlen(self, part: _Part, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                ) -> torch.Tensor:
        if part.key_index is None:
            keys, values = k[part.start : part.end], v[part.start : part.end]
        else:
            rows = (-1, self.num_kv_heads, self.head_dim)
            keys = self.k_cache.view(rows).index_select(0, part.key_index)
            values = self.v_cache.view(rows).index_select(0, part.key_index)
        # the reference (a loop that reads the offsets on the host) only for head sizes
        # FlashAttention lacks
        kernel = varlen_kernel(q.device, q.dtype, self.head_dim) or varlen_reference
        return kernel(q[part.start : part.end], keys, values, part.cu_q, part.cu_k,
                      part.max_q_len, part.max_k_len, scale=self.scale, causal=True)

    def _sequences(
        self, part: _Part, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if (part.span_rows is not None and q.device.type == "cpu" and q.dtype == torch.float32
                and paged_attention_cpu.supports(self.head_dim, part.block_size)):
            return paged_attention_cpu.paged_prefill(
                q[part.start : part.end], self.k_cache, self.v_cache, part.block_tables,
                part.span_rows, self.scale)
        out = q.new_empty(part.end - part.start, self.num_heads, self.head_dim)
        for row, span in enumerate(part.spans):
            if span.seq_len == span.end - span.start or part.block_tables is None:
                # no cached keys: this chunk's own, plain causal
                keys, values = k[span.start : span.end], v[span.start : span.end]
            else:
                table = part.block_tables[row, : -(-span.seq_len // part.block_size)]
                keys = _gather_seq(self.k_cache, table, span.seq_len)
                values = _gather_seq(self.v_cache, table, span.seq_len)
                if span.mask is None:  # once: the later layers reuse it
                    keys_at = torch.arange(span.seq_len, device=q.device)
                    last = torch.arange(span.seq_len - (span.end - span.start), span.seq_len,
                                        device=q.device)
                    span.mask = keys_at <= last[:, None]
            o = F.scaled_dot_product_attention(
                q[span.start : span.end].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=span.mask,
                is_causal=span.mask is None,
                scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
            out[span.start - part.start : span.end - part.start] = o[0].transpose(0, 1)
        return out
