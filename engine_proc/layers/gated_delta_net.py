"""Gated DeltaNet (Qwen3.5's linear-attention layer) over a flat batch, with each
sequence's conv and recurrent state in a slot of its own.

Per layer: one projection of the whole batch into q/k/v (conv channels), the output gate z
and the b/a heads; the causal conv and the delta rule (layers/gated_delta_rule.py); the
gated RMSNorm; out_proj. The leading decodes of a batch run as one batch: their states
advance one token in their slots, each state read and written in place by a kernel
(`decode_kernels`, picked once per layer when its states are assigned:
layers/gated_delta_rule_cpu.py on a CPU in float32,
gated_delta_rule_triton.py on a GPU); elsewhere they are gathered by slot and scattered
back. Each prefill chunk then runs
on its own, from its slot's state when earlier chunks of its sequence ran
(`has_initial_state`: tokens were computed before this chunk), else from zeros, and leaves
its final state in the slot. So a chunk may end anywhere, and a slot's earlier owner is
never read. Short chunks use the token-by-token rule (the chunked one pads to 64 tokens).

The model runner assigns `conv_state` [slots, K-1, channels] (model dtype) and
`ssm_state` [slots, Hv, dk, dv] (fp32 by default) to every layer, as it assigns the KV
cache to attention layers; without them (no state allocated) every sequence starts from
zeros and nothing is kept.

Tensor parallelism: a rank holds Hk/tp key heads and Hv/tp value heads, so a value head's
key head stays on its rank; q, k and v rows of `in_proj_qkv` and of the conv are cut
apart per part, and out_proj is row parallel.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from engine_proc.context import Context
from engine_proc.distributed import REPLICATED, Shard
from engine_proc.layers import gated_delta_rule_cpu, gated_delta_rule_fla, kernel_check
from engine_proc.layers.eager_op import eager_op
from engine_proc.layers.gated_delta_rule import (
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.rms_norm import GatedRMSNorm
from shared.model_config import TextConfig

RECURRENT_MAX_TOKENS = 8  # prefill chunks this short run token by token
# Longer chunks of one step run the chunked rule together, zero-padded to the longest of
# their group, while the padding stays under this share of the group's tokens: one call
# instead of one per sequence (tiny model, 32 chunks of 60 tokens: 22 against 49 ms).
MAX_PADDING_SHARE = 0.5


@dataclass
class _Span:
    """A prefill chunk: tokens [start, end) of the batch, its sequence's slot, and whether
    that slot holds the state its earlier tokens left."""

    start: int
    end: int
    slot: int
    has_initial_state: bool


@dataclass
class StateMetadata:
    num_decodes: int
    decode_slots: torch.Tensor | None  # int64 [num_decodes] on the device
    spans: list[_Span]
    keep: bool = True  # the sequences have slots: read and write their states
    # the delta rule's plan, the same for every layer: spans run token by token, and
    # groups of longer ones run by the chunked rule together (_padding_groups)
    short: list[_Span] = field(init=False)
    groups: list[list[_Span]] = field(init=False)

    def __post_init__(self) -> None:
        self.short = [sp for sp in self.spans if sp.end - sp.start <= RECURRENT_MAX_TOKENS]
        self.groups = _padding_groups(
            [sp for sp in self.spans if sp.end - sp.start > RECURRENT_MAX_TOKENS])
        self._on_device: tuple | None = None

    def span_tensors(self, device: torch.device) -> tuple:
        """(cu_seqlens int64 [N+1] from the first span's start, slots int64 [N], has_initial
        bool [N] or None when no state is kept) on `device`, built once for all layers."""
        return self._device_tensors(device)[:3]

    def token_spans(self, device: torch.device) -> torch.Tensor:
        """int32 [prefill tokens]: each prefill token's span, built once for all layers."""
        return self._device_tensors(device)[3]

    def _device_tensors(self, device: torch.device) -> tuple:
        """All four in one copy, from pinned memory on a GPU (a copy from pageable memory
        would wait for the work already queued)."""
        if self._on_device is None:
            n = len(self.spans)
            lengths = np.asarray([sp.end - sp.start for sp in self.spans])
            cu = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(lengths, out=cu[1:])
            flat = torch.from_numpy(np.concatenate([
                cu, [max(sp.slot, 0) for sp in self.spans],
                [sp.has_initial_state for sp in self.spans],
                np.repeat(np.arange(n), lengths)]).astype(np.int64))
            if device.type == "cuda":
                flat = flat.pin_memory()
            cu, slots, initial, tokens = flat.to(device, non_blocking=True).split(
                [n + 1, n, n, int(cu[-1])])
            self._on_device = (cu, slots, initial.bool() if self.keep else None,
                               tokens.to(torch.int32))
        return self._on_device


