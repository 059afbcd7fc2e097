"""Tensor parallelism on the CPU (gloo, real worker processes): TP=2 gives TP=1's greedy
tokens with logits within float32 rounding (tests/tolerance.py), for text and images (chunked prefill splitting an image
over steps, DeepStack on Qwen3-VL, MoE experts split); a worker keeps no image rows after its step (R3); a
worker's death is the engine's death, noticed at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from engine_proc.distributed import REPLICATED, Shard
from engine_proc.model_runner import ModelRunner
from engine_proc.step_inputs import StepInputs
from engine_proc.tensor_parallel import TensorParallelBroken
from engine_proc.tp_worker import run_step
from shared.model_config import load_model_config, tensor_parallel_problem
from shared.random_checkpoints import (
    TINY_QWEN3_5,
    TINY_QWEN3_5_MOE,
    TINY_QWEN3_VL,
    TINY_QWEN3_VL_MOE,
    ensure_checkpoint,
    write_checkpoint,
)
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import make_request
from tests.engine_proc.test_r3 import hand_over, image_request
from tests.tolerance import decoder_terms, tolerance_for, vision_terms

pytestmark = pytest.mark.numeric

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_rank():
    """Two ranks on this machine's cores: each takes one thread (the workers take as many
    as this process has)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class LogitRecorder:
    """Wraps the runner's sampler: keeps every step's logits."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, batch):
        self.logits.append(logits.clone())
        return self.sampler(logits, batch)


def generate(engine, requests):
    recorder = engine.model_runner.sampler = LogitRecorder(engine.model_runner.sampler)
    try:
        return engine.generate(requests), recorder.logits
    finally:
        engine.model_runner.sampler = recorder.sampler


def assert_same_outputs(config, path, segments_list, **engine_kw):
    def requests():
        return [make_request(config, f"r{i}", segments, prompt_seed=i, max_tokens=8)
                for i, segments in enumerate(segments_list)]

    single = make_engine(path, encoder_cache_bytes=0, **engine_kw)
    tokens_1, logits_1 = generate(single, requests())
    # each rank sums its half of the row-parallel projections (o_proj, down, out_proj, the
    # vision tower's) and the halves are added: the same sums in another order
    sent = requests()
    terms = decoder_terms(config.text, max(len(r.prompt_token_ids) for r in sent) + 8)
    grids = [image.grid_thw for r in sent for image in r.images]
    if grids:
        terms += vision_terms(config.vision, max(t * h * w for t, h, w in grids))
    split = make_engine(path, encoder_cache_bytes=0, tensor_parallel_size=2, **engine_kw)
    try:
        tokens_2, logits_2 = generate(split, requests())
    finally:
        split.close()
    assert tokens_2 == tokens_1
    assert len(logits_2) == len(logits_1)
    for a, b in zip(logits_1, logits_2, strict=True):
        torch.testing.assert_close(b, a, **tolerance_for(a, terms))


TEXT = [17]
ONE_IMAGE = [5, (2, 3), 9]
TWO_IMAGES = [3, (2, 2), 4, (4, 3), 6]


def test_text_and_images_match_a_single_rank(tiny_model_path):
    config = load_model_config(tiny_model_path)
    # 16-token steps: prefills are chunked, an image's rows split over two steps
    assert_same_outputs(config, tiny_model_path, [TEXT, ONE_IMAGE, TWO_IMAGES, [40]],
                        max_num_batched_tokens=16)


def test_deepstack_images_match_a_single_rank():
    path = ensure_checkpoint(TINY_QWEN3_VL)
    assert_same_outputs(load_model_config(path), path, [TEXT, TWO_IMAGES])


def test_experts_split_match_a_single_rank(tmp_path):
    """Qwen3-VL-MoE with two key/value heads: every rank holds every expert's share of the
    intermediate rows (the tiny MoE preset has one key/value head, which does not split)."""
    preset = replace(TINY_QWEN3_VL_MOE, name="tiny-qwen3-vl-moe-kv2",
                     text=replace(TINY_QWEN3_VL_MOE.text, num_key_value_heads=2))
    path = write_checkpoint(tmp_path / "moe", preset)
    assert_same_outputs(load_model_config(path), path, [TEXT, ONE_IMAGE])


@pytest.mark.parametrize("preset", [TINY_QWEN3_5, TINY_QWEN3_5_MOE], ids=lambda p: p.name)
def test_hybrid_models_match_a_single_rank(preset):
    """Qwen3.5: each rank holds half the Gated DeltaNet key and value heads (and their
    state slots), half the attention heads, and of the MoE its experts' and shared
    expert's rows; prefills in 16-token chunks carry the state across steps."""
    path = ensure_checkpoint(preset)
    assert_same_outputs(load_model_config(path), path, [TEXT, ONE_IMAGE, [40]],
                        max_num_batched_tokens=16)


