"""LLMEngine end to end: greedy tokens identical to transformers' own `generate` (fp32,
CPU) for every family case (families.py) across batching, chunked prefill, abort,
preemption and staged encoding; on the default tiny checkpoint: seeded sampling, request
rejection, failures, KV sizing. Images are (rows, cols) in merge units, so every family
sees prompts of the same token counts."""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch

from engine_proc.llm_engine import LLMEngine, RequestRejected
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.random_checkpoints import ensure_checkpoint
from shared.sampling_params import SamplingParams
from tests.engine_proc.conftest import hf_class
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.families import CASE_IDS, CASES

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=CASES, ids=CASE_IDS)
def model_path(request):
    """Each family case's generated checkpoint."""
    return ensure_checkpoint(request.param)


@pytest.fixture(scope="module")
def config(model_path):
    return load_model_config(model_path)


@pytest.fixture(scope="module")
def tiny_config(tiny_model_path):
    return load_model_config(tiny_model_path)


def make_image(config, rows: int, cols: int, seed: int) -> ImageInput:
    """A resized image of rows x cols merge units (one merged token each)."""
    factor, m = config.image.factor, config.vision.spatial_merge_size
    pixels = np.random.default_rng(seed).integers(
        0, 256, (rows * factor, cols * factor, 3), dtype=np.uint8)
    return ImageInput(pixels, (1, rows * m, cols * m))


def make_prompt(config, segments: list, seed: int = 0) -> tuple[list[int], list[ImageInput]]:
    """segments: ints (that many text tokens) and (rows, cols) tuples (an image of that many
    merge units)."""
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    images: list[ImageInput] = []
    for seg in segments:
        if isinstance(seg, int):
            ids += rng.integers(10, 3900, seg).tolist()
        else:
            image = make_image(config, *seg, seed=seed * 31 + len(images))
            images.append(image)
            n = seg[0] * seg[1]
            ids += (
                [config.vision_start_token_id]
                + [config.image_token_id] * n
                + [config.vision_end_token_id]
            )
    return ids, images


def make_request(
    config, request_id: str, segments: list, prompt_seed: int = 0, **sampling
) -> AddRequest:
    ids, images = make_prompt(config, segments, prompt_seed)
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 0.0)
    return AddRequest(request_id, ids, SamplingParams(**sampling), images)


class Reference:
    """transformers' own model of the checkpoint's architecture, on the same weights."""

    def __init__(self, path):
        from transformers import AutoImageProcessor

        architecture = load_model_config(path).architecture
        self.model = hf_class(architecture).from_pretrained(str(path), dtype=torch.float32).eval()
        self.processor = AutoImageProcessor.from_pretrained(str(path))
        self.image_token_id = self.model.config.image_token_id
        self.cache: dict = {}

    def greedy(
        self, config, segments: list, seed: int = 0, max_tokens: int = MAX_TOKENS
    ) -> list[int]:
        key = (repr(segments), seed, max_tokens)
        if key not in self.cache:
            ids, images = make_prompt(config, segments, seed)
            self.cache[key] = self.greedy_ids(ids, images, max_tokens)
        return self.cache[key]

    def greedy_ids(self, ids: list[int], images: list[ImageInput],
                   max_tokens: int = MAX_TOKENS) -> list[int]:
        """transformers' greedy tokens for a prompt of token ids and resized images."""
        input_ids = torch.tensor([ids])
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            mm_token_type_ids=(input_ids == self.image_token_id).int(),
        )
        if images:
            processed = self.processor(images=[im.pixels for im in images], return_tensors="pt")
            assert processed["image_grid_thw"].tolist() == [list(im.grid_thw) for im in images]
            kwargs.update(
                pixel_values=processed["pixel_values"],
                image_grid_thw=processed["image_grid_thw"],
            )
        with torch.no_grad():
            out = self.model.generate(**kwargs, max_new_tokens=max_tokens, do_sample=False)
        return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def reference(model_path):
    return Reference(model_path)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_path):
    return Reference(tiny_model_path)


