"""The Gated DeltaNet ops against transformers' own reference functions (fp32, random
inputs, two value heads per key head): whole sequences, and the same sequence cut at 1,
17, 63, 64 and 65 tokens with the state carried across, then a decode step after each."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from engine_proc.layers.gated_delta_rule import (
    causal_conv,
    causal_conv_step,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from tests.tolerance import tolerance_for

pytestmark = pytest.mark.numeric

HK, HV, DK, DV, LENGTH = 2, 4, 16, 8, 130


def rule_bound(state: torch.Tensor, length: int) -> dict[str, float]:
    """Our rules against transformers' (another chunked form, or its recurrence): the state
    is a sum over DK per token, chained over `length` tokens, and the chunked form solves a
    triangular system over each 64-token chunk (a chain of 64 sums of up to 64 terms). Each
    output is q.S with |q| = DK^-1/2 after its l2 norm, so its error is the state's: the
    state's size is the scale of both."""
    return tolerance_for(state, length * DK + 64 * 64)


def conv_bound(expected: torch.Tensor, width: int) -> dict[str, float]:
    """A depthwise causal conv sums `width` terms (then silu, element-wise)."""
    return tolerance_for(expected, width)


def _inputs(length: int, seed: int = 0, batch: int = 1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, HK, DK, generator=gen)
    k = torch.randn(batch, length, HK, DK, generator=gen)
    v = torch.randn(batch, length, HV, DV, generator=gen)
    g = -torch.rand(batch, length, HV, generator=gen) * 2  # log decay <= 0
    beta = torch.rand(batch, length, HV, generator=gen)
    return q, k, v, g, beta


