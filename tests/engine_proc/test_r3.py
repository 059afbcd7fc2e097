"""R3, proven with weakrefs: the engine drops an image's pixels once encoded and its
embeddings right after the step that ran the last chunk covering its placeholder tokens;
aborts free everything; nothing multimodal is referenced once requests decode."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from engine_proc.llm_engine import LLMEngine
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.sampling_params import SamplingParams
from tests.engine_proc import engine_factory


def make_engine(path, **kw) -> LLMEngine:
    """The encoder cache off: these tests prove what the requests hold, and a cached tensor
    would outlive them by design; test_encoder_cache_engine.py proves the cache is then the
    only holder."""
    return engine_factory.make_engine(path, **{"encoder_cache_bytes": 0, **kw})


@pytest.fixture(scope="module")
def config(tiny_model_path):
    return load_model_config(tiny_model_path)


def image_request(
    config, request_id: str, sizes: list[tuple[int, int]], seed: int = 0, max_tokens: int = 8
):
    """5 text tokens, then per image: vision_start, its placeholders, vision_end, 3 text."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, 3900, 5).tolist()
    images = []
    for h, w in sizes:
        images.append(
            ImageInput(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (1, h // 14, w // 14))
        )
        n = (h // 14) * (w // 14) // 4
        ids += (
            [config.vision_start_token_id]
            + [config.image_token_id] * n
            + [config.vision_end_token_id]
        )
        ids += rng.integers(10, 3900, 3).tolist()
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return AddRequest(request_id, ids, sampling, images)


def hand_over(engine: LLMEngine, request: AddRequest) -> list[weakref.ref]:
    """add_request, keeping only weakrefs to the request and its pixel arrays."""
    refs = [weakref.ref(image.pixels) for image in request.images]
    request_ref = weakref.ref(request)
    engine.add_request(request)
    del request
    assert request_ref() is None, "the engine kept the AddRequest"
    return refs


def test_embeddings_die_right_after_the_last_chunk_covering_the_image(tiny_model_path, config):
    # 16-token steps; placeholders of the first image are tokens 6..53, of the second 59..64
    engine = make_engine(tiny_model_path, max_num_batched_tokens=16, max_num_seqs=2)
    pixel_refs = hand_over(engine, image_request(config, "a", [(168, 224), (56, 84)]))
    assert all(ref() is not None for ref in pixel_refs)
    first, second = engine.seqs["a"].images
    assert (first.offset, first.end, second.offset, second.end) == (6, 54, 59, 65)

    engine.step()  # tokens 0..15: encodes the first image
    assert pixel_refs[0]() is None, "pixels outlived their encoding"
    assert pixel_refs[1]() is not None, "the second image is not reached yet"
    embeds_ref = weakref.ref(first.embeds)
    for _ in range(2):  # tokens 16..47: still inside the first image
        engine.step()
        assert embeds_ref() is not None
    engine.step()  # tokens 48..63: last chunk of the first image, most of the second
    assert embeds_ref() is None, "embeddings outlived the chunk that consumed them"
    assert pixel_refs[1]() is None and second.embeds is not None
    second_ref = weakref.ref(second.embeds)
    engine.step()  # tokens 64..: the second image's last placeholder
    assert second_ref() is None and second.released
    assert engine.stats().mm_bytes_held == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_an_image_encoded_in_stages_holds_one_thing_at_a_time(tiny_model_path, config):
    # a 16-patch budget: the 168x224 image (192 patches) runs one tower stage per step
    engine = make_engine(tiny_model_path, max_num_encoder_patches=16, encoder_stage_patches=16)
    pixel_refs = hand_over(engine, image_request(config, "a", [(168, 224)]))
    image = engine.seqs["a"].images[0]
    engine.step()  # the text before the image, and the first stage
    assert pixel_refs[0]() is None, "pixels outlived the stage that consumed them"
    hidden_ref = weakref.ref(image.hidden)
    assert engine.stats().mm_bytes_held == image.hidden.numel() * 4
    engine.step()  # the last stage
    assert hidden_ref() is None and image.embeds is not None
    embeds_ref = weakref.ref(image.embeds)
    engine.step()  # the chunk that consumes the embeddings
    assert embeds_ref() is None and image.released
    assert engine.stats().mm_bytes_held == 0
    hidden_ref = None
    other = hand_over(engine, image_request(config, "b", [(168, 224)], seed=1))
    engine.step()
    hidden_ref = weakref.ref(engine.seqs["b"].images[0].hidden)
    assert engine.abort_request("b")
    assert other[0]() is None and hidden_ref() is None and engine.stats().mm_bytes_held == 0
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_frees_everything(tiny_model_path, config):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=16, max_num_seqs=2)
    running = hand_over(engine, image_request(config, "run", [(168, 224)]))
    engine.step()  # encoded; embeddings held for the next chunks
    embeds_ref = weakref.ref(engine.seqs["run"].images[0].embeds)
    waiting = hand_over(engine, image_request(config, "wait", [(56, 56)], seed=1))
    assert engine.stats().mm_bytes_held > 0
    assert engine.abort_request("run") and engine.abort_request("wait")
    assert embeds_ref() is None and running[0]() is None and waiting[0]() is None
    outputs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outputs) == [
        ("run", "abort"),
        ("wait", "abort"),
    ]
    stats = engine.stats()
    assert stats.mm_bytes_held == 0 and stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert not engine.has_unfinished_requests()


def test_nothing_multimodal_survives_into_decode(tiny_model_path, config):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=64, max_num_seqs=16)
    embed_refs: list[weakref.ref] = []
    model = engine.model_runner.model
    encode = model.encode_images

    def tracking_encode(pixels, grids):
        out = encode(pixels, grids)
        embed_refs.extend(weakref.ref(t) for t in out)
        return out

    model.encode_images = tracking_encode
    sizes = [[(56, 56)], [(84, 112)], [(56, 84), (112, 56)], [(140, 140)]]
    pixel_refs = []
    for i in range(16):
        pixel_refs += hand_over(
            engine, image_request(config, f"r{i}", sizes[i % 4], seed=i, max_tokens=40)
        )
    held = []
    while not all(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.seqs.values()):
        engine.step()
        held.append(engine.stats().mm_bytes_held)
    assert max(held) > 0 and held[-1] == 0
    assert len(embed_refs) == len(pixel_refs) == 20
    # right after the last prefill, without a gc pass: refcounting alone freed them
    assert [r for r in pixel_refs if r() is not None] == []
    assert [r for r in embed_refs if r() is not None] == []
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is ImageInput]
    # all 16 are decoding now, holding KV blocks and nothing multimodal
    assert engine.stats().num_running == 16
    for _ in range(3):
        engine.step()
        assert engine.stats().mm_bytes_held == 0
    while engine.has_unfinished_requests():
        engine.step()
