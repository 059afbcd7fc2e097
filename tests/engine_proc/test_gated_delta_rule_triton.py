"""The Triton decode kernels (by slot, in place) against the torch form: several steps, slots
out of order, two value heads per key head, a head dim that is not a power of two. Without
CUDA they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""

from __future__ import annotations

import pytest
import torch

from tests.triton_device import DEVICE, runs_triton

pytest.importorskip("triton")
from engine_proc.layers import gated_delta_rule_triton as kernel  # noqa: E402
from engine_proc.layers.gated_delta_rule import (  # noqa: E402
    causal_conv_step,
    recurrent_gated_delta_rule,
)
from tests.tolerance import tolerance_for  # noqa: E402

pytestmark = [pytest.mark.numeric, runs_triton]

SLOTS, STEPS = 7, 3
SLOT_OF = torch.tensor([5, 1, 3], dtype=torch.int64, device=DEVICE)


def _step_inputs(n: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator):
    width = 2 * hk * dk + hv * dv
    qkv = torch.randn(n, width + 8, generator=gen).to(DEVICE)  # rows wider than q|k|v
    q = qkv[:, : hk * dk].view(n, hk, dk)
    k = qkv[:, hk * dk : 2 * hk * dk].view(n, hk, dk)
    v = qkv[:, 2 * hk * dk : width].view(n, hv, dv)
    g = (-torch.rand(n, hv, generator=gen) * 2).to(DEVICE)
    beta = torch.rand(n, hv, generator=gen).to(DEVICE)
    return q, k, v, g, beta


@pytest.mark.parametrize("dk,dv", [(32, 32), (24, 40)])
def test_decode_advances_each_slot_in_place_as_the_torch_rule(dk, dv):
    hk, hv = 2, 4
    gen = torch.Generator().manual_seed(dk)
    cache = torch.randn(SLOTS, hv, dk, dv, generator=gen).to(DEVICE)
    reference = cache[SLOT_OF].clone()
    untouched = [s for s in range(SLOTS) if s not in SLOT_OF.tolist()]
    before = cache[untouched].clone()
    for _ in range(STEPS):
        q, k, v, g, beta = _step_inputs(len(SLOT_OF), hk, hv, dk, dv, gen)
        out = torch.empty(len(SLOT_OF), hv, dv, device=DEVICE)
        kernel.gated_delta_rule_decode_(cache, SLOT_OF, q, k, v, g, beta, out)
        ref_out, reference = recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
            initial_state=reference)
        # a sum over dk per step, chained over the steps; |q| = dk^-1/2 after its norm, so
        # the state's size is the scale of both
        torch.testing.assert_close(out, ref_out[:, 0], **tolerance_for(reference, STEPS * dk))
    torch.testing.assert_close(cache[SLOT_OF], reference, **tolerance_for(reference, STEPS * dk))
    assert torch.equal(cache[untouched], before)


@pytest.mark.parametrize("channels,width", [(48, 4), (300, 3)])
def test_conv_step_shifts_each_slot_in_place_as_the_torch_step(channels, width):
    gen = torch.Generator().manual_seed(channels)
    cache = torch.randn(SLOTS, width - 1, channels, generator=gen).to(DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(DEVICE)
    reference = cache[SLOT_OF].clone()
    untouched = [s for s in range(SLOTS) if s not in SLOT_OF.tolist()]
    before = cache[untouched].clone()
    for _ in range(STEPS):
        x = torch.randn(len(SLOT_OF), channels + 16, generator=gen).to(DEVICE)[:, 8 : 8 + channels]
        out = torch.empty(len(SLOT_OF), channels, device=DEVICE)
        kernel.conv_decode_(cache, SLOT_OF, x, weight, out)
        ref_out, reference = causal_conv_step(x, weight, reference)
        torch.testing.assert_close(out, ref_out, **tolerance_for(ref_out, width))
        assert torch.equal(cache[SLOT_OF], reference)  # a shift: the same bits
    assert torch.equal(cache[untouched], before)


@pytest.mark.parametrize("width", [4, 3])
def test_prefill_conv_of_a_steps_chunks_matches_the_torch_form_per_chunk(width):
    """Chunks of 1, 2, 5 and 40 tokens (shorter and longer than the state), two of them
    continuing from their slot's state, in one call; the states they leave are the torch
    form's, bit for bit, and other slots keep theirs."""
    from engine_proc.layers.gated_delta_rule import causal_conv

    gen = torch.Generator().manual_seed(width)
    channels, lens, initial = 300, [1, 2, 5, 40], [True, False, True, False]
    slots = torch.tensor([5, 0, 2, 6], device=DEVICE)
    cache = torch.randn(SLOTS, width - 1, channels, generator=gen).to(DEVICE)
    weight = torch.randn(channels, width, generator=gen).to(DEVICE)
    total = sum(lens)
    x = torch.randn(total, channels + 8, generator=gen).to(DEVICE)[:, 4 : 4 + channels]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    token_span = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    untouched = [s for s in range(SLOTS) if s not in slots.tolist()]
    before = cache.clone()
    out = torch.empty(total, channels, device=DEVICE)
    kernel.conv_prefill_(cache, x, weight, out, cu, token_span.to(torch.int32).to(DEVICE),
                         slots, torch.tensor(initial, device=DEVICE))
    for i, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        state = before[slots[i]] if initial[i] else None
        ref_out, ref_state = causal_conv(x[start:end], weight, state)
        torch.testing.assert_close(out[start:end], ref_out, **tolerance_for(ref_out, width))
        assert torch.equal(cache[slots[i]], ref_state)
    assert torch.equal(cache[untouched], before[untouched])