def _reference(q, k, v, g, beta, state=None, recurrent=False):
    rule = hf.torch_recurrent_gated_delta_rule if recurrent else hf.torch_chunk_gated_delta_rule
    return rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize("rule", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_whole_sequence_matches_transformers(rule):
    inputs = _inputs(LENGTH, batch=2)
    initial = torch.randn(2, HV, DK, DV)
    out, state = rule(*inputs, initial_state=initial)
    ref_out, ref_state = _reference(*inputs, state=initial)
    bound = rule_bound(ref_state, LENGTH)
    torch.testing.assert_close(out, ref_out, **bound)
    torch.testing.assert_close(state, ref_state, **bound)


@pytest.mark.parametrize("split", [1, 17, 63, 64, 65])
@pytest.mark.parametrize("second", ["chunk", "recurrent"])
def test_split_carrying_state_then_decode_matches_whole(split, second):
    """The first `split` tokens by the chunked rule, the rest by either rule from the state
    it left, then one decode token: equal to transformers over the whole sequence."""
    q, k, v, g, beta = _inputs(LENGTH + 1, seed=split)
    head = [x[:, :split] for x in (q, k, v, g, beta)]
    tail = [x[:, split:LENGTH] for x in (q, k, v, g, beta)]
    last = [x[:, LENGTH:] for x in (q, k, v, g, beta)]
    out1, state = chunk_gated_delta_rule(*head)
    rule = chunk_gated_delta_rule if second == "chunk" else recurrent_gated_delta_rule
    out2, state = rule(*tail, initial_state=state)
    out3, state = recurrent_gated_delta_rule(*last, initial_state=state)
    ref_out, ref_state = _reference(*[x[:, :LENGTH] for x in (q, k, v, g, beta)])
    ref_last, ref_state = _reference(*last, state=ref_state, recurrent=True)
    bound = rule_bound(ref_state, LENGTH + 1)
    torch.testing.assert_close(torch.cat([out1, out2], dim=1), ref_out, **bound)
    torch.testing.assert_close(out3, ref_last, **bound)
    torch.testing.assert_close(state, ref_state, **bound)


def test_recurrent_leaves_the_initial_state_untouched():
    inputs = _inputs(3)
    initial = torch.randn(1, HV, DK, DV)
    kept = initial.clone()
    recurrent_gated_delta_rule(*inputs, initial_state=initial)
    assert torch.equal(initial, kept)


@pytest.mark.parametrize("split", [1, 2, 17, 64])
def test_conv_in_pieces_matches_transformers(split):
    channels, width, length = 12, 4, 70
    gen = torch.Generator().manual_seed(split)
    x = torch.randn(1, channels, length, generator=gen)
    weight = torch.randn(channels, width, generator=gen)
    expected = hf.causal_conv1d_fn(x, weight, None, activation="silu")[0].t()
    out1, state = causal_conv(x[0, :, :split].t(), weight, None)
    out2, state = causal_conv(x[0, :, split:-1].t(), weight, state)
    out3, state = causal_conv_step(x[0, :, -1:].t(), weight, state.unsqueeze(0))
    torch.testing.assert_close(torch.cat([out1, out2, out3]), expected,
                               **conv_bound(expected, width))
    torch.testing.assert_close(state[0], x[0, :, -(width - 1):].t(), atol=0, rtol=0)


def test_conv_step_matches_transformers_update():
    channels, width = 12, 4
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(channels, width, generator=gen)
    hf_state = torch.randn(2, channels, width, generator=gen)  # transformers keeps K columns
    x = torch.randn(2, channels, 1, generator=gen)
    ours, new = causal_conv_step(x[..., 0], weight, hf_state[..., 1:].transpose(1, 2).clone())
    expected = hf.causal_conv1d_update(x, hf_state, weight, None, "silu")[..., 0]
    torch.testing.assert_close(ours, expected, **conv_bound(expected, width))
    torch.testing.assert_close(new, hf_state[..., 1:].transpose(1, 2), atol=0, rtol=0)


def test_zero_padding_at_the_end_keeps_outputs_and_final_state():
    """Chunks of one step run together, zero-padded to the longest (gated_delta_net.py)."""
    short, long = _inputs(23, seed=5), _inputs(90, seed=6)
    padded = [torch.cat([torch.nn.functional.pad(a, (0, 0) * (a.dim() - 2) + (0, 90 - 23)), b])
              for a, b in zip(short, long, strict=True)]
    initial = torch.randn(2, HV, DK, DV)
    out, state = chunk_gated_delta_rule(*padded, initial_state=initial)
    for i, inputs in enumerate((short, long)):
        alone, alone_state = chunk_gated_delta_rule(*inputs, initial_state=initial[i : i + 1])
        length = inputs[0].shape[1]
        # zero-padded, the batch runs the same chunked sums on other shapes
        bound = rule_bound(alone_state, length)
        torch.testing.assert_close(out[i : i + 1, :length], alone, **bound)
        torch.testing.assert_close(state[i : i + 1], alone_state, **bound)


def test_bf16_conv_rounds_once_as_transformers():
    """Accumulated in fp32 and rounded once, as F.conv1d does: bf16 outputs equal
    transformers' bit for bit."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 512, 40, generator=gen).bfloat16()
    weight = torch.randn(512, 4, generator=gen).bfloat16()
    expected = hf.causal_conv1d_fn(x, weight, None, activation="silu")[0].t()
    ours, _ = causal_conv(x[0].t(), weight, None)
    torch.testing.assert_close(ours, expected, atol=0, rtol=0)
    states = torch.randn(3, 3, 512, generator=gen).bfloat16()
    step_in = torch.randn(3, 512, generator=gen).bfloat16()
    hf_state = torch.cat([torch.zeros(3, 1, 512, dtype=torch.bfloat16), states], 1)
    expected = hf.causal_conv1d_update(step_in[..., None], hf_state.transpose(1, 2).contiguous(),
                                       weight, None, "silu")[..., 0]
    torch.testing.assert_close(causal_conv_step(step_in, weight, states)[0], expected,
                               atol=0, rtol=0)