TEXT = [17]
ONE_IMAGE = [5, (2, 3), 9]
TWO_IMAGES = [3, (2, 2), 4, (4, 3), 6]


def run(engine: LLMEngine, requests: list[AddRequest]) -> dict[str, list[int]]:
    return engine.generate(requests)


def assert_all_released(engine: LLMEngine) -> None:
    """Every KV block and (hybrid models) every recurrent state slot is free again."""
    stats = engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    slots = engine.scheduler.state_slots
    if slots is not None:
        assert stats.num_state_slots_free == slots.num_slots
        assert all(seq.state_slot == -1 for seq in engine.seqs.values())


@pytest.mark.parametrize(
    "segments", [TEXT, ONE_IMAGE, TWO_IMAGES], ids=["text", "one_image", "two_images"]
)
def test_greedy_matches_transformers(model_path, config, reference, segments):
    engine = make_engine(model_path)
    out = run(engine, [make_request(config, "a", segments)])
    assert out["a"] == reference.greedy(config, segments)
    assert_all_released(engine)


def test_batch_admitted_at_different_steps(model_path, config, reference):
    engine = make_engine(model_path)
    plan = {  # step at which each request joins
        0: [("text", TEXT, 1), ("img", ONE_IMAGE, 2)],
        2: [("two", TWO_IMAGES, 3), ("text2", [30], 4)],
        5: [("img2", [2, (3, 2), 3], 5)],
    }
    expected = {}
    got: dict[str, list[int]] = {}
    step = 0
    while step <= max(plan) or engine.has_unfinished_requests():
        for rid, segments, seed in plan.get(step, []):
            engine.add_request(make_request(config, rid, segments, seed))
            expected[rid] = reference.greedy(config, segments, seed)
            got[rid] = []
        for output in engine.step():
            got[output.request_id] += output.new_token_ids
        step += 1
    assert got == expected


def test_chunked_prefill_splits_image_placeholders(model_path, config, reference):
    # 16-token budget: the 48 placeholders of the big image (tokens 6..53) span four chunks,
    # the first and last partial; the small request's image is split too
    engine = make_engine(model_path, max_num_batched_tokens=16, max_num_seqs=4)
    segments = [5, (6, 8), 7]
    other = [3, (2, 3), 20]
    requests = [make_request(config, "big", segments), make_request(config, "small", other, 1)]
    out = run(engine, requests)
    assert out["big"] == reference.greedy(config, segments)
    assert out["small"] == reference.greedy(config, other, 1)


def test_abort_mid_decode(model_path, config, reference):
    engine = make_engine(model_path)
    for rid, segments, seed in (("a", TEXT, 1), ("b", ONE_IMAGE, 2), ("c", TWO_IMAGES, 3)):
        engine.add_request(
            make_request(config, rid, segments, seed, max_tokens=20, ignore_eos=True)
        )
    got = {"a": [], "b": [], "c": []}
    finish = {}
    for _ in range(4):
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    # (hybrid prefix caching cuts a prompt's prefill at its last block boundary: a step more)
    num_before_abort = len(got["b"])
    assert num_before_abort >= 3
    assert engine.abort_request("b")
    assert not engine.abort_request("b") and not engine.abort_request("nope")
    while engine.has_unfinished_requests():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    assert finish == {"a": "length", "b": "abort", "c": "length"}
    assert len(got["b"]) == num_before_abort
    ref_a = reference.greedy(config, TEXT, 1, max_tokens=20)
    ref_c = reference.greedy(config, TWO_IMAGES, 3, max_tokens=20)
    # transformers stops at EOS; with ignore_eos the engine goes on, so compare up to it
    assert got["a"][: len(ref_a)] == ref_a and got["c"][: len(ref_c)] == ref_c
    assert engine.stats().mm_bytes_held == 0
    assert_all_released(engine)


