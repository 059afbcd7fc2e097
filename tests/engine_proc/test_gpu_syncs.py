"""A GPU engine step waits on the device once, for its sampled ids (the GPU engine issue's
"one sync per step"): every other synchronizing CUDA call in a step (a pageable copy, a
tensor built from a Python list on the device, .item(), nonzero, a stream sync) raises under
torch's sync debug mode, which is on for the whole of each step here: scheduling, inputs,
the forward (eager, decode graphs, mixed-step pieces), sampling with penalties, top-p/top-k,
min_tokens and log-probabilities, postprocessing. Text only: an image's pixels cross in a
pageable copy by design (engine_proc/model_runner.py, _pixels_to_device)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = [[30], [5], [61], [12], [45], [20]]
SAMPLING = [dict(), dict(repetition_penalty=1.2, presence_penalty=0.5),
            dict(temperature=0.8, top_p=0.9, top_k=20, seed=3), dict(logprobs=3),
            dict(frequency_penalty=0.3), dict(min_tokens=6)]


@pytest.mark.parametrize("preset", ["TINY", "TINY_QWEN3_5"])
@pytest.mark.parametrize("eager", [True, False])
def test_a_step_waits_on_the_device_once(monkeypatch, preset, eager):
    import shared.random_checkpoints as checkpoints
    from engine_proc.layers import gated_delta_rule_fla
    from shared.model_config import load_model_config
    from tests.engine_proc.engine_factory import make_engine
    from tests.engine_proc.test_engine import make_request

    syncs = []

    def allowed(function, label):
        def run(*args, **kwargs):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                if label != "sampled ids" or args[0].is_cuda:
                    syncs.append(label)
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return run

    path = checkpoints.ensure_checkpoint(getattr(checkpoints, preset))
    config = load_model_config(path)
    # built first: its start-up kernel checks read their references' offsets on the host
    engine = make_engine(path, device="cuda", dtype="bfloat16", max_num_batched_tokens=24,
                         enforce_eager=eager, cudagraph_capture_sizes=(1, 2, 4, 8))
    monkeypatch.setattr(torch.Tensor, "tolist", allowed(torch.Tensor.tolist, "sampled ids"))
    # flash-linear-attention reads its varlen chunk offsets on the host (its own sync, once
    # per prefill step of a hybrid model)
    monkeypatch.setattr(gated_delta_rule_fla, "prefill_",
                        allowed(gated_delta_rule_fla.prefill_, "fla"))
    pending = [make_request(config, f"r{i}", p, max_tokens=8, **SAMPLING[i])
               for i, p in enumerate(PROMPTS)]
    while pending or engine.has_unfinished_requests():
        if pending:
            engine.add_request(pending.pop(0))
        syncs.clear()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outputs = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert all(o.error is None for o in outputs), [o.error for o in outputs]
        assert syncs.count("sampled ids") <= 1, syncs
    if not eager:
        stats = engine.stats()
        assert stats.num_graph_steps and stats.num_piecewise_steps
