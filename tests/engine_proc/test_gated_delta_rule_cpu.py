"""The in-place decode kernels against the torch form they replace: states scattered over a
slot cache, advanced several steps by slot, two value heads per key head. The slots no
sequence holds keep their bytes."""

from __future__ import annotations

import pytest
import torch

from engine_proc.layers import gated_delta_rule_cpu as kernel
from engine_proc.layers.gated_delta_rule import causal_conv_step, recurrent_gated_delta_rule
from tests.tolerance import tolerance_for

pytestmark = [pytest.mark.numeric,
              pytest.mark.skipif(kernel.library() is None, reason="no C compiler here")]

HK, HV, DK, DV, SLOTS, STEPS = 2, 4, 64, 32, 9, 5
SLOT_OF = torch.tensor([7, 2, 5], dtype=torch.int64)  # three sequences, out of order


def _step_inputs(n: int, gen: torch.Generator):
    qkv = torch.randn(n, 2 * HK * DK + HV * DV + 8, generator=gen)  # rows wider than q|k|v
    q = qkv[:, : HK * DK].view(n, HK, DK)
    k = qkv[:, HK * DK : 2 * HK * DK].view(n, HK, DK)
    v = qkv[:, 2 * HK * DK : 2 * HK * DK + HV * DV].view(n, HV, DV)
    g = -torch.rand(n, HV, generator=gen) * 2
    beta = torch.rand(n, HV, generator=gen)
    return q, k, v, g, beta


def test_decode_advances_each_slot_in_place_as_the_torch_rule():
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(SLOTS, HV, DK, DV, generator=gen)
    reference = cache[SLOT_OF].clone()
    untouched = [s for s in range(SLOTS) if s not in SLOT_OF.tolist()]
    before = cache[untouched].clone()
    for _ in range(STEPS):
        q, k, v, g, beta = _step_inputs(len(SLOT_OF), gen)
        out = kernel.gated_delta_rule_decode_(cache, SLOT_OF, q, k, v, g, beta,
                                              torch.empty(len(SLOT_OF), HV, DV))
        ref_out, reference = recurrent_gated_delta_rule(
            q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
            initial_state=reference)
        # the state: a sum over DK per step, chained over the steps; each output is q.S
        # with |q| = DK^-1/2, so the state's size is the scale of both
        bound = tolerance_for(reference, STEPS * DK)
        torch.testing.assert_close(out, ref_out[:, 0], **bound)
    torch.testing.assert_close(cache[SLOT_OF], reference, **tolerance_for(reference, STEPS * DK))
    assert torch.equal(cache[untouched], before)


def test_conv_step_shifts_each_slot_in_place_as_the_torch_step():
    gen = torch.Generator().manual_seed(1)
    channels, width = 48, 4
    cache = torch.randn(SLOTS, width - 1, channels, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    reference = cache[SLOT_OF].clone()
    untouched = [s for s in range(SLOTS) if s not in SLOT_OF.tolist()]
    before = cache[untouched].clone()
    for _ in range(STEPS):
        x = torch.randn(len(SLOT_OF), channels + 16, generator=gen)[:, 8 : 8 + channels]
        out = kernel.conv_decode_(cache, SLOT_OF, x, weight, torch.empty(len(SLOT_OF), channels))
        ref_out, reference = causal_conv_step(x, weight, reference)
        torch.testing.assert_close(out, ref_out, **tolerance_for(ref_out, width))
        assert torch.equal(cache[SLOT_OF], reference)  # a shift: the same bits
    assert torch.equal(cache[untouched], before)


def test_other_dtypes_and_shapes_take_the_torch_form():
    ssm = torch.zeros(2, HV, DK, DV)
    conv = torch.zeros(2, 3, 48)
    assert kernel.applies(ssm, conv)
    assert not kernel.applies(ssm.bfloat16(), conv)
    assert not kernel.applies(ssm, conv.bfloat16())
    assert not kernel.applies(torch.zeros(2, HV, 24, DV), conv)  # dk % 32 != 0
    assert not kernel.applies(ssm.transpose(2, 3), conv)