def test_preemption_under_tiny_kv_cache(model_path, config, reference):
    # 14 blocks of 4 tokens for a mix whose greedy outputs would need far more at once
    engine = make_engine(model_path, num_kv_blocks=14, block_size=4, max_num_batched_tokens=64)
    cases = {
        "t1": ([9], 1),
        "t2": ([13], 2),
        "t3": ([6], 3),
        "img": ([2, (2, 2), 3], 4),
        "t4": ([11], 5),
    }
    out = run(engine, [make_request(config, rid, seg, seed) for rid, (seg, seed) in cases.items()])
    assert engine.scheduler.num_preemptions > 0
    for rid, (seg, seed) in cases.items():
        assert out[rid] == reference.greedy(config, seg, seed), rid
    assert engine.stats().num_kv_blocks_free == 14
    assert_all_released(engine)


def test_two_images_in_one_step_with_every_cache_off(tiny_model_path, tiny_config,
                                                     tiny_reference):
    """Without the caches images carry no content key: each is still encoded as itself
    (they were once taken for copies of the first image of the step)."""
    engine = make_engine(tiny_model_path, enable_prefix_caching=False, encoder_cache_bytes=0)
    out = run(engine, [make_request(tiny_config, "a", TWO_IMAGES)])
    assert out["a"] == tiny_reference.greedy(tiny_config, TWO_IMAGES)


def test_seeded_sampling_is_reproducible(tiny_model_path, tiny_config):
    sampled = dict(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, ignore_eos=True)
    engine = make_engine(tiny_model_path)
    first = run(engine, [make_request(tiny_config, "s", ONE_IMAGE, 0, seed=1234, **sampled)])["s"]
    # same seed, now next to other requests (seeded and not): same tokens
    batch = [
        make_request(tiny_config, "x", TEXT, 5, **sampled),
        make_request(tiny_config, "s", ONE_IMAGE, 0, seed=1234, **sampled),
        make_request(tiny_config, "y", TEXT, 6, seed=7, **sampled),
    ]
    again = run(engine, batch)["s"]
    other = run(engine, [make_request(tiny_config, "s", ONE_IMAGE, 0, seed=99, **sampled)])["s"]
    assert first == again
    assert first != other


def test_rejections(tiny_model_path, tiny_config):
    engine = make_engine(tiny_model_path, max_model_len=64, max_waiting=2, num_kv_blocks=3)
    with pytest.raises(RequestRejected, match="max_model_len"):
        engine.add_request(make_request(tiny_config, "long", [64]))
    with pytest.raises(RequestRejected, match="KV cache"):
        engine.add_request(make_request(tiny_config, "big", [60], max_tokens=200))
    ids, images = make_prompt(tiny_config, ONE_IMAGE)
    with pytest.raises(RequestRejected, match="no images"):
        engine.add_request(AddRequest("noimg", ids, SamplingParams()))
    bad = ImageInput(images[0].pixels, (1, 2, 2))
    with pytest.raises(RequestRejected, match="grid_thw"):
        engine.add_request(AddRequest("grid", ids, SamplingParams(), [bad]))
    with pytest.raises(RequestRejected, match="image tokens"):
        engine.add_request(AddRequest("count", ids[:6] + ids[7:], SamplingParams(), images))
    with pytest.raises(RequestRejected, match="vocabulary"):
        engine.add_request(AddRequest("vocab", [10**6], SamplingParams()))
    engine.add_request(make_request(tiny_config, "q1", TEXT))
    with pytest.raises(RequestRejected, match="already running"):
        engine.add_request(make_request(tiny_config, "q1", TEXT))
    engine.add_request(make_request(tiny_config, "q2", TEXT))
    with pytest.raises(RequestRejected, match="queue is full"):
        engine.add_request(make_request(tiny_config, "q3", TEXT))
    assert engine.stats().num_waiting == 2
    out = engine.generate([])
    assert out == {}
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_requests_finished == 2


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(
    tiny_model_path, tiny_config, tiny_reference
):
    engine = make_engine(tiny_model_path)
    model = engine.model_runner.model
    original = model.encode_images

    def broken(*args, **kwargs):
        raise RuntimeError("vision tower exploded")

    model.encode_images = broken
    request = make_request(tiny_config, "img", ONE_IMAGE)
    pixels_ref = weakref.ref(request.images[0].pixels)
    engine.add_request(request)
    del request
    outputs = engine.step()
    assert pixels_ref() is None  # not kept alive by the exception's frames
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("img", "error")]
    assert "exploded" in outputs[0].error
    assert engine.stats().mm_bytes_held == 0 and not engine.has_unfinished_requests()
    model.encode_images = original
    out = run(engine, [make_request(tiny_config, "img", ONE_IMAGE)])
    assert out["img"] == tiny_reference.greedy(tiny_config, ONE_IMAGE)


