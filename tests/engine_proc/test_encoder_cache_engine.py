"""The encoder cache inside LLMEngine: greedy outputs equal those with it off, a cached image
skips the vision tower, images sent without pixels take cached embeddings or are refused,
and R3 still holds: once prefilled, the cache is the only holder of embeddings."""

from __future__ import annotations

import gc
import weakref

import pytest

from engine_proc.llm_engine import ImageMissing, LLMEngine, RequestRejected
from shared.messages import AddRequest, ImageInput
from shared.model_config import load_model_config
from tests.engine_proc.engine_factory import make_engine
from tests.engine_proc.test_engine import make_image, make_request

IMAGE = (2, 3)  # merge units: 6 image tokens


@pytest.fixture(scope="module")
def config(tiny_model_path):
    return load_model_config(tiny_model_path)


def count_encodes(engine: LLMEngine) -> list[int]:
    """Counts images through the vision tower (whole or staged: each starts with
    embed_patches), in a list it returns."""
    model = engine.model_runner.model
    counts = [0]
    embed_patches = model.embed_patches

    def counted(pixels, grid):
        counts[0] += 1
        return embed_patches(pixels, grid)

    model.embed_patches = counted
    return counts


def request(config, rid: str, image_seed: int, prompt_seed: int = 0, **kw) -> AddRequest:
    req = make_request(config, rid, [4, IMAGE, 5], prompt_seed, **kw)
    req.images = [make_image(config, *IMAGE, seed=image_seed)]
    return req


def pixel_less(config, rid: str, image_seed: int, engine: LLMEngine, **kw) -> AddRequest:
    req = request(config, rid, image_seed, **kw)
    image = req.images[0]
    key = next(iter(engine.encoder_cache._entries))
    req.images = [ImageInput(None, image.grid_thw, key)]
    return req


def scenarios(config):
    """name -> list of request batches (each batch added at once, then run to the end)."""
    return {
        "same_image_in_a_row": [[request(config, "a", 1)], [request(config, "b", 1, 1)]],
        "same_image_at_once": [[request(config, "a", 1), request(config, "b", 1, 1)]],
        "two_images_same_size": [[request(config, "a", 1)], [request(config, "b", 2)]],
    }


@pytest.mark.parametrize("name", ["same_image_in_a_row", "same_image_at_once",
                                  "two_images_same_size"])
def test_outputs_equal_with_the_cache_off(tiny_model_path, config, name):
    results = {}
    encodes = {}
    for budget in (0, 1 << 20):
        engine = make_engine(tiny_model_path, encoder_cache_bytes=budget)
        counts = count_encodes(engine)
        out = {}
        for batch in scenarios(config)[name]:
            out.update(engine.generate(batch))
        results[budget], encodes[budget] = out, counts[0]
        assert engine.stats().mm_bytes_held == 0
    assert results[0] == results[1 << 20]
    # the same image twice in one step is encoded once, cache or not
    assert encodes[0] == (1 if name == "same_image_at_once" else 2)
    assert encodes[1 << 20] == (2 if name == "two_images_same_size" else 1)


def test_a_cached_image_skips_the_tower_and_its_pixels_go_at_add(tiny_model_path, config):
    engine = make_engine(tiny_model_path)
    counts = count_encodes(engine)
    engine.generate([request(config, "a", 1)])
    assert counts[0] == 1
    stats = engine.stats()
    assert (stats.encoder_cache_entries, stats.encoder_cache_queries, stats.encoder_cache_hits) \
        == (1, 1, 0)
    assert stats.encoder_cache_bytes > 0 and stats.mm_bytes_held == 0
    second = request(config, "b", 1)
    pixels = weakref.ref(second.images[0].pixels)
    engine.add_request(second)
    del second
    gc.collect()
    assert pixels() is None, "a cached image kept its pixels"
    assert engine.stats().mm_bytes_held == 0, "a cached tensor was counted twice"
    while engine.has_unfinished_requests():
        engine.step()
    assert counts[0] == 1
    assert engine.stats().encoder_cache_hits == 1


