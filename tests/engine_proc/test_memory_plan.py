"""An engine's memory plan: its parts from what it resolved, and what is left out on CUDA."""

from __future__ import annotations

import dataclasses

from engine_proc.memory_plan import EngineSizes, engine_plan, resident_bytes
from shared.engine_config import EngineConfig
from shared.model_config import load_model_config

MiB = 1 << 20
SIZES = EngineSizes(weights_bytes=25 * MiB, kv_cache_bytes=256 * MiB, state_cache_bytes=0,
                    encoder_cache_bytes=32 * MiB, max_num_seqs=64, max_requests=64 + 4096,
                    max_model_len=8192, dtype_bytes=4, on_cuda=False)


def parts(plan) -> dict[str, int]:
    return {p.name: p.nbytes for p in plan.parts}


def test_a_cpu_engine_counts_what_it_loaded_once_and_every_budget(tiny_model_path):
    model = load_model_config(tiny_model_path)
    config = EngineConfig(mm_inflight_budget=64 * MiB)
    plan = engine_plan("engine 0", config, model, SIZES, loaded_rss=800 * MiB)
    got = parts(plan)
    # the weights and KV cache are in the RSS at start: counted once, as themselves
    assert got["runtime"] == 800 * MiB - resident_bytes(SIZES) == (800 - 25 - 256) * MiB
    assert got["weights"] == 25 * MiB and got["kv cache"] == 256 * MiB
    assert got["encoder cache"] == 32 * MiB
    assert got["pixels in flight"] == 64 * MiB
    assert got["admitted requests"] == 4160 * 8192 * 36
    assert "state slots" not in got  # no recurrent state in this family
    assert plan.total == sum(got.values())


def test_workspaces_follow_the_shapes(tiny_model_path):
    model = load_model_config(tiny_model_path)
    plan = parts(engine_plan("engine 0", EngineConfig(), model, SIZES, 800 * MiB))
    wider = parts(engine_plan("engine 0", EngineConfig(max_num_batched_tokens=16384), model,
                              SIZES, 800 * MiB))
    assert wider["step workspace"] > plan["step workspace"]
    bigger = dataclasses.replace(model, image=dataclasses.replace(
        model.image, max_pixels=2 * model.image.max_pixels))
    doubled = parts(engine_plan("engine 0", EngineConfig(), bigger, SIZES, 800 * MiB))
    assert doubled["vision workspace"] == 2 * plan["vision workspace"]


def test_a_cuda_engine_keeps_device_memory_out_of_its_host_plan(tiny_model_path):
    model = load_model_config(tiny_model_path)
    sizes = dataclasses.replace(SIZES, on_cuda=True)
    got = parts(engine_plan("engine 0", EngineConfig(), model, sizes, 1500 * MiB))
    assert got["runtime"] == 1500 * MiB  # nothing of it is the device's
    for device_part in ("weights", "kv cache", "encoder cache", "step workspace",
                        "vision workspace"):
        assert device_part not in got
    assert {"pixels in flight", "admitted requests", "wire buffers"} <= set(got)
    # the host side of the device's inputs: the pinned arena a step's arrays cross through
    assert got["pinned staging"] > 0


def test_pinned_staging_holds_the_largest_step(tiny_model_path):
    """The arena part covers a StepStaging after the largest step's arrays: a full token
    budget of rows, every sequence with a max_model_len block table and penalty ids."""
    import numpy as np
    import torch

    from engine_proc.step_staging import NUM_ARENAS, StepStaging

    model = load_model_config(tiny_model_path)
    config = EngineConfig(max_num_batched_tokens=4096)
    sizes = dataclasses.replace(SIZES, on_cuda=True, max_num_seqs=32, max_model_len=4096)
    planned = parts(engine_plan("engine 0", config, model, sizes, 1500 * MiB))["pinned staging"]
    t, s, blocks = 4096, 32, 4096 // config.block_size
    staging = StepStaging(torch.device("cpu"), capacity=1024)
    step = [np.zeros(t, np.int64), np.zeros((3, t), np.int64), np.zeros(s + 1, np.int32),
            np.zeros(s, np.int32), np.zeros(t, np.int64), np.zeros((s, blocks), np.int32),
            np.zeros(t, np.int64), np.zeros(s, np.int64), np.zeros(s, np.float32),
            np.zeros(s, np.float32), np.zeros(s, np.int64), np.zeros(s, bool),
            np.zeros(s, np.int64), np.zeros((s, 4096), np.int64), np.zeros((s, 4096), np.int64),
            np.zeros((s, -(-model.text.vocab_size // 32)), np.int32)]
    for _ in range(NUM_ARENAS):  # each arena takes the largest step once
        staging.reset()
        for array in step:
            staging(array)
    assert NUM_ARENAS * 2 * staging.capacity <= planned
    bigger = parts(engine_plan("engine 0", dataclasses.replace(config, max_num_batched_tokens=65536),
                               model, sizes, 1500 * MiB))["pinned staging"]
    assert bigger > planned
