"""FlashAttention's varlen call (layers/varlen_attention.py) against the SDPA reference, on a
GPU: packed sequences of ragged lengths, GQA, causal bottom-right for chunks after cached
keys, and non-causal spans (vision images and windows). Where FlashAttention cannot run the
entry says so (None), and callers keep their own path."""

from __future__ import annotations

import pytest
import torch

from engine_proc.layers.varlen_attention import varlen_kernel, varlen_reference
from tests.tolerance import tolerance


def test_varlen_kernel_is_none_where_flash_attention_cannot_run():
    assert varlen_kernel(torch.device("cpu"), torch.bfloat16, 128) is None
    assert varlen_kernel(torch.device("cuda"), torch.float32, 128) is None
    assert varlen_kernel(torch.device("cuda"), torch.bfloat16, 12) is None
    assert varlen_kernel(torch.device("cuda"), torch.bfloat16, 512) is None


def test_flash_attention_that_fails_its_probe_is_off(caplog):
    """On its first use on a device the varlen call runs once against the reference; where
    it cannot run (here: a CPU, which has no FlashAttention) it is off with a warning."""
    from engine_proc.layers import varlen_attention

    varlen_attention._checked_flash.cache_clear()
    try:
        assert varlen_attention._checked_flash(torch.device("cpu")) is None
        assert "FlashAttention's varlen call is off" in caplog.text
    finally:
        varlen_attention._checked_flash.cache_clear()


def test_the_reference_aligns_a_causal_chunk_to_its_last_keys():
    """A 2-query chunk after 3 cached keys: query 0 sees keys 0..3, query 1 all 5."""
    q = torch.zeros(2, 1, 8)
    k = torch.zeros(5, 1, 8)
    v = torch.arange(5.0).view(5, 1, 1).expand(5, 1, 8).contiguous()
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = varlen_reference(q, k, v, cu_q, cu_k, 2, 5, scale=1.0, causal=True)
    assert out[:, 0, 0].tolist() == [1.5, 2.0]  # uniform weights: the mean of the keys seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(16, 2, 128), (16, 16, 80), (8, 4, 256)])
def test_flash_varlen_matches_the_reference(dtype, causal, heads, kv_heads, head_dim):
    if not causal and kv_heads != heads:
        pytest.skip("vision attention has as many key heads as query heads")
    torch.manual_seed(0)
    device = torch.device("cuda")
    kernel = varlen_kernel(device, dtype, head_dim)
    assert kernel is not None, "torch.nn.attention.varlen did not import"
    q_lens = [1, 37, 256, 5, 1024]
    # causal: some chunks come after cached keys; non-causal: queries are their own keys
    k_lens = [9, 37, 300, 5, 1500] if causal else q_lens
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)
    q = torch.randn(sum(q_lens), heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(sum(k_lens), kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(sum(k_lens), kv_heads, head_dim, device=device, dtype=dtype)
    scale = head_dim**-0.5
    out = kernel(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), scale=scale, causal=causal)
    expected = varlen_reference(q.float(), k.float(), v.float(), cu_q, cu_k, max(q_lens),
                                max(k_lens), scale=scale, causal=causal)
    # both sum in float32; the kernel rounds probabilities and the output to `dtype` (a
    # p-weighted mean of N(0, 1) values: a few roundings at the output's size)
    torch.testing.assert_close(out.float(), expected, **tolerance(dtype, 1, depth=4, scale=1.0))
