"""Prefix caching end to end on the tiny checkpoints: greedy tokens with it on equal those
with it off (which test_engine.py checks against transformers), the cache really hits,
images in the cached prefix are not encoded, and every block is free at the end."""

from __future__ import annotations

import numpy as np
import pytest

from engine_proc.llm_engine import LLMEngine
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from shared.random_checkpoints import TINY, TINY_QWEN3_VL, ensure_checkpoint
from shared.sampling_params import SamplingParams
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import make_prompt

BLOCK_SIZE = 4
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=[TINY, TINY_QWEN3_VL], ids=lambda p: p.name)
def model_path(request):
    return ensure_checkpoint(request.param)


@pytest.fixture(scope="module")
def config(model_path):
    return load_model_config(model_path)


@pytest.fixture(scope="module")
def engines(model_path):
    """engines(caching, **settings): one engine per settings, made on first use (the
    tiny models load in about a second; tests share them)."""
    made: dict = {}

    def get(caching: bool, **kw) -> LLMEngine:
        key = (caching, tuple(sorted(kw.items())))
        if key not in made:
            kw.setdefault("block_size", BLOCK_SIZE)
            made[key] = make_engine(model_path, enable_prefix_caching=caching, **kw)
        return made[key]

    return get


def request(rid: str, ids: list[int], images: list[ImageInput], **sampling) -> AddRequest:
    sampling.setdefault("max_tokens", MAX_TOKENS)
    sampling.setdefault("temperature", 0.0)
    return AddRequest(rid, list(ids), SamplingParams(**sampling), list(images))


class EncodeCounter:
    """Counts the images an engine's vision tower encodes (whole or by stages)."""

    def __init__(self, engine: LLMEngine):
        self.count = 0
        model = engine.model_runner.model
        encode_images, encode_stage = model.encode_images, model.encode_stage

        def counted_images(pixels, grids):
            self.count += len(pixels)
            return encode_images(pixels, grids)

        def counted_stage(hidden, grid, stage):
            self.count += stage == 0
            return encode_stage(hidden, grid, stage)

        model.encode_images, model.encode_stage = counted_images, counted_stage


