"""Prefills through the varlen chunked rule (flash-linear-attention's on a GPU): every chunk
of a step in one call, from and back to its slot. On a CPU the call is a stand-in with FLA's
interface over the torch rule, so an engine's chunks, slots and first-chunk zeros are
checked against transformers' tokens; on a GPU, FLA's kernel itself against the torch rule."""

from __future__ import annotations

import pytest
import torch

from engine_proc.layers import gated_delta_rule_fla
from engine_proc.layers.gated_delta_rule import chunk_gated_delta_rule
from shared.model_config import load_model_config
from shared.random_checkpoints import TINY_QWEN3_5, ensure_checkpoint
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import Reference, make_request
from tests.tolerance import tolerance_for


def varlen_torch_rule(q, k, v, g, beta, *, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, cu_seqlens):
    """FLA's `chunk_gated_delta_rule` interface (B = 1, chunks cut at cu_seqlens) over the
    torch form, which always l2-normalizes q and k."""
    assert use_qk_l2norm_in_kernel and q.shape[0] == 1
    bounds = cu_seqlens.tolist()
    outs, finals = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        state = None if initial_state is None else initial_state[i : i + 1]
        o, final = chunk_gated_delta_rule(*(x[:, s:e] for x in (q, k, v, g, beta)),
                                          initial_state=state)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1), torch.cat(finals) if output_final_state else None


@pytest.mark.parametrize("budget", [17, 64, 512])
def test_an_engine_prefilling_through_the_varlen_rule_gives_transformers_tokens(
        monkeypatch, budget):
    calls = []
    monkeypatch.setattr(gated_delta_rule_fla, "prefill_rule",
                        lambda device, dims: calls.append(dims) or varlen_torch_rule)
    path = ensure_checkpoint(TINY_QWEN3_5)
    config = load_model_config(path)
    engine = make_engine(path, max_num_seqs=3, max_num_batched_tokens=budget)
    prompts = {"long": [150], "img": [20, (4, 6), 30], "short": [5]}
    reference = Reference(path)
    for wave in range(2):  # other prompts, in slots that hold the first wave's final states
        out = engine.generate([make_request(config, f"{rid}{wave}", segments, wave)
                               for rid, segments in prompts.items()])
        for rid, segments in prompts.items():
            assert out[f"{rid}{wave}"] == reference.greedy(config, segments, wave)
    assert calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fla_chunks_match_the_torch_rule():
    rule = gated_delta_rule_fla.chunk_rule()
    if rule is None:
        pytest.skip("fla-core is not installed")
    gen = torch.Generator().manual_seed(0)
    lens, hk, hv, dk, dv = [1, 40, 130], 2, 4, 128, 128
    total = sum(lens)
    q, k = (torch.randn(1, total, hk, dk, generator=gen).cuda() for _ in range(2))
    v = torch.randn(1, total, hv, dv, generator=gen).cuda()
    g = (-torch.rand(1, total, hv, generator=gen) * 2).cuda()
    beta = torch.rand(1, total, hv, generator=gen).cuda()
    initial = torch.randn(len(lens), hv, dk, dv, generator=gen).cuda()
    cu = torch.tensor([0, 1, 41, 171]).cuda()
    got, final = rule(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    ref, ref_final = varlen_torch_rule(q, k, v, g, beta, initial_state=initial,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       cu_seqlens=cu)
    # FLA's dots run in TF32 on float32 inputs: float16's 10-bit mantissa bounds them
    bound = tolerance_for(ref_final.to(torch.float16), max(lens) * dk + 64 * 64)
    torch.testing.assert_close(final, ref_final, **bound)
    torch.testing.assert_close(got, ref, **bound)
