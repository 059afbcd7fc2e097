"""Prefix caching for hybrid models (Qwen3.5): recurrent state snapshots at block
boundaries. A conversation that re-sends its history and image resumes from a boundary
after the last reply (and a repeated prompt from its last block), with greedy tokens equal
to caching off and to transformers; prompts shorter than vLLM's 528-token blocks hit too;
snapshots stay within their number; tensor-parallel ranks restore alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_proc.llm_engine import LLMEngine
from shared.messages import AddRequest
from shared.model_config import load_model_config
from shared.random_checkpoints import TINY_QWEN3_5, TINY_QWEN3_5_MOE, ensure_checkpoint
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import Reference, assert_all_released, make_prompt
from tests.tolerance import decoder_terms, tolerance_for

pytestmark = pytest.mark.numeric

TURN_TOKENS = 12


@pytest.fixture(scope="module", params=[TINY_QWEN3_5, TINY_QWEN3_5_MOE], ids=lambda p: p.name)
def path(request):
    return ensure_checkpoint(request.param)


@pytest.fixture(scope="module")
def config(path):
    return load_model_config(path)


@pytest.fixture(scope="module")
def reference(path):
    return Reference(path)


def conversation(engine: LLMEngine, config, turns: list[list], seed: int = 0):
    """Each turn's prompt is the whole history so far (its tokens, its images, every reply)
    and the new segments; returns each turn's reply and (prompt ids, images)."""
    ids, images, replies, prompts = [], [], [], []
    for i, segments in enumerate(turns):
        new_ids, new_images = make_prompt(config, segments, seed * 10 + i)
        ids, images = ids + new_ids, images + new_images
        prompts.append((list(ids), list(images)))
        sampling = SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0, ignore_eos=True)
        reply = engine.generate([AddRequest(f"turn{i}", ids, sampling, images)])[f"turn{i}"]
        replies.append(reply)
        ids = ids + reply
    return replies, prompts


TURNS = [[20, (3, 4), 9], [7], [5, (2, 2), 4]]


def test_a_conversation_resumes_after_its_history(path, config, reference):
    engine = make_engine(path, encoder_cache_bytes=0)
    replies, prompts = conversation(engine, config, TURNS)
    scheduler = engine.scheduler
    assert scheduler.snapshots is not None and scheduler.num_prefix_cache_hits > 0
    # turn 2 and 3 resumed at the last block boundary their history's decoding reached
    first_len = len(prompts[0][0])
    assert scheduler.num_prefix_cache_hits >= (first_len + TURN_TOKENS - 16) // 16 * 16
    off = make_engine(path, encoder_cache_bytes=0, mamba_cache_mode="none")
    assert off.scheduler.snapshots is None
    assert conversation(off, config, TURNS)[0] == replies
    assert off.scheduler.num_prefix_cache_hits == 0
    for (ids, images), reply in zip(prompts, replies, strict=True):
        assert reference.greedy_ids(ids, images, TURN_TOKENS) == reply
    assert_all_released(engine)


def test_a_repeated_prompt_shorter_than_vllms_block_hits(path, config):
    """A 40-token prompt (vLLM's hybrid blocks for Qwen3.5-4B are 528 tokens: no hit)."""
    engine = make_engine(path)
    ids, images = make_prompt(config, [40], 3)

    def ask(rid: str):
        sampling = SamplingParams(max_tokens=6, temperature=0.0)
        return engine.generate([AddRequest(rid, ids, sampling, images)])[rid]

    first = ask("a")
    assert engine.scheduler.num_prefix_cache_hits == 0
    assert ask("b") == first
    assert engine.scheduler.num_prefix_cache_hits == 32  # the prompt's last full block: 2 x 16


@pytest.fixture(scope="module")
def dense():
    path = ensure_checkpoint(TINY_QWEN3_5)
    return path, load_model_config(path)


def test_snapshots_stay_within_their_number(dense):
    path, config = dense
    engine = make_engine(path, block_size=4, state_snapshot_bytes=1)
    assert engine.model_runner.num_state_snapshots == 0  # less than one snapshot: off
    assert engine.scheduler.snapshots is None
    slot = engine.model_runner.state_shape.slot_bytes
    engine = make_engine(path, block_size=4, state_snapshot_bytes=3 * slot)
    snapshots = engine.scheduler.snapshots
    assert snapshots.num_snapshots == 3
    rng = np.random.default_rng(0)
    for i in range(8):
        sampling = SamplingParams(max_tokens=int(rng.integers(3, 12)), temperature=0.0)
        ids, images = make_prompt(config, [int(rng.integers(6, 30))], i)
        engine.generate([AddRequest(f"r{i}", ids, sampling, images)])
        assert snapshots.num_registered + len(snapshots.free_slots) == 3
    assert snapshots.num_registered >= 2  # a decoding snapshot replaces its previous one


def test_a_failed_step_keeps_no_snapshot(path, config):
    engine = make_engine(path)
    model = engine.model_runner.model
    forward = model.forward
    model.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("decoder exploded"))
    ids, images = make_prompt(config, [40], 1)
    engine.add_request(AddRequest("x", ids, SamplingParams(max_tokens=4), images))
    assert [o.finish_reason for o in engine.step()] == ["error"]
    model.forward = forward
    snapshots = engine.scheduler.snapshots
    assert snapshots.num_registered == 0 and len(snapshots.free_slots) == snapshots.num_snapshots


def test_tensor_parallel_ranks_restore_alike(dense):
    """The copies to and from snapshots run on every rank: TP=2 gives TP=1's replies."""
    path, config = dense
    single = conversation(make_engine(path), config, TURNS[:2], seed=1)[0]
    split = make_engine(path, tensor_parallel_size=2)
    try:
        assert conversation(split, config, TURNS[:2], seed=1)[0] == single
        assert split.scheduler.num_prefix_cache_hits > 0
    finally:
        split.close()


def test_a_hit_that_ends_inside_an_image_encoded_in_stages(dense):
    """The prompt's snapshot boundary (16) falls inside its image, whose encoding takes
    steps of their own (an 8-patch budget): the restore runs in a step with no tokens, and
    the second request gets the first one's tokens."""
    from tests.engine_proc.test_tensor_parallel import generate

    path, config = dense
    engine = make_engine(path, encoder_cache_bytes=0, max_num_encoder_patches=8,
                         encoder_stage_patches=8)
    ids, images = make_prompt(config, [10, (4, 4), 3], 7)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first, first_logits = generate(engine, [AddRequest("a", ids, sampling, images)])
    again, again_logits = generate(engine, [AddRequest("b", ids, sampling, images)])
    assert engine.scheduler.num_prefix_cache_hits == 16
    assert again["b"] == first["a"]
    # the image encodes the same way both times; from the restored state on, the decoder
    # runs the prompt's rest in other chunks (other GEMM blockings, another recurrence split)
    terms = decoder_terms(config.text, len(ids) + 8)
    for a, b in zip(first_logits, again_logits, strict=True):
        torch.testing.assert_close(b, a, **tolerance_for(a, terms))