def test_kv_cache_sizing(tiny_model_path):
    # capped at what max_num_seqs sequences of max_model_len tokens could use
    engine = LLMEngine(str(tiny_model_path), max_num_seqs=2, max_model_len=512, device="cpu")
    assert engine.stats().num_kv_blocks_total == 2 * 512 // 16
    # a byte budget: 4 layers x K and V x 16 tokens x 2 heads x 32 dims x 4 bytes per block
    engine = LLMEngine(str(tiny_model_path), kv_cache_memory_bytes=1 << 20, device="cpu")
    assert engine.model_runner.kv_block_bytes == 32768
    assert engine.stats().num_kv_blocks_total == 32
    assert engine.model_runner.kv_cache.shape == (2, 4, 32, 16, 2, 32)


def test_an_image_over_the_encoder_budget_is_encoded_in_stages(model_path, config, reference):
    # a 16-patch budget: the 6x8-unit image runs through the tower's stages (two for
    # Qwen2.5-VL's, four for a full-attention tower) in steps of its own before its chunk;
    # the tokens are the same
    engine = make_engine(model_path, max_num_encoder_patches=16, encoder_stage_patches=16, max_num_seqs=4)
    assert engine.model_runner.model.num_vision_stages >= 2
    segments = [5, (6, 8), 7]
    requests = [make_request(config, "big", segments), make_request(config, "text", TEXT, 1)]
    out = run(engine, requests)
    assert out["big"] == reference.greedy(config, segments)
    assert out["text"] == reference.greedy(config, TEXT, 1)


def test_decode_only_steps_between_vision_stages_keep_the_tokens(model_path, config, reference):
    # a decode share of 1: after each vision stage, decode-only steps run for as long as the
    # stage did; the text request decodes through them, and nothing changes in the tokens
    engine = make_engine(model_path, max_num_encoder_patches=16, encoder_stage_patches=16, max_num_seqs=4,
                         decode_share=1.0)
    kinds = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        kinds.append("vision" if batch.ran_vision else "decode" if batch.all_decode else "-")
        return batch

    engine.scheduler.schedule = recording
    segments = [5, (6, 8), 7]
    requests = [make_request(config, "text", TEXT, 1), make_request(config, "big", segments)]
    out = run(engine, requests)
    assert out["big"] == reference.greedy(config, segments)
    assert out["text"] == reference.greedy(config, TEXT, 1)
    first_vision = kinds.index("vision")
    assert kinds[first_vision + 1] == "decode", kinds  # the text decodes before the next stage


def test_a_failing_stage_fails_its_request(tiny_model_path, tiny_config, tiny_reference):
    engine = make_engine(tiny_model_path, max_num_encoder_patches=16, encoder_stage_patches=16)
    model = engine.model_runner.model
    original = model.encode_stage

    def broken(*args, **kwargs):
        raise RuntimeError("stage exploded")

    model.encode_stage = broken
    engine.add_request(make_request(tiny_config, "img", [(6, 8), 3]))  # no text before it
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("img", "error")]
    assert "exploded" in outputs[0].error
    assert engine.stats().mm_bytes_held == 0 and not engine.has_unfinished_requests()
    model.encode_stage = original