def assert_all_free(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert not any(engine.scheduler.block_manager.ref_counts) and stats.mm_bytes_held == 0


def both(engines, requests: list[AddRequest], **kw) -> tuple[dict, LLMEngine]:
    """Run `requests` one after another (so later ones can hit the earlier ones' blocks) on a
    fresh caching engine and on a non-caching one; the outputs must agree."""
    on = make_engine_like(engines, True, **kw)
    off = engines(False, **kw)
    got = {r.request_id: on.generate([r])[r.request_id] for r in requests}
    want = {r.request_id: off.generate([r])[r.request_id] for r in requests}
    assert got == want
    assert_all_free(on)
    return got, on


def make_engine_like(engines, caching: bool, **kw) -> LLMEngine:
    engine = engines(caching, **kw)
    # a fresh cache and fresh counters: forget what earlier tests left
    scheduler = engine.scheduler
    bm = scheduler.block_manager
    scheduler.block_manager = type(bm)(bm.num_blocks, bm.block_size, bm.enable_prefix_caching)
    scheduler.num_prefix_cache_queries = scheduler.num_prefix_cache_hits = 0
    return engine


def test_text_prefix_hits_and_matches(engines, config):
    ids, _ = make_prompt(config, [23])
    requests = [request("a", ids, []), request("b", ids, []), request("c", ids[:10] + [77] * 9, [])]
    _, on = both(engines, requests)
    stats = on.stats()
    # b: all but its last block of 4 (22 of 23 tokens at most: 5 blocks); c: 2 blocks
    assert stats.prefix_cache_hits == 20 + 8
    assert stats.prefix_cache_queries == 23 + 23 + 19


def test_one_image_repeated_is_not_encoded_again(engines, config):
    ids, images = make_prompt(config, [5, (2, 3), 9])
    on = make_engine_like(engines, True)
    counter = EncodeCounter(on)
    both(engines, [request("a", ids, images), request("b", ids, images)])
    assert counter.count == 1
    assert on.stats().prefix_cache_hits == (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_multi_turn_conversation_reuses_turn_one(engines, config):
    ids, images = make_prompt(config, [5, (4, 4), 9])
    on = make_engine_like(engines, True)
    counter = EncodeCounter(on)
    off = engines(False)
    turn1 = request("t1", ids, images, ignore_eos=True)
    reply = on.generate([turn1])["t1"]
    assert reply == off.generate([turn1])["t1"]
    ids2 = ids + reply + make_prompt(config, [7], seed=3)[0]
    turn2 = request("t2", ids2, images)
    hits = on.stats().prefix_cache_hits
    assert on.generate([turn2])["t2"] == off.generate([turn2])["t2"]
    # turn 2 found turn 1's prompt and reply cached (all but the reply's last token, which
    # was sampled but never computed) and did not encode the image again
    assert on.stats().prefix_cache_hits - hits == (len(ids) + len(reply) - 1) // 4 * 4
    assert counter.count == 1
    assert_all_free(on)


def test_two_images_of_the_same_size_never_share_blocks(engines, config):
    ids, first = make_prompt(config, [5, (2, 3), 9], seed=0)
    _, second = make_prompt(config, [5, (2, 3), 9], seed=1)
    assert not np.array_equal(first[0].pixels, second[0].pixels)
    got, on = both(engines, [request("a", ids, first), request("b", ids, second)])
    assert got["a"] != got["b"]  # else the test could not tell a wrong reuse
    # only the blocks before the image's first placeholder (token 6) are shared: block 0
    assert on.stats().prefix_cache_hits == 4


@pytest.mark.parametrize("encoder_patches", [4096, 16], ids=["whole", "in_stages"])
def test_a_hit_ending_inside_an_image(engines, config, encoder_patches):
    """The first request's chunks stop inside its image and it is aborted there: the second
    hits blocks that end inside the image, encodes the image whole, uses its later rows."""
    ids, images = make_prompt(config, [5, (4, 4), 9])
    image_start, image_end = 6, 6 + 16
    # no encoder cache: the second request must encode the image again (the case tested)
    kw = dict(max_num_batched_tokens=12, max_num_seqs=4, max_num_encoder_patches=encoder_patches,
              encoder_stage_patches=encoder_patches,
              encoder_cache_bytes=0)
    on = make_engine_like(engines, True, **kw)
    counter = EncodeCounter(on)
    on.add_request(request("first", ids, images))
    first = on.seqs["first"]
    while first.num_computed_tokens < image_start + BLOCK_SIZE:
        on.step()
    assert first.num_computed_tokens < image_end
    on.abort_request("first")
    on.step()
    second = request("second", ids, images)
    got = on.generate([second])["second"]
    assert got == engines(False, **kw).generate([second])["second"]
    hits = on.stats().prefix_cache_hits
    assert image_start < hits < image_end and hits % BLOCK_SIZE == 0
    assert counter.count == 2
    assert_all_free(on)


def test_a_prefix_that_is_not_a_multiple_of_the_block_size(engines, config):
    common, _ = make_prompt(config, [10], seed=4)
    a = common + make_prompt(config, [7], seed=5)[0]
    b = common + make_prompt(config, [9], seed=6)[0]
    _, on = both(engines, [request("a", a, []), request("b", b, [])])
    assert on.stats().prefix_cache_hits == 8  # the 10 shared tokens fill 2 blocks


def test_abort_while_another_request_shares_the_blocks(engines, config):
    ids, images = make_prompt(config, [5, (2, 3), 9])
    on = make_engine_like(engines, True)
    off = engines(False)
    want = off.generate([request("b", ids + [33, 44], images, max_tokens=16)])["b"]
    on.add_request(request("a", ids, images, max_tokens=16, ignore_eos=True))
    on.step()
    on.add_request(request("b", ids + [33, 44], images, max_tokens=16))
    got = {"a": [], "b": []}
    for _ in range(3):
        for o in on.step():
            got[o.request_id] += o.new_token_ids
    shared = set(on.seqs["a"].block_table) & set(on.seqs["b"].block_table)
    assert shared
    assert on.abort_request("a")
    while on.has_unfinished_requests():
        for o in on.step():
            got[o.request_id] += o.new_token_ids
    assert got["b"] == want
    assert_all_free(on)


def test_preemption_with_shared_blocks(engines, config):
    common, _ = make_prompt(config, [9], seed=7)
    requests = [
        request(f"t{i}", common + make_prompt(config, [3 + i], seed=10 + i)[0], [],
                max_tokens=16, ignore_eos=True)
        for i in range(5)
    ]
    kw = dict(num_kv_blocks=16, max_num_batched_tokens=64)
    on = make_engine_like(engines, True, **kw)
    off = engines(False, **kw)
    got = on.generate(requests)
    assert got == off.generate(requests)
    assert on.scheduler.num_preemptions > 0 and on.stats().prefix_cache_hits > 0
    assert_all_free(on)
