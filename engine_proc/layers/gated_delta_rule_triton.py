"""Gated DeltaNet decodes on a GPU with the states read and written in place by slot: the
project's Triton kernels for one token per sequence, the delta rule and the causal conv.

Same ops as the torch form (engine_proc/layers/gated_delta_rule.py, the readable
definition and the tests' reference) on one token, in its order: decay the state, read
k^T S, write k (x) (v - k^T S) * beta, read S^T q, with q and k l2-normalized in the kernel
(q also scaled by dk^-0.5). The same algebra, not always the same rounding: square roots
and divisions round to nearest (`sqrt_rn`, `div_rn`), exp is the hardware's approximate one,
and the norms divide where the torch form multiplies by rsqrt (a few float32 ulps). Each
program owns one (sequence, value head, block of BV value
columns): it loads that block of the sequence's state [dk, BV] from its slot once, in
float32, and stores it back; the key head it reads is h // (Hv / Hk). The conv kernel reads
each slot's last K-1 inputs, writes silu(conv) and shifts the new input in, in place.

No gather or scatter copies, no host sync; the launch shapes depend only on the number of
sequences and the layer's sizes, and the slots are read on the device, so a CUDA graph can
replay them (padding rows point at a slot no sequence owns: engine_proc/cuda_graphs.py).
A step's prefill chunks take the conv in two launches (`conv_prefill_`: the outputs, then
the new states) and the chunked rule through flash-linear-attention's kernels where
installed (gated_delta_rule_fla.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 32  # value columns per program
BLOCK_C = 256  # conv channels per program
BLOCK_T = 16  # prefill tokens per conv program


@triton.jit
def _decode_kernel(
    state_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, out_ptr,
    stride_state_slot, stride_state_head, stride_qk_row, stride_v_row, stride_gb_row,
    scale, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, BLOCK_K)
    row_ok = rows < DK
    col_ok = cols < DV
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    key_head = head // GROUP
    q = tl.load(q_ptr + seq * stride_qk_row + key_head * DK + rows, mask=row_ok,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + seq * stride_qk_row + key_head * DK + rows, mask=row_ok,
                other=0.0).to(tl.float32)
    q = q * tl.math.div_rn(scale, tl.sqrt_rn(tl.sum(q * q) + 1e-6))
    k = tl.math.div_rn(k, tl.sqrt_rn(tl.sum(k * k) + 1e-6))
    v = tl.load(v_ptr + seq * stride_v_row + head * DV + cols, mask=col_ok,
                other=0.0).to(tl.float32)
    g = tl.load(g_ptr + seq * stride_gb_row + head).to(tl.float32)
    beta = tl.load(beta_ptr + seq * stride_gb_row + head).to(tl.float32)

    block = (state_ptr + slot * stride_state_slot + head * stride_state_head
             + rows[:, None] * DV + cols[None, :])
    mask = row_ok[:, None] & col_ok[None, :]
    s = tl.load(block, mask=mask, other=0.0).to(tl.float32) * tl.exp(g)
    delta = (v - tl.sum(k[:, None] * s, axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(q[:, None] * s, axis=0)
    tl.store(block, s.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + (seq * tl.num_programs(1) + head) * DV + cols,
             o.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _conv_kernel(
    state_ptr, slots_ptr, x_ptr, weight_ptr, out_ptr,
    stride_state_slot, stride_x_row, channels,
    WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = state_ptr + slot * stride_state_slot + cols
    x = tl.load(x_ptr + seq * stride_x_row + cols, mask=ok, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH - 1):  # the taps in order, as the torch form sums them
        tap = tl.load(state + j * channels, mask=ok, other=0.0).to(tl.float32)
        acc += tap * tl.load(weight_ptr + cols * WIDTH + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(state + (j - 1) * channels, tap.to(state_ptr.dtype.element_ty), mask=ok)
    acc += x.to(tl.float32) * tl.load(weight_ptr + cols * WIDTH + WIDTH - 1, mask=ok,
                                      other=0.0).to(tl.float32)
    tl.store(state + (WIDTH - 2) * channels, x.to(state_ptr.dtype.element_ty), mask=ok)
    out = (acc.to(out_ptr.dtype.element_ty)).to(tl.float32)  # rounded once, then silu
    tl.store(out_ptr + seq * channels + cols,
             tl.math.div_rn(out, 1.0 + tl.exp(-out)).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _conv_prefill_kernel(
    state_ptr, x_ptr, weight_ptr, out_ptr, token_span_ptr, cu_ptr, slots_ptr, initial_ptr,
    stride_state_slot, stride_x_row, num_tokens, channels,
    WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Outputs of BLOCK_T tokens x BLOCK_C channels of a step's prefill chunks: each tap is
    the chunk's own input or, before its first token, its slot's state (zeros for a first
    chunk). The states are not written here: _conv_state_kernel does that after."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = tokens < num_tokens
    c_ok = cols < channels
    span = tl.load(token_span_ptr + tokens, mask=t_ok, other=0)
    start = tl.load(cu_ptr + span, mask=t_ok, other=0)
    slot = tl.load(slots_ptr + span, mask=t_ok, other=0).to(tl.int64)
    initial = tl.load(initial_ptr + span, mask=t_ok, other=0) != 0
    pos = tokens - start  # within the chunk
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(WIDTH):  # in tap order, as the torch form sums them
        src = pos - (WIDTH - 1) + j  # the tap's input, < 0: in the state
        in_x = (src >= 0) & t_ok
        in_state = (src < 0) & initial & t_ok
        tap = tl.load(x_ptr + (start + src)[:, None] * stride_x_row + cols[None, :],
                      mask=in_x[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        tap += tl.load(state_ptr + slot[:, None] * stride_state_slot
                       + (WIDTH - 1 + src)[:, None] * channels + cols[None, :],
                       mask=in_state[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(weight_ptr + cols * WIDTH + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += tap * w[None, :]
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded once, then silu
    tl.store(out_ptr + tokens[:, None] * channels + cols[None, :],
             tl.math.div_rn(y, 1.0 + tl.exp(-y)).to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@triton.jit
def _conv_state_kernel(
    state_ptr, x_ptr, cu_ptr, slots_ptr, initial_ptr, stride_state_slot, stride_x_row,
    channels, WIDTH: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """A chunk's new conv state: its last K-1 inputs, older state rows (or zeros) where the
    chunk is shorter than that."""
    span = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < channels
    start = tl.load(cu_ptr + span)
    length = tl.load(cu_ptr + span + 1) - start
    slot = tl.load(slots_ptr + span).to(tl.int64)
    initial = tl.zeros([BLOCK_C], dtype=tl.int32) + tl.load(initial_ptr + span) != 0
    state = state_ptr + slot * stride_state_slot + cols
    # ascending: row r reads state row r + length (> r) at most, not yet overwritten
    for r in tl.static_range(WIDTH - 1):
        src = tl.zeros([BLOCK_C], dtype=tl.int64) + (length - (WIDTH - 1) + r)  # per column
        from_x = tl.load(x_ptr + (start + src) * stride_x_row + cols, mask=c_ok & (src >= 0),
                         other=0.0).to(state_ptr.dtype.element_ty)
        old = tl.load(state + (WIDTH - 1 + src) * channels, mask=c_ok & (src < 0) & initial,
                      other=0.0)
        tl.store(state + r * channels, tl.where(src >= 0, from_x, old), mask=c_ok)


def gated_delta_rule_decode_(ssm_state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q, k [N, Hk, dk] and v [N, Hv, dv] (rows may be strided, heads contiguous; q and k
    rows alike), g, beta [N, Hv] (rows alike) -> o into out [N, Hv, dv] (contiguous); each
    slot's state [Hv, dk, dv] of ssm_state [slots, Hv, dk, dv] (each state contiguous)
    advances in place."""
    n, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if n:
        _decode_kernel[(n, hv, triton.cdiv(dv, BLOCK_V))](
            ssm_state, slots, q, k, v, g, beta, out,
            ssm_state.stride(0), ssm_state.stride(1), q.stride(0), v.stride(0), g.stride(0),
            dk**-0.5, GROUP=hv // hk, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
            BLOCK_V=BLOCK_V)
    return out


