"""Linear layers packed for oneDNN on a CPU compute what F.linear computes, hold one copy of
their weights, and leave alone what must keep its layout (tied weights, bfloat16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine_proc.layers.linear import MergedLinear, RowParallelLinear
from engine_proc.layers.packed_linear import bucket_rows, can_pack, pack_linear_weights
from engine_proc.model_runner import ModelRunner
from shared.model_config import load_model_config
from tests.tolerance import tolerance_for

# oneDNN's packed weights take other GEMM kernels (blocking, vector width) than F.linear's:
# the same sums in other orders, within the rounding of their lengths
pytestmark = [pytest.mark.skipif(not can_pack(torch.device("cpu"), torch.float32),
                                 reason="this torch has no oneDNN"),
              pytest.mark.numeric]


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Linear(48, 64)
        self.merged = MergedLinear(64, [32, 16, 16], bias=True)
        self.row = RowParallelLinear(64, 40, bias=False)
        self.embed = nn.Embedding(40, 24)
        self.tied = nn.Linear(24, 40, bias=False)
        self.tied.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.row(self.merged(self.plain(x)))


def test_packed_layers_compute_f_linear_with_one_copy_of_the_weights():
    torch.manual_seed(0)
    net = _Net()
    x = torch.randn(37, 48)
    rows = torch.randn(5, 64)
    with torch.no_grad():
        expected = net(x)
        expected_partial = F.linear(rows, net.row.weight)
    assert pack_linear_weights(net) == 3
    with torch.inference_mode():
        # three layers of 48, 64 and 64 inputs
        torch.testing.assert_close(net(x), expected, **tolerance_for(expected, 48 + 64 + 64))
        torch.testing.assert_close(net.row.partial(rows), expected_partial,
                                   **tolerance_for(expected_partial, 64))
        assert net(x[:0]).shape == (0, 40)
    for layer in (net.plain, net.merged, net.row):
        assert layer.weight is None and layer.packed_weight.is_mkldnn
        assert isinstance(layer, nn.Linear)  # still what the model code expects
    assert net.tied.weight is net.embed.weight and not hasattr(net.tied, "packed_weight")


def test_bfloat16_and_unpacked_runner_keep_f_linear(tiny_model_path):
    layer = nn.Linear(8, 8).to(torch.bfloat16)
    assert pack_linear_weights(layer) == 0 and layer.weight is not None
    config = load_model_config(tiny_model_path)
    off = ModelRunner(config, block_size=16, num_kv_blocks=8, device="cpu", dtype="float32")
    on = ModelRunner(config, block_size=16, num_kv_blocks=8, device="cpu", dtype="float32",
                     pack_weights=True)
    assert not any(n.endswith("packed_weight") for n, _ in off.model.named_buffers())
    packed = [n for n, _ in on.model.named_buffers() if n.endswith("packed_weight")]
    # every decoder and vision projection, and the (untied) LM head
    assert any(".mlp.gate_up_proj." in n for n in packed)
    assert any("visual.blocks.0.attn.qkv" in n for n in packed)
    assert "lm_head.packed_weight" in packed
    hidden = torch.randn(6, config.text.hidden_size)
    with torch.inference_mode():
        expected = off.model.compute_logits(hidden)
        torch.testing.assert_close(on.model.compute_logits(hidden), expected,
                                   **tolerance_for(expected, config.text.hidden_size))


def test_row_counts_fall_in_few_buckets_with_little_padding():
    """oneDNN builds a kernel per row count; a serving engine's steps see thousands of them.
    Rounded up to their bucket, rows 1..16384 need 32 + 16 per octave kernels, each padded
    by at most 1/16."""
    buckets = {bucket_rows(rows) for rows in range(1, 16385)}
    assert len(buckets) == 32 + 16 * 9
    for rows in range(1, 16385):
        assert rows <= bucket_rows(rows) <= rows * 17 / 16
    assert [bucket_rows(r) for r in (31, 33, 100, 1000, 4160)] == [31, 34, 100, 1024, 4352]


@pytest.mark.parametrize("shape", [(33, 48), (3, 37, 48), (1000, 48)])
def test_padded_row_counts_compute_f_linear(shape):
    torch.manual_seed(1)
    layer = nn.Linear(48, 24)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = layer(x)
    pack_linear_weights(layer)
    with torch.inference_mode():
        out = layer(x)
    assert out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out, expected, **tolerance_for(expected, 48))