def build_state_metadata(ctx: Context, num_tokens: int) -> StateMetadata:
    """The Gated DeltaNet layout of one forward (once, for all layers): no device reads."""
    if ctx.state_slots is None:  # no state (a profiling forward): one fresh span per sequence
        q_lens = ctx.q_lens_host or [num_tokens]
        return StateMetadata(0, None, _spans(q_lens, [0] * len(q_lens), [-1] * len(q_lens), 0),
                             keep=False)
    if ctx.all_decode:
        return StateMetadata(ctx.state_slots.shape[0], ctx.state_slots, [])
    q_lens = ctx.q_lens_host
    num_decodes = ctx.num_decodes
    if num_decodes is None:
        num_decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
    computed = [s - q for s, q in zip(ctx.seq_lens_host, q_lens, strict=True)]
    spans = _spans(q_lens[num_decodes:], computed[num_decodes:],
                   ctx.state_slots_host[num_decodes:], num_decodes)
    decode_slots = ctx.state_slots[:num_decodes] if num_decodes else None
    return StateMetadata(num_decodes, decode_slots, spans)


def _spans(q_lens: list[int], computed: list[int], slots: list[int], start: int) -> list[_Span]:
    spans = []
    for q_len, done, slot in zip(q_lens, computed, slots, strict=True):
        spans.append(_Span(start, start + q_len, slot, done > 0 and slot >= 0))
        start += q_len
    return spans


