"""Gated DeltaNet decodes with the states read and written in place by slot, float32 on a
CPU: the delta rule and the causal conv of one token per sequence.

The torch form (gated_delta_rule.py) gathers the batch's states out of their slots, runs the
rule's three passes over them (decay, write, read) and scatters them back: with 32 running,
a Qwen3.5-0.8B decode step spent ~30% of its time there, moving each 1 MiB state per layer
through memory five times each way. This kernel reads each (sequence, head) state once and
rewrites it while it is still in cache (gated_delta_rule_cpu.c says how). The conv kernel
shifts each conv state in its slot the same way.

Written in C and built on first use (engine_proc/layers/native_build.py); where it cannot
be, `library()` is None and the torch form runs (FLATSERVE_DELTA_RULE_KERNEL=0 turns it
off, to measure what it changes). The torch form stays the reference the tests compare
with.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_proc.layers import native_build

SOURCE = Path(__file__).with_suffix(".c")
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {
    "gdr_decode_f32": ([_PTR] * 8 + [_I64] * 7, None),
    "conv_decode_f32": ([_PTR] * 5 + [_I64] * 4, None),
}
MAX_DIM = 512


@functools.cache
def library():
    """The compiled kernels, or None where they cannot be built or loaded here."""
    return native_build.load(SOURCE, "FLATSERVE_DELTA_RULE_KERNEL",
                             "Gated DeltaNet decodes gather and scatter their states", SIGNATURES)


def applies(ssm_state: torch.Tensor, conv_state: torch.Tensor) -> bool:
    """Whether the kernels take a layer's decodes: CPU, float32 states (the conv state has
    the model's dtype, so its inputs are float32 too), contiguous caches, head dims a
    multiple of 32."""
    return (conv_state.device.type == "cpu"
            and ssm_state.dtype == torch.float32 and conv_state.dtype == torch.float32
            and ssm_state.is_contiguous() and conv_state.is_contiguous()
            and ssm_state.dim() == 4 and ssm_state.shape[2] % 32 == 0
            and ssm_state.shape[3] % 32 == 0 and max(ssm_state.shape[2:]) <= MAX_DIM
            and conv_state.dim() == 3 and conv_state.shape[1] >= 1
            and conv_state.shape[2] % 8 == 0 and library() is not None)


def conv_decode_(conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                 weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """x [N, C] (rows may be strided), weight [C, K] -> silu(conv) into out [N, C]
    (contiguous); each slot's state [K-1, C] advances in place."""
    n, channels = x.shape
    weight_t = _tap_major(weight)
    library().conv_decode_f32(conv_state.data_ptr(), slots.data_ptr(), x.data_ptr(),
                              weight_t.data_ptr(), out.data_ptr(), n, channels,
                              weight_t.shape[0], x.stride(0))
    return F.silu(out, inplace=True)


# each layer's conv weight tap-major (8 channels a vector), made once: by the weight's id,
# dropped when the weight dies (as many entries as live layers), remade if it is written
_TAP_MAJOR: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def _tap_major(weight: torch.Tensor) -> torch.Tensor:
    key = id(weight)
    entry = _TAP_MAJOR.get(key)
    if entry is None or entry[0]() is not weight or entry[1] != weight._version:
        alive = weakref.ref(weight, lambda _, key=key: _TAP_MAJOR.pop(key, None))
        entry = _TAP_MAJOR[key] = (alive, weight._version, weight.t().contiguous())
    return entry[2]


def gated_delta_rule_decode_(ssm_state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q, k [N, Hk, dk] and v [N, Hv, dv] (rows may be strided, heads contiguous; q and k
    rows alike), g, beta [N, Hv] -> o into out [N, Hv, dv] (contiguous); each slot's state
    [Hv, dk, dv] advances in place. q and k are l2-normalized here (q also scaled), as the
    torch form does."""
    n, hk, dk = k.shape
    hv, dv = v.shape[1:]
    g = g.to(torch.float32).contiguous()
    beta = beta.to(torch.float32).contiguous()
    library().gdr_decode_f32(ssm_state.data_ptr(), slots.data_ptr(), q.data_ptr(),
                             k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                             out.data_ptr(), n, hk, hv, dk, dv, q.stride(0), v.stride(0))
    return out
