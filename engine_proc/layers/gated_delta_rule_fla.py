"""Prefill chunks of Gated DeltaNet on a GPU through flash-linear-attention's chunked gated
delta rule (the `fla-core` package, Triton): every prefill chunk of a step in one varlen call
(`cu_seqlens`, no padding, no Python loop per sequence), each starting from its slot's state
(zeros for a sequence's first chunk) and leaving its final state there.

Same maths as the torch form (gated_delta_rule.py: `chunk_gated_delta_rule`, the reference
the GPU checks compare with): q and k l2-normalized in the kernel, q scaled by dk^-0.5
(FLA's default scale), g the log decay, beta applied to k and v. Where fla-core is not
installed (the `gpu` extra; scripts/setup.sh installs it where an NVIDIA GPU is visible),
`chunk_rule()` is None, one line is logged, and the torch form runs.
"""

from __future__ import annotations

import functools
import logging

import torch

from engine_proc.layers import kernel_check

logger = logging.getLogger(__name__)


@functools.cache
def chunk_rule():
    """FLA's `chunk_gated_delta_rule`, or None where fla-core cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # ImportError, or a Triton/driver mismatch at import
        logger.warning("flash-linear-attention unavailable (%s): Gated DeltaNet prefills run "
                       "the torch rule (pip install 'flatserve[gpu]')", e)
        return None
    return chunk_gated_delta_rule


PROBE_DIMS = (1, 2, 32, 32)  # key heads, value heads, key dim, value dim


def prefill_rule(device: torch.device, dims: tuple[int, int, int, int] = PROBE_DIMS):
    """The varlen chunked rule for prefills on `device`: FLA's on a GPU where installed and
    where its first run there, at the layer's `dims` (key heads, value heads, key and value
    head dims), agreed with the torch form, else None (the torch form)."""
    return _checked_rule(torch.device(device), dims) if device.type == "cuda" else None


@functools.cache
def _checked_rule(device: torch.device, dims: tuple[int, int, int, int] = PROBE_DIMS):
    rule = chunk_rule()
    if rule is None:
        return None
    return kernel_check.checked(lambda: _probe_rule(rule, device, dims), device,
                                "Gated DeltaNet prefills run the torch rule",
                                "flash-linear-attention's is")


def _probe_rule(rule, device: torch.device, dims: tuple[int, int, int, int]):
    """FLA's rule after one small run through `prefill_` at the layer's dims (so its
    kernels compile, and tune, for them at start): two chunks of 7 and 13 tokens, one from
    its slot's state, one from zeros; bf16 inputs, fp32 states; against the torch form."""
    from engine_proc.layers.gated_delta_rule import chunk_gated_delta_rule

    gen = kernel_check.generator()

    def rand(*shape, normal=True):
        return (torch.randn if normal else torch.rand)(*shape, generator=gen).to(device)

    hk, hv, dk, dv = dims
    q, k = (rand(20, hk, dk).to(torch.bfloat16) for _ in range(2))
    v = rand(20, hv, dv).to(torch.bfloat16)
    g = -rand(20, hv, normal=False)
    beta = rand(20, hv, normal=False).to(torch.bfloat16)
    states = rand(3, hv, dk, dv) * 0.1
    before = states.clone()
    cu = torch.tensor([0, 7, 20], device=device)
    slots = torch.tensor([2, 0], device=device)
    out = torch.empty_like(v)
    prefill_(rule, states, 0, cu, slots, torch.tensor([True, False], device=device),
             q, k, v, g, beta, out)
    for (start, end), slot, initial in (((0, 7), 2, before[2][None]), ((7, 20), 0, None)):
        want, final = chunk_gated_delta_rule(*(x[None, start:end] for x in (q, k, v, g, beta)),
                                             initial_state=initial)
        kernel_check.agree(
            torch.allclose(out[start:end].float(), want[0].float(), rtol=0.05, atol=0.05)
            and torch.allclose(states[slot], final[0], rtol=0.05, atol=0.05))
    return rule


def prefill_(rule, ssm_state: torch.Tensor, start: int, cu_seqlens: torch.Tensor,
             slots: torch.Tensor, has_initial: torch.Tensor | None, q, k, v, g, beta,
             out: torch.Tensor) -> None:
    """The chunks cut at `cu_seqlens` (int64 [N+1], offsets from `start`) of the batch's
    tokens from `start` on: q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv]; outputs into
    out [T, Hv, dv]. slots [N]: each chunk's state slot; has_initial [N] bool (None: all start
    from zeros and no state is kept, a profiling forward)."""
    inputs = [x[None, start:] for x in (q, k, v, g, beta)]
    initial = None
    if has_initial is not None:  # a sequence's first chunk starts from zeros
        states = ssm_state.index_select(0, slots).float()
        initial = torch.where(has_initial.view(-1, 1, 1, 1), states, 0.0)
    o, final = rule(*inputs, initial_state=initial, output_final_state=has_initial is not None,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)
    out[start:] = o[0]
    if has_initial is not None:
        ssm_state.index_copy_(0, slots, final.to(ssm_state.dtype))