class _InProj(MergedLinear):
    """q/k/v (one checkpoint tensor, `in_proj_qkv`), z, b and a as one matmul. Split over
    ranks, the qkv tensor's rows are cut per part: this rank's heads of q, of k, of v."""

    def __init__(self, hidden: int, qkv_sizes: list[int], num_v_heads: int, value_dim: int,
                 shard: Shard) -> None:
        super().__init__(hidden, [sum(qkv_sizes), value_dim, num_v_heads, num_v_heads],
                         bias=False, shard=shard)
        self.qkv_sizes = qkv_sizes

    def checkpoint_slice(self, leaf: str, shard: int | None, shape: tuple[int, ...]):
        if shard == 0:
            return None  # three row ranges: read whole, cut in load_shard
        return super().checkpoint_slice(leaf, shard, shape)

    def load_shard(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        if shard == 0:
            loaded = rank_rows(loaded, self.qkv_sizes, self.shard)
        super().load_shard(param, loaded, shard)


def rank_rows(tensor: torch.Tensor, sizes: list[int], shard: Shard) -> torch.Tensor:
    """This rank's rows of each of the consecutive parts `sizes` of `tensor`, stacked."""
    if shard.size == 1:
        return tensor
    parts = tensor.split(sizes)
    return torch.cat([p[slice(*shard.split(p.shape[0]))] for p in parts])


class _Conv(nn.Module):
    """The depthwise conv's weight, [channels, K] (checkpoints: [channels, 1, K])."""

    def __init__(self, channels: int, width: int, qkv_sizes: list[int], shard: Shard) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))
        self.qkv_sizes = qkv_sizes
        self.shard = shard

    def load_tensor(self, key: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
        tensor = rank_rows(tensor.reshape(tensor.shape[0], -1), self.qkv_sizes, self.shard)
        if tensor.shape != param.shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.copy_(tensor)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig, shard: Shard = REPLICATED) -> None:
        super().__init__()
        self.num_k_heads = cfg.linear_num_key_heads // shard.size
        self.num_v_heads = cfg.linear_num_value_heads // shard.size
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        self.shard = shard
        key_dim = cfg.linear_num_key_heads * self.head_k_dim
        value_dim = cfg.linear_num_value_heads * self.head_v_dim
        qkv_sizes = [key_dim, key_dim, value_dim]
        self.local_sizes = [size // shard.size for size in qkv_sizes]
        self.in_proj = _InProj(cfg.hidden_size, qkv_sizes, cfg.linear_num_value_heads,
                               value_dim, shard)
        self.conv1d = _Conv(sum(self.local_sizes), cfg.linear_conv_kernel_dim, qkv_sizes, shard)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, cfg.hidden_size, bias=False, shard=shard)
        self.conv_state = torch.tensor([])
        self.ssm_state = torch.tensor([])
        self.kernels = None  # the decode kernels for these states (`use_states`)
        self.prefill_rule = None  # the varlen chunked rule for prefills (`use_states`)

    def use_states(self, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> None:
        """Keep each sequence's state in these slot tensors ([slots, K-1, channels],
        [slots, Hv, dk, dv]); the kernels that advance them in place, and the prefills'
        chunked rule (flash-linear-attention's on a GPU), are picked here, once."""
        self.conv_state, self.ssm_state = conv_state, ssm_state
        self.kernels = decode_kernels(ssm_state, conv_state)
        self.prefill_rule = gated_delta_rule_fla.prefill_rule(
            ssm_state.device,
            (self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def load_tensor(self, key: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
        """A_log and dt_bias: this rank's value heads."""
        tensor = tensor[slice(*self.shard.split(tensor.shape[0]))]
        if tensor.shape != param.shape:
            raise ValueError(f"{key}: shape {tuple(tensor.shape)} != {tuple(param.shape)}")
        param.copy_(tensor)

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; the sequences' states advance in their slots."""
        num_tokens = x.shape[0]
        conv_dim = self.conv1d.weight.shape[0]
        qkv, z, b, a = self.in_proj(x).split(
            [conv_dim, self.num_v_heads * self.head_v_dim, self.num_v_heads, self.num_v_heads],
            dim=-1)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        core = eager_op(self._advance, (qkv, g, beta), meta)
        core = self.norm(core.view(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(core.view(num_tokens, -1))

    def _advance(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 meta: StateMetadata) -> torch.Tensor:
        """The conv and the delta rule over the step's tokens, the states in their slots
        advanced: [T, Hv, dv]. Eager in a mixed step's graphs (layers/eager_op.py)."""
        num_tokens = qkv.shape[0]
        kernels = self.kernels if meta.keep else None
        qkv = self._conv(qkv, meta, kernels)
        q, k, v = qkv.split(self.local_sizes, dim=-1)
        q = q.view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)
        return self._delta_rule(q, k, v, g, beta, meta, kernels)

    def _conv(self, qkv: torch.Tensor, meta: StateMetadata, kernels) -> torch.Tensor:
        """kernels: those (`decode_kernels`) that advance the decodes' conv states in their
        slots, and on a GPU the prefill chunks' in two launches; None: gather the decodes'
        states and scatter them back, and run the chunks one by one."""
        weight = self.conv1d.weight
        out = torch.empty_like(qkv)
        n = meta.num_decodes
        if kernels and n:
            kernels.conv_decode_(self.conv_state, meta.decode_slots, qkv[:n], weight, out[:n])
        elif n:
            states = self.conv_state.index_select(0, meta.decode_slots)
            out[:n], states = causal_conv_step(qkv[:n], weight, states)
            self.conv_state.index_copy_(0, meta.decode_slots, states.to(self.conv_state.dtype))
        if meta.spans and hasattr(kernels, "conv_prefill_"):
            first = meta.spans[0].start
            cu, slots, has_initial = meta.span_tensors(qkv.device)
            kernels.conv_prefill_(self.conv_state, qkv[first:], weight, out[first:], cu,
                                  meta.token_spans(qkv.device), slots, has_initial)
            return out
        keep = meta.keep
        for span in meta.spans:
            state = self.conv_state[span.slot] if keep and span.has_initial_state else None
            out[span.start : span.end], state = causal_conv(qkv[span.start : span.end], weight, state)
            if keep:
                self.conv_state[span.slot] = state
        return out

    def _delta_rule(self, q, k, v, g, beta, meta: StateMetadata, kernels) -> torch.Tensor:
        out = v.new_empty(v.shape)
        n = meta.num_decodes
        if kernels and n:
            kernels.gated_delta_rule_decode_(
                self.ssm_state, meta.decode_slots, q[:n], k[:n], v[:n], g[:n], beta[:n], out[:n])
        elif n:
            states = self.ssm_state.index_select(0, meta.decode_slots)
            o, states = recurrent_gated_delta_rule(
                q[:n, None], k[:n, None], v[:n, None], g[:n, None], beta[:n, None],
                initial_state=states, in_place=True)
            out[:n] = o[:, 0]
            self.ssm_state.index_copy_(0, meta.decode_slots, states.to(self.ssm_state.dtype))
        keep = meta.keep
        if meta.spans and (rule := self.prefill_rule) is not None:
            gated_delta_rule_fla.prefill_(rule, self.ssm_state, meta.spans[0].start,
                                          *meta.span_tensors(q.device), q, k, v, g, beta, out)
            return out
        for span in meta.short:
            self._one_span(recurrent_gated_delta_rule, span, (q, k, v, g, beta), out, keep)
        for group in meta.groups:
            if len(group) == 1:
                self._one_span(chunk_gated_delta_rule, group[0], (q, k, v, g, beta), out, keep)
            else:
                self._chunk_group(group, q, k, v, g, beta, out, keep)
        return out

    def _one_span(self, rule, span: _Span, inputs: tuple, out: torch.Tensor,
                  keep: bool) -> None:
        """One prefill chunk through `rule`, from and back to its slot."""
        s, e = span.start, span.end
        state = self.ssm_state[span.slot][None] if keep and span.has_initial_state else None
        o, state = rule(*(x[None, s:e] for x in inputs), initial_state=state)
        out[s:e] = o[0]
        if keep:
            self.ssm_state[span.slot] = state[0]

    def _chunk_group(self, group: list[_Span], q, k, v, g, beta, out: torch.Tensor,
                     keep: bool) -> None:
        """The chunked rule over several prefill chunks at once, each zero-padded at its end
        to the longest: zero k, beta and g leave a state as it is, so each sequence's final
        state is its last real token's."""
        padded = [pad_sequence([x[span.start : span.end] for span in group], batch_first=True)
                  for x in (q, k, v, g, beta)]
        state = None
        if keep and any(span.has_initial_state for span in group):
            state = torch.stack([self.ssm_state[span.slot] if span.has_initial_state
                                 else self.ssm_state.new_zeros(self.ssm_state.shape[1:])
                                 for span in group])
        o, state = chunk_gated_delta_rule(*padded, initial_state=state)
        for i, span in enumerate(group):
            out[span.start : span.end] = o[i, : span.end - span.start]
            if keep:
                self.ssm_state[span.slot] = state[i]


def decode_kernels(ssm_state: torch.Tensor, conv_state: torch.Tensor):
    """The module whose `gated_delta_rule_decode_` and `conv_decode_` advance a layer's
    decodes in their slots on its states' device (the C kernels on a CPU in float32, the
    Triton ones on a GPU), or None: the torch form, states gathered and scattered back."""
    if conv_state.is_cuda:
        kernels = _triton_kernels(conv_state.device)
        states_ok = (ssm_state.stride(3) == 1 and ssm_state.stride(2) == ssm_state.shape[3]
                     and conv_state.is_contiguous())
        return kernels if kernels is not None and states_ok else None
    if gated_delta_rule_cpu.applies(ssm_state, conv_state):
        return gated_delta_rule_cpu
    return None


@functools.cache
def _triton_kernels(device: torch.device):
    return kernel_check.checked(lambda: _probe_kernels(device), device,
                                "Gated DeltaNet decodes gather and scatter their states",
                                "the Triton kernels are")


def _probe_kernels(device: torch.device):
    """The Triton kernels after one small run against the torch forms: the decode rule and
    conv by slot (two slots of three, out of order), and the prefill conv (a chunk from its
    slot's state, one from zeros)."""
    from engine_proc.layers import gated_delta_rule_triton as kernels

    gen = kernel_check.generator()

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    slots = torch.tensor([2, 0], device=device)
    state = randn(3, 2, 32, 32)
    q, k = (F.normalize(randn(2, 1, 32), dim=-1) for _ in range(2))
    v = randn(2, 2, 32)
    g, beta = -randn(2, 2).abs(), randn(2, 2).sigmoid()
    want, want_state = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None],
                                                  g[:, None], beta[:, None],
                                                  initial_state=state[slots])
    out = torch.empty(2, 2, 32, device=device)
    kernels.gated_delta_rule_decode_(state, slots, q, k, v, g, beta, out)
    conv = randn(3, 3, 48)
    weight, x = randn(48, 4), randn(2, 48)
    conv_want, conv_state = causal_conv_step(x, weight, conv[slots])
    conv_out = torch.empty(2, 48, device=device)
    kernels.conv_decode_(conv, slots, x, weight, conv_out)
    pairs = [(out, want[:, 0]), (state[slots], want_state), (conv_out, conv_want),
             (conv[slots], conv_state)]
    chunks, before = randn(9, 48), conv.clone()
    cu = torch.tensor([0, 2, 9], device=device)
    chunk_out = torch.empty(9, 48, device=device)
    kernels.conv_prefill_(conv, chunks, weight, chunk_out, cu,
                          torch.tensor([0] * 2 + [1] * 7, dtype=torch.int32, device=device),
                          slots, torch.tensor([True, False], device=device))
    for (start, end), slot, initial in (((0, 2), 2, before[2]), ((2, 9), 0, None)):
        chunk_want, chunk_state = causal_conv(chunks[start:end], weight, initial)
        pairs += [(chunk_out[start:end], chunk_want), (conv[slot], chunk_state)]
    kernel_check.agree(all(torch.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in pairs),
                       "their probe disagrees with the torch forms")
    return kernels


def _padding_groups(spans: list[_Span]) -> list[list[_Span]]:
    """Spans grouped longest first, a group closed when padding its members to its longest
    would exceed MAX_PADDING_SHARE of its tokens."""
    groups: list[list[_Span]] = []
    tokens = 0
    for span in sorted(spans, key=lambda sp: sp.start - sp.end):
        length = span.end - span.start
        if groups:
            longest = groups[-1][0].end - groups[-1][0].start
            if longest * (len(groups[-1]) + 1) <= (1 + MAX_PADDING_SHARE) * (tokens + length):
                groups[-1].append(span)
                tokens += length
                continue
        groups.append([span])
        tokens = length
    return groups