def test_staged_encoding_fills_the_cache_too(tiny_model_path, config):
    engine = make_engine(tiny_model_path, max_num_encoder_patches=8, encoder_stage_patches=8)
    counts = count_encodes(engine)
    first = engine.generate([request(config, "a", 1)])
    second = engine.generate([request(config, "b", 1)])
    assert counts[0] == 1 and first["a"] == second["b"]


def test_r3_after_prefill_the_cache_is_the_only_holder(tiny_model_path, config):
    engine = make_engine(tiny_model_path, max_num_batched_tokens=16)
    engine.generate([request(config, "a", 1)])
    ref = weakref.ref(next(iter(engine.encoder_cache._entries.values())).embeds)
    engine.add_request(request(config, "b", 1))
    engine.step()  # prefill consumed the image
    seq = engine.seqs["b"]
    assert seq.images[0].released and engine.stats().mm_bytes_held == 0
    engine.encoder_cache._evict_oldest()
    gc.collect()
    assert ref() is None, "a request kept embeddings after its prefill"
    while engine.has_unfinished_requests():
        engine.step()


def test_eviction_before_prefill_keeps_the_requests_tensor_and_counts_it(tiny_model_path, config):
    engine = make_engine(tiny_model_path)
    expected = engine.generate([request(config, "a", 1)])["a"]
    engine.add_request(request(config, "b", 1))
    engine.add_request(pixel_less(config, "c", 1, engine))
    ref = weakref.ref(engine.seqs["b"].images[0].embeds)
    assert engine.seqs["c"].images[0].embeds is ref()  # one tensor, held by both
    engine.encoder_cache._evict_oldest()
    nbytes = ref().numel() * ref().element_size()
    assert engine.stats().mm_bytes_held == nbytes  # counted once, by the requests now
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out["b"] == expected and out["c"] == expected
    gc.collect()
    assert ref() is None and engine.stats().mm_bytes_held == 0


def test_abort_and_failure_release_the_cached_tensor(tiny_model_path, config, monkeypatch):
    engine = make_engine(tiny_model_path)
    engine.generate([request(config, "a", 1)])
    engine.add_request(pixel_less(config, "b", 1, engine))
    ref = weakref.ref(engine.seqs["b"].images[0].embeds)
    engine.abort_request("b")
    engine.step()
    engine.add_request(request(config, "c", 1))

    def boom(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(engine.model_runner.model, "compute_logits", boom)
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["error"]
    assert not engine.seqs and engine.stats().mm_bytes_held == 0
    engine.encoder_cache._evict_oldest()
    gc.collect()
    assert ref() is None, "an aborted or failed request kept its cached embeddings"


def test_images_without_pixels(tiny_model_path, config):
    engine = make_engine(tiny_model_path)
    expected = engine.generate([request(config, "a", 1)])["a"]
    assert engine.generate([pixel_less(config, "b", 1, engine)])["b"] == expected

    grid_mismatch = pixel_less(config, "c", 1, engine)
    grid_mismatch.images[0].grid_thw = (1, 6, 4)
    with pytest.raises(RequestRejected, match="does not match the cached"):
        engine.add_request(grid_mismatch)
    no_key = pixel_less(config, "d", 1, engine)
    no_key.images[0].key = b""
    with pytest.raises(RequestRejected, match="no pixels and no key"):
        engine.add_request(no_key)
    wrong_run = pixel_less(config, "e", 1, engine)
    wrong_run.images[0].grid_thw = (1, 4, 8)
    with pytest.raises(RequestRejected, match="image tokens"):
        engine.add_request(wrong_run)

    evicted = pixel_less(config, "f", 1, engine)
    engine.encoder_cache._evict_oldest()
    with pytest.raises(ImageMissing):
        engine.add_request(evicted)
    assert not engine.seqs and engine.stats().mm_bytes_held == 0
    added, removed = engine.take_encoder_key_changes()
    assert removed == [evicted.images[0].key] and not added


def test_default_budget_is_an_eighth_of_the_kv_cache(tiny_model_path):
    engine = make_engine(tiny_model_path)
    runner = engine.model_runner
    assert engine.encoder_cache.max_bytes == runner.num_kv_blocks * runner.kv_block_bytes // 8
    assert make_engine(tiny_model_path, encoder_cache_bytes=0).encoder_cache.max_bytes == 0
