"""Hybrid models (Qwen3.5): the recurrent state slots beside the KV cache. Chunk boundaries
anywhere carry the state (1-token chunks included), slots come back on finish, abort,
failure and preemption and their next owner gets a fresh engine's tokens, the caches are
sized inside the budget (state first, KV from the full-attention layers only), and bad
checkpoints and budgets are refused in one clear line. Greedy tokens are transformers'."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_proc.llm_engine import LLMEngine
from shared.model_config import load_model_config
from shared.random_checkpoints import TINY_QWEN3_5, TINY_QWEN3_5_MOE, ensure_checkpoint
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import Reference, assert_all_released, make_request

LONG = [150]
IMAGE = [20, (4, 6), 30]


@pytest.fixture(scope="module")
def path():
    return ensure_checkpoint(TINY_QWEN3_5)


@pytest.fixture(scope="module")
def config(path):
    return load_model_config(path)


@pytest.fixture(scope="module")
def reference(path):
    return Reference(path)


@pytest.mark.parametrize("budget", [17, 63, 64, 65])
def test_prefill_chunks_carry_the_state(path, config, reference, budget):
    """A 150-token prompt and an image prompt prefilled in chunks of `budget` tokens."""
    engine = make_engine(path, max_num_batched_tokens=budget, max_num_seqs=2)
    out = engine.generate([make_request(config, "long", LONG), make_request(config, "img", IMAGE, 1)])
    assert out["long"] == reference.greedy(config, LONG)
    assert out["img"] == reference.greedy(config, IMAGE, 1)
    assert_all_released(engine)


def test_one_token_chunks_beside_decodes(path, config, reference):
    """A budget of 2 with two requests: once the first decodes, the second prefills one
    token per step (the token-by-token rule), its image cut everywhere."""
    engine = make_engine(path, max_num_batched_tokens=2, max_num_seqs=2)
    requests = [make_request(config, "a", [3]), make_request(config, "b", [2, (2, 2), 3], 2)]
    out = engine.generate(requests)
    assert out["a"] == reference.greedy(config, [3])
    assert out["b"] == reference.greedy(config, [2, (2, 2), 3], 2)


def test_a_reused_slot_gives_a_fresh_engines_tokens(path, config, reference):
    """One slot: each request takes it after the last one left it (finished, aborted,
    failed) and gets exactly the tokens of a fresh engine."""
    engine = make_engine(path, max_num_seqs=1)
    assert engine.scheduler.state_slots.num_slots == 1
    engine.generate([make_request(config, "first", LONG, 3)])
    engine.add_request(make_request(config, "aborted", IMAGE, 4, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.abort_request("aborted")
    model = engine.model_runner.model
    forward = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("decoder exploded"))
    engine.add_request(make_request(config, "failed", LONG, 5))
    assert [o.finish_reason for o in engine.step()] == ["abort", "error"]
    model.forward = forward
    assert_all_released(engine)
    for rid, segments, seed in (("x", LONG, 0), ("y", IMAGE, 1)):
        out = engine.generate([make_request(config, rid, segments, seed)])
        assert out[rid] == reference.greedy(config, segments, seed)
    assert_all_released(engine)


def test_slots_all_free_after_a_mixed_run_with_aborts_and_preemptions(path, config):
    engine = make_engine(path, num_kv_blocks=20, block_size=4, max_num_batched_tokens=64,
                         max_num_seqs=6)
    for i in range(6):
        segments = [9 + i] if i % 3 else [2, (2, 2), 3]
        engine.add_request(make_request(config, f"r{i}", segments, i, max_tokens=14))
    step = 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        if step == 3:
            engine.abort_request("r1")
            engine.abort_request("r3")
    assert engine.scheduler.num_preemptions > 0
    assert_all_released(engine)


def test_kv_blocks_are_sized_from_the_full_attention_layers(path, config):
    engine = LLMEngine(str(path), kv_cache_memory_bytes=4 << 20, max_num_seqs=4,
                       max_model_len=512, device="cpu")
    runner = engine.model_runner
    text = config.text
    assert text.num_attention_layers == 2 and text.num_linear_layers == 6
    per_token = 2 * text.num_key_value_heads * text.head_dim * 4
    assert runner.kv_block_bytes == 2 * 16 * per_token  # two attention layers of eight
    conv = text.linear_conv_dim * (text.linear_conv_kernel_dim - 1) * 4
    ssm = text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim * 4
    assert runner.state_shape.slot_bytes == 6 * (conv + ssm)
    # the slots and the prefix cache's snapshots (one per slot by default) come out of the
    # budget first, the KV blocks get the rest
    assert runner.num_state_slots == 4 and runner.num_state_snapshots == 4
    slots = 8 * runner.state_shape.slot_bytes
    assert runner.num_kv_blocks == ((4 << 20) - slots) // runner.kv_block_bytes
    stats = engine.stats()
    assert stats.state_cache_bytes == slots
    assert runner.state_cache[1].shape[1] == 8  # slots, then snapshots
    assert stats.kv_cache_bytes == runner.num_kv_blocks * runner.kv_block_bytes


def test_a_budget_that_cannot_hold_every_slot_clamps_max_num_seqs(path, caplog):
    probe = LLMEngine(str(path), max_num_seqs=1, max_model_len=256, device="cpu")
    slot = probe.model_runner.state_shape.slot_bytes
    full = 256 // 16 * probe.model_runner.kv_block_bytes
    caplog.set_level(logging.WARNING)
    engine = LLMEngine(str(path), kv_cache_memory_bytes=full + 3 * slot + slot // 2,
                       max_num_seqs=8, max_model_len=256, device="cpu")
    assert engine.model_runner.num_state_slots == 3
    assert engine.scheduler.max_num_seqs == 3
    assert "max_num_seqs lowered from 8 to 3" in caplog.text
    assert engine.model_runner.num_state_snapshots == 0  # no room left: caching goes off
    assert not engine.scheduler.block_manager.enable_prefix_caching
    with pytest.raises(ValueError, match="cannot hold one sequence's recurrent state"):
        LLMEngine(str(path), kv_cache_memory_bytes=full + slot // 2, max_num_seqs=8,
                  max_model_len=256, device="cpu")


def test_recurrent_state_dtype_flag(path):
    engine = LLMEngine(str(path), max_num_seqs=2, max_model_len=256, device="cpu",
                       mamba_ssm_cache_dtype="bfloat16")
    conv, ssm = engine.model_runner.state_cache
    assert ssm.dtype == torch.bfloat16 and conv.dtype == torch.float32


def _copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_a_missing_tensor_is_named(path, tmp_path):
    folder = _copy_checkpoint(path, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.language_model.layers.1.linear_attn.A_log"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(KeyError, match=r"layers\.1\.linear_attn\.A_log"):
        make_engine(folder)


def test_layer_types_that_disagree_with_the_layer_count_are_refused(path, tmp_path):
    folder = _copy_checkpoint(path, tmp_path / "ckpt")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="layer_types names 7 layers but num_hidden_layers is 8"):
        load_model_config(folder)
    cfg["text_config"]["layer_types"] = ["linear_attention"] * 7 + ["sliding_window"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown layer types"):
        load_model_config(folder)


def test_mtp_tensors_are_skipped_with_a_log_line(path, config, reference, tmp_path, caplog):
    folder = _copy_checkpoint(path, tmp_path / "ckpt")
    tensors = load_file(folder / "model.safetensors")
    tensors["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(4, 4)
    tensors["mtp.fc.weight"] = torch.zeros(4, 8)
    save_file(tensors, folder / "model.safetensors")
    caplog.set_level(logging.INFO)
    engine = make_engine(folder)
    assert "skipped 2 multi-token-prediction tensors" in caplog.text
    out = engine.generate([make_request(config, "a", [17])])
    assert out["a"] == reference.greedy(config, [17])


def test_moe_experts_load_per_expert_and_fused(tmp_path):
    """transformers 5.24 saves Qwen3.5-MoE experts one tensor each; fused [E, 2I, H] /
    [E, H, I] tensors (vLLM's accepted layout) load to the same tokens."""
    path = ensure_checkpoint(TINY_QWEN3_5_MOE)
    config = load_model_config(path)
    tensors = load_file(path / "model.safetensors")
    assert any(".experts.0.gate_proj." in k for k in tensors)
    fused = {}
    for key, value in tensors.items():
        if ".experts." not in key:
            fused[key] = value
            continue
        prefix = key.split(".experts.")[0] + ".experts."
        if prefix + "gate_up_proj" in fused:
            continue
        num = config.text.num_experts
        gate = [tensors[f"{prefix}{i}.gate_proj.weight"] for i in range(num)]
        up = [tensors[f"{prefix}{i}.up_proj.weight"] for i in range(num)]
        fused[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        fused[prefix + "down_proj"] = torch.stack(
            [tensors[f"{prefix}{i}.down_proj.weight"] for i in range(num)])
    folder = _copy_checkpoint(path, tmp_path / "fused")
    save_file(fused, folder / "model.safetensors")
    request = [make_request(config, "a", [5, (2, 3), 9])]
    per_expert = make_engine(path).generate(request)
    request = [make_request(config, "a", [5, (2, 3), 9])]
    assert make_engine(folder).generate(request) == per_expert


def test_tensor_parallelism_refuses_linear_heads_it_cannot_split(config):
    from dataclasses import replace

    from shared.model_config import tensor_parallel_problem

    odd = replace(config, text=replace(config.text, linear_num_key_heads=3,
                                       linear_num_value_heads=3))
    assert "linear_num_key_heads (3)" in tensor_parallel_problem(odd, 2)
    assert tensor_parallel_problem(config, 2) is None
