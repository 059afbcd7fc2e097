"""The ops of a Gated DeltaNet layer in pure torch: the causal depthwise conv over its q/k/v
channels and the gated delta rule, each with the state a sequence carries between steps.

The delta rule keeps, per value head, a matrix S [dk, dv] (fp32). Per token t, with q and k
L2-normalized and q scaled by dk^-0.5 (each key head serves Hv/Hk consecutive value heads):

    S = exp(g_t) * S;  S = S + k_t (x) ((v_t - S^T k_t) * beta_t);  o_t = S^T q_t

`recurrent_gated_delta_rule` runs that token by token (decodes: one token for a whole
batch at once, short prefill chunks); `chunk_gated_delta_rule` runs it 64 tokens at a time
through the UT transform (long prefill chunks). Both take the state a sequence stopped at
and give back the one it ends at, so a prompt can be cut anywhere. The op order is
transformers' (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`), so
fp32 results agree with it to rounding; the code is this project's.

The conv keeps the last K-1 inputs of each channel (`conv_state` [K-1, C]): a chunk's
outputs are the conv over those and its own inputs, and its last K-1 inputs (older state
columns too, for a chunk shorter than that) become the new state.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per block of the chunked rule (the padding unit)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """[B, L, H*, d] inputs -> fp32 [B, Hv, L, d] with q, k normalized (q also scaled) and
    the key heads repeated over their value heads; g, beta -> fp32 [B, Hv, L]."""
    groups = v.shape[2] // k.shape[2]
    if groups != 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
                        for x in (q, k, v, beta, g))
    q = l2norm(q)
    k = l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, L, Hk, dk], v [B, L, Hv, dv], g (log decay, <= 0) and beta [B, L, Hv],
    initial_state fp32 [B, Hv, dk, dv] or None (zeros) -> (o [B, L, Hv, dv] in v's dtype,
    final state fp32 [B, Hv, dk, dv]). Padding to a multiple of CHUNK with zero k, beta and
    g leaves the state as it is, so the final state is the last real token's."""
    dtype = v.dtype
    batch, length = k.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    pad = -length % CHUNK
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    num_chunks = (length + pad) // CHUNK
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(batch, heads, num_chunks, CHUNK, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    cum = g.reshape(batch, heads, num_chunks, CHUNK).cumsum(dim=-1)
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay  # I + strictly-lower part, solved below
    intra = (q @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        system, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    state = (torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device)
             if initial_state is None else initial_state.to(torch.float32))
    out = torch.empty_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, heads, -1, dv)[:, :, :length]
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    initial_state: torch.Tensor | None = None, in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token; same arguments and results as chunk_gated_delta_rule. Per
    token: three passes over the state (decay, write, read) besides the read of k^T S.
    in_place: advance `initial_state` itself (a contiguous fp32 tensor the caller owns, as a
    batch of states gathered by slot) instead of a copy."""
    dtype = v.dtype
    batch, length = k.shape[:2]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    heads, dk, dv = v.shape[1], k.shape[-1], v.shape[-1]
    if initial_state is None:
        state = torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=q.device)
    elif in_place and initial_state.dtype == torch.float32 and initial_state.is_contiguous():
        state = initial_state
    else:
        state = initial_state.to(torch.float32, copy=True)
    flat = state.view(batch * heads, dk, dv)
    out = torch.empty(batch, heads, length, dv, dtype=torch.float32, device=q.device)
    for t in range(length):
        k_t = k[:, :, t].reshape(batch * heads, 1, dk)
        flat.mul_(g[:, :, t].exp().reshape(-1, 1, 1))
        delta = (v[:, :, t].reshape(-1, 1, dv) - torch.bmm(k_t, flat)) * beta[:, :, t].reshape(-1, 1, 1)
        flat.baddbmm_(k_t.transpose(1, 2), delta)
        out[:, :, t] = torch.bmm(q[:, :, t].reshape(batch * heads, 1, dk), flat).view(batch, heads, dv)
    return out.transpose(1, 2).to(dtype, memory_format=torch.contiguous_format), state


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C] (one sequence's new inputs), weight [C, K], state [K-1, C] or None (zeros)
    -> (silu(conv) [L, C] in the weight's dtype, the new state [K-1, C]). The conv is K
    shifted multiply-adds over time-major rows (oneDNN's depthwise conv1d took ~8 ms for
    one decode step of Qwen3.5-0.8B's 6144 channels)."""
    width = weight.shape[1]
    length = x.shape[0]
    x = x.to(weight.dtype)
    if state is None:
        state = x.new_zeros(width - 1, x.shape[1])
    full = torch.cat([state.to(weight.dtype), x])
    return _silu_conv([full[j : j + length] for j in range(width)], weight), full[length:]


def _silu_conv(taps: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """silu(sum_j taps[j] * weight[:, j]), accumulated in fp32 and rounded once to the
    weight's dtype, as F.conv1d does (bf16 results then equal transformers')."""
    w = weight.float()
    out = taps[0].float() * w[:, 0]
    for j in range(1, len(taps)):
        out.addcmul_(taps[j].float(), w[:, j])
    return F.silu(out.to(weight.dtype))


def causal_conv_step(
    x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: x [N, C], states [N, K-1, C] -> (silu(conv) [N, C], the
    new states [N, K-1, C])."""
    full = torch.cat([states.to(weight.dtype), x.to(weight.dtype).unsqueeze(1)], dim=1)
    return _silu_conv([full[:, j] for j in range(weight.shape[1])], weight), full[:, 1:]