def test_a_worker_keeps_no_image_rows_after_its_step(tiny_model_path, no_garbage_collector):
    """run_step, the worker's whole step, on a one-rank runner: the step's image rows die
    when it returns (R3 on every rank)."""
    config = load_model_config(tiny_model_path)
    runner = ModelRunner(config, block_size=16, num_kv_blocks=8, device="cpu", vision=False)
    assert not hasattr(runner.model, "visual")
    hidden = config.text.hidden_size
    num_tokens, image_rows = 10, 6
    inputs = StepInputs(
        input_ids=np.arange(100, 100 + num_tokens, dtype=np.int64),
        positions=np.broadcast_to(np.arange(num_tokens, dtype=np.int64), (3, num_tokens)),
        query_start_loc=np.array([0, num_tokens], dtype=np.int32),
        seq_lens=np.array([num_tokens], dtype=np.int32),
        slot_mapping=np.arange(num_tokens, dtype=np.int64),
        block_tables=np.array([[0]], dtype=np.int32),
        sample_rows=np.array([num_tokens - 1], dtype=np.int64),
        all_decode=False, num_decodes=0,
        image_rows=np.array([[2, image_rows]], dtype=np.int64), image_width=hidden,
    )
    inputs = StepInputs.decode(*_wire(inputs))  # as a worker receives it
    values = torch.randn(image_rows, hidden)
    ref = weakref.ref(values)
    run_step(runner, inputs, values)
    del values
    assert ref() is None, "the worker kept its step's image rows"


def test_rank_zero_frees_pixels_and_embeddings_after_the_prefill(tiny_model_path, tiny_config,
                                                                no_garbage_collector):
    engine = make_engine(tiny_model_path, tensor_parallel_size=2, encoder_cache_bytes=0,
                         max_num_batched_tokens=16)
    try:
        pixel_refs = hand_over(engine, image_request(tiny_config, "a", [(168, 224), (56, 84)]))
        images = engine.seqs["a"].images
        engine.step()  # tokens 0..15: encodes the first image
        assert pixel_refs[0]() is None, "pixels outlived their encoding"
        embeds_ref = weakref.ref(images[0].embeds)
        for _ in range(3):  # up to token 63: the last chunk covering the first image
            engine.step()
        assert embeds_ref() is None, "embeddings outlived the chunk that consumed them"
        while engine.seqs["a"].num_completion_tokens == 0:
            engine.step()
        assert all(ref() is None for ref in pixel_refs)
        assert all(image.pixels is None and image.embeds is None for image in images)
        assert engine.stats().mm_bytes_held == 0
    finally:
        engine.close()


def _wire(inputs: StepInputs):
    header, payload = inputs.encode()
    header = np.frombuffer(bytes(header), dtype=np.int64)
    assert StepInputs.payload_bytes(header) == len(bytes(payload))
    return header, bytearray(payload)  # a worker reads into a bytearray


def test_shapes_that_do_not_split_are_refused(tiny_model_path):
    config = load_model_config(tiny_model_path)  # 8 heads, 2 key/value heads
    assert tensor_parallel_problem(config, 2) is None
    assert "num_key_value_heads (2) is not divisible" in tensor_parallel_problem(config, 4)
    assert "num_attention_heads (8) is not divisible" in tensor_parallel_problem(config, 3)
    moe = load_model_config(ensure_checkpoint(TINY_QWEN3_VL_MOE))  # experts' rows: 48
    assert "num_key_value_heads (1) is not divisible" in tensor_parallel_problem(moe, 2)
    assert "moe_intermediate_size (48) is not divisible" in tensor_parallel_problem(
        replace(moe, text=replace(moe.text, num_key_value_heads=32, num_attention_heads=32)), 32)
    with pytest.raises(ValueError, match="not divisible"):
        make_engine(tiny_model_path, tensor_parallel_size=3)


def test_vocabulary_split_pads_the_last_rank():
    assert Shard(0, 2).split_padded(4095) == (0, 2048, 2048)
    assert Shard(1, 2).split_padded(4095) == (2048, 4095, 2048)
    assert REPLICATED.split_padded(10) == (0, 10, 10)


def test_a_dead_worker_fails_the_engine_at_once(tiny_model_path, tiny_config):
    engine = make_engine(tiny_model_path, tensor_parallel_size=2)
    try:
        failures = []
        engine.model_runner.workers.on_failure = failures.append
        engine.add_request(make_request(tiny_config, "a", [9], max_tokens=50))
        engine.step()
        worker = engine.model_runner.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        while engine.failure is None and time.monotonic() - start < 2.0:
            time.sleep(0.01)
        assert time.monotonic() - start < 1.0
        assert "rank 1" in engine.failure and "exited with code -9" in engine.failure
        assert failures == [engine.failure]
        with pytest.raises(TensorParallelBroken):
            engine.step()
    finally:
        engine.close()


RANK_ZERO = """
import sys, time
from tests.engine_proc.engine_factory import make_engine
engine = make_engine(sys.argv[1], tensor_parallel_size=2)
print(engine.model_runner.workers.processes[0].pid, flush=True)
time.sleep(60)
"""


def test_workers_exit_when_rank_zero_is_killed(tiny_model_path):
    rank_zero = subprocess.Popen([sys.executable, "-c", RANK_ZERO, str(tiny_model_path)],
                                 stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        worker = psutil.Process(int(rank_zero.stdout.readline()))
        rank_zero.kill()
        rank_zero.wait()
        worker.wait(timeout=2.0)  # end of file on its pipe
    finally:
        rank_zero.kill()
        rank_zero.wait()


@pytest.fixture(scope="module")
def tiny_config(tiny_model_path):
    return load_model_config(tiny_model_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_match_one(tiny_model_path):
    """NCCL on cuda:0 and cuda:1 against one GPU (float32)."""
    config = load_model_config(tiny_model_path)
    assert_same_outputs(config, tiny_model_path, [TEXT, TWO_IMAGES], device="cuda")