def conv_prefill_(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  out: torch.Tensor, cu_seqlens: torch.Tensor, token_span: torch.Tensor,
                  slots: torch.Tensor, has_initial: torch.Tensor) -> torch.Tensor:
    """A step's prefill chunks in two launches, no loop per chunk: x [T, C] (rows may be
    strided; chunk i is rows cu_seqlens[i]..cu_seqlens[i+1]), token_span int32 [T] (each
    row's chunk), weight [C, K] contiguous -> silu(conv) into out [T, C] (contiguous); each
    chunk starts from its slot's state where has_initial (bool [N]) says so, else zeros, and
    leaves its last K-1 inputs there."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    initial = has_initial.to(torch.int32)
    if num_tokens:
        _conv_prefill_kernel[(triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
            conv_state, x, weight, out, token_span, cu_seqlens, slots, initial,
            conv_state.stride(0), x.stride(0), num_tokens, channels,
            WIDTH=width, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C,
            num_warps=8)  # at 4, float32 inputs spill (255 registers; sm_90, compiled)
        _conv_state_kernel[(len(slots), triton.cdiv(channels, BLOCK_C))](
            conv_state, x, cu_seqlens, slots, initial, conv_state.stride(0), x.stride(0),
            channels, WIDTH=width, BLOCK_C=BLOCK_C)
    return out


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [N, C] (rows may be strided), weight [C, K] contiguous -> silu(conv) into out [N, C]
    (contiguous); each slot's state [K-1, C] of conv_state [slots, K-1, C] shifts in place."""
    n, channels = x.shape
    if n:
        _conv_kernel[(n, triton.cdiv(channels, BLOCK_C))](
            conv_state, slots, x, weight, out, conv_state.stride(0), x.stride(0), channels,
            WIDTH=weight.shape[1], BLOCK_C=BLOCK_C)
    return out
