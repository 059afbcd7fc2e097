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
