"""The Triton RMSNorm (residual add included, zero-centred for Qwen3.5) and rotary kernels
against their torch forms, in 16 bits: rotary bit-identical, the norm's residual sum
bit-identical and its output within one rounding where the sum's order tips a tie.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors; the engine
picks them only on a GPU (layers/rms_norm.py's `triton_norm`, rotary_embedding.py's
`triton_rotary`)."""

from __future__ import annotations

import pytest
import torch

from engine_proc.layers.rms_norm import RMSNorm, ZeroCenteredRMSNorm
from engine_proc.layers.rotary_embedding import apply_rotary_
from tests.triton_device import DEVICE, runs_triton

pytest.importorskip("triton")
from engine_proc.layers import rms_norm_triton, rotary_triton  # noqa: E402

pytestmark = [pytest.mark.numeric, runs_triton]
# bf16 on a GPU only: Triton's interpreter truncates float32 -> bfloat16 (the compiled
# kernels round to nearest even, as torch does); float16 goes through numpy and rounds
HALF = [pytest.param(torch.bfloat16, marks=pytest.mark.gpu), torch.float16]


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """n rows of `width` as a view with a row stride past the width (a column slice)."""
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(n, width + 8, generator=g)).to(dtype)[:, :width]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("width", [32, 96, 256])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("norm_class", [RMSNorm, ZeroCenteredRMSNorm])
def test_rms_norm_matches_its_torch_form(dtype, width, residual, norm_class):
    norm = norm_class(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(3)) * 0.5)
    x = _rows(13, width, dtype, seed=1)
    res = _rows(13, width, dtype, seed=2) if residual else None
    expected = norm(x, res) if residual else norm(x)  # a CPU tensor in 16 bits: torch's ops
    got = rms_norm_triton.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps,
                                   None if res is None else res.to(DEVICE),
                                   zero_centered=norm.zero_centered)
    if residual:
        (expected, expected_sum), (got, got_sum) = expected, got
        assert torch.equal(got_sum.cpu(), expected_sum)  # the add rounds alike
    ulp = torch.finfo(dtype).eps  # one rounding of the output, relative
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=0.0, rtol=ulp)
    assert (got.cpu() == expected).float().mean() > 0.98  # ties are rare


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("width", [32, 128])
def test_gated_rms_norm_matches_its_torch_form(dtype, width):
    """The Gated DeltaNet output norm, norm(x) * silu(gate): within one rounding (silu's
    exp is the hardware's approximate one in the kernel)."""
    from engine_proc.layers.rms_norm import GatedRMSNorm

    norm = GatedRMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=torch.Generator().manual_seed(3)))
    x, gate = _rows(13, width, dtype, seed=1), _rows(13, width, dtype, seed=2)
    expected = norm(x, gate)  # a CPU tensor in 16 bits: torch's ops
    got = rms_norm_triton.rms_norm(x.to(DEVICE), norm.weight.to(DEVICE), norm.eps,
                                   gate=gate.to(DEVICE))
    torch.testing.assert_close(got.cpu().float(), expected.float(), atol=0.0,
                               rtol=torch.finfo(dtype).eps)
    assert (got.cpu() == expected).float().mean() > 0.98


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("heads,head_dim", [(10, 64), (3, 128), (6, 80)])
def test_rotary_is_bit_identical_to_its_torch_form(dtype, heads, head_dim):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(9, heads + 2, head_dim, generator=g).to(dtype)
    angles = torch.rand(9, head_dim // 2, generator=g) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = qkv.clone()
    apply_rotary_(expected[:, :heads], cos, sin)  # the torch form on a CPU in 16 bits
    got = qkv.to(DEVICE)
    rotary_triton.rotate_(got[:, :heads], cos.to(DEVICE), sin.to(DEVICE))
    assert torch.equal(got.cpu(), expected)  # the v heads past `heads` untouched too


@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_VL", "TINY_QWEN3_5"])
def test_an_engine_through_the_kernels_gives_its_torch_logprobs(preset, monkeypatch):
    """The kernels where a model calls them: every family's norms (decoder, q/k norms,
    Qwen3.5's zero-centred ones, the vision tower's, with and without the residual) and
    rotary, an image in the prompt, in float32 (the CPU's C kernels off in both runs, so the
    reference is the torch forms): the first token's top log-probabilities agree to float32
    rounding. (The 16-bit arithmetic is the tests above'.)"""
    from engine_proc.layers import rms_norm, rms_norm_cpu, rotary_cpu, rotary_embedding
    from shared import random_checkpoints
    from shared.model_config import load_model_config
    from tests.engine_proc.engine_factory import make_engine
    from tests.engine_proc.test_engine import make_request
    from tests.tolerance import tolerance

    monkeypatch.setattr(rms_norm_cpu, "applies", lambda *args: False)
    monkeypatch.setattr(rotary_cpu, "applies", lambda *args: False)
    path = random_checkpoints.ensure_checkpoint(getattr(random_checkpoints, preset))
    config = load_model_config(path)

    def first_token_logprobs():
        engine = make_engine(path, dtype="float32")
        engine.add_request(make_request(config, "a", [5, (2, 2), 7], 0, max_tokens=1,
                                        logprobs=5))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.logprobs:
                    return output.logprobs[0]

    _, want_ids, want_values = first_token_logprobs()
    used = []
    monkeypatch.setattr(rms_norm, "triton_norm", lambda x: used.append("norm") or rms_norm_triton)
    monkeypatch.setattr(rotary_embedding, "triton_rotary",
                        lambda x, cos, sin: used.append("rotary") or rotary_triton)
    _, ids, values = first_token_logprobs()
    assert {"norm", "rotary"} <= set(used)
    # the norms' sums in another order: float32 roundings through every layer and the head
    bound = tolerance(torch.float32, config.text.hidden_size,
                      depth=2 * (config.text.num_hidden_layers + 1),
                      scale=max(map(abs, want_values)))
    torch.testing.assert_close(torch.tensor(values), torch.tensor(want_values), **bound)
    assert ids == want_ids
