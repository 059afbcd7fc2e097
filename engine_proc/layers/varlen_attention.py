"""Attention over a packed batch of sequences of different lengths, without padding.

One entry, `varlen_kernel(device, dtype, head_dim)`, gives the function to call for a
device: torch's `torch.nn.attention.varlen.varlen_attn` (FlashAttention-2, CUDA only, fp16 or
bf16, head sizes up to 256 in multiples of 8) or None where it cannot run, so callers keep
their own path there. `varlen_reference` is the same op in plain SDPA, one call per
sequence: the tests' reference and what the CPU tests run the packed layouts through.

Both take (what torch 2.11's varlen_attn has; 2.12 and later want `enable_gqa` for fewer
key heads, which `_flash` passes where the signature has it; 2.10's form is not used):
    q [Tq, Hq, D], k/v [Tk, Hkv, D] (Hkv dividing Hq), cu_q / cu_k int32 [N + 1] on the
    device, max_q / max_k host ints, scale, causal -> [Tq, Hq, D].
Causal masks are aligned bottom-right, as FlashAttention-2 does: query i of a sequence with
q_len queries and k_len keys sees keys 0 .. k_len - q_len + i (a chunk after cached keys).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine_proc.layers import kernel_check

VarlenFn = Callable[..., torch.Tensor]

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256


def varlen_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> VarlenFn | None:
    """The fast varlen attention for tensors of this device, dtype and head size, or None
    (also where its first run on the device disagreed with the reference)."""
    if (device.type != "cuda" or dtype not in FLASH_DTYPES or head_dim % 8
            or head_dim > FLASH_MAX_HEAD_DIM):
        return None
    return _checked_flash(torch.device(device))


@functools.cache
def _checked_flash(device: torch.device) -> VarlenFn | None:
    flash = _flash()
    if flash is None:
        return None
    return kernel_check.checked(lambda: _probe_flash(flash, device), device,
                                "varlen attention runs through SDPA",
                                "FlashAttention's varlen call is")


def _probe_flash(flash: VarlenFn, device: torch.device) -> VarlenFn:
    """`flash` after one small run (GQA, a causal chunk after cached keys) against the
    reference."""
    gen = kernel_check.generator()
    q = torch.randn(5, 4, 64, generator=gen).to(device, torch.bfloat16)
    k, v = (torch.randn(9, 2, 64, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    got = flash(q, k, v, cu_q, cu_k, 3, 5, scale=0.125, causal=True)
    want = varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, 3, 5, scale=0.125,
                            causal=True)
    kernel_check.agree(torch.allclose(got.float(), want, rtol=0.02, atol=0.02))
    return flash


@functools.cache
def _flash() -> VarlenFn | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params or "window_size" not in params:
        return None  # torch 2.10's first form: neither a scale nor causal chunks after keys
    # torch 2.12 and later check head counts unless told GQA is meant; 2.11 passes them on
    gqa = "enable_gqa" in params

    def flash(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, causal):
        kwargs = {"enable_gqa": q.shape[1] != k.shape[1]} if gqa else {}
        return varlen_attn(_last_dim_dense(q), _last_dim_dense(k), _last_dim_dense(v),
                           cu_q, cu_k, max_q, max_k, scale=scale,
                           window_size=(-1, 0) if causal else (-1, -1), **kwargs)

    return flash


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                     cu_k: torch.Tensor, max_q: int, max_k: int, *, scale: float,
                     causal: bool) -> torch.Tensor:
    """The op through SDPA, sequence by sequence (reads cu_q / cu_k on the host)."""
    out = q.new_empty(q.shape)
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bounds_q) - 1):
        q0, q1, k0, k1 = bounds_q[i], bounds_q[i + 1], bounds_k[i], bounds_k[i + 1]
        if q1 == q0:
            continue
        mask = None
        if causal:
            keys = torch.arange(k1 - k0, device=q.device)
            last = torch.arange(q1 - q0, device=q.device) + (k1 - k0) - (q1 - q0)
            mask = keys <= last[:, None]
        o = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1).unsqueeze(0), k[k0:k1].transpose(0, 1).unsqueeze(0),
            v[k0:k1].transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1])
        out[q0:q1] = o[0].transpose(0, 1)
    return out
