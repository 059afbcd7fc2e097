"""EncoderCache alone: byte budget, LRU order, eviction frees the tensor, key news, and a
span's own reference surviving eviction (entries are not pinned, by design)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

from engine_proc.encoder_cache import EncoderCache
from engine_proc.sequence import ImageSpan

GRID = (1, 4, 4)


def embeds(rows: int = 4, cols: int = 8) -> torch.Tensor:  # 4 x 8 float32: 128 bytes
    return torch.randn(rows, cols)


def span(key: bytes, grid=GRID) -> ImageSpan:
    return ImageSpan(np.zeros((56, 56, 3), np.uint8), grid, 0, 4, key)


def test_never_exceeds_its_budget_and_evicts_least_recently_used_first():
    cache = EncoderCache(3 * 128)
    for key in (b"a", b"b", b"c"):
        cache.put(key, embeds(), GRID)
    assert cache.num_bytes == 384 and cache.num_entries == 3
    assert cache.get(b"a") is not None  # a is now the most recently used
    cache.put(b"d", embeds(), GRID)
    assert cache.keys() == [b"c", b"a", b"d"]  # b went first
    for i in range(20):
        cache.put(bytes([i]), embeds(rows=1 + i % 5), GRID)
        assert cache.num_bytes <= cache.max_bytes
    assert cache.num_bytes == sum(e.nbytes for e in cache._entries.values())


def test_an_entry_larger_than_the_budget_is_not_cached():
    cache = EncoderCache(100)
    cache.put(b"a", embeds(), GRID)
    assert cache.num_entries == 0 and cache.num_bytes == 0


def test_zero_turns_it_off():
    cache = EncoderCache(0)
    cache.put(b"a", embeds(1, 1), GRID)
    image = span(b"a")
    assert not cache.enabled and not cache.query(image)
    assert image.pixels is not None and image.embeds is None
    assert (cache.num_queries, cache.num_hits) == (0, 0)
    with pytest.raises(ValueError):
        EncoderCache(-1)


def test_eviction_frees_the_tensor():
    cache = EncoderCache(128)
    tensor = embeds()
    ref = weakref.ref(tensor)
    cache.put(b"a", tensor, GRID)
    del tensor
    gc.collect()
    assert ref() is not None
    cache.put(b"b", embeds(), GRID)
    assert ref() is None, "the cache kept an evicted tensor"


def test_a_hit_hands_the_span_the_tensor_and_drops_its_pixels():
    cache = EncoderCache(1024)
    tensor = embeds()
    cache.put(b"a", tensor, GRID)
    image = span(b"a")
    pixels = weakref.ref(image.pixels)
    assert cache.query(image)
    assert image.embeds is tensor and pixels() is None
    assert (cache.num_queries, cache.num_hits) == (1, 1)
    other_grid = span(b"a", grid=(1, 2, 8))
    assert not cache.fill(other_grid) and other_grid.embeds is None


def test_eviction_cannot_hurt_a_span_that_took_the_tensor():
    """Not pinned: eviction drops only the cache's reference. The span's tensor lives on,
    unchanged, until the span releases it; then nothing holds it."""
    cache = EncoderCache(128)
    cache.put(b"a", embeds(), GRID)
    image = span(b"a")
    assert cache.query(image)
    before = image.embeds.clone()
    ref = weakref.ref(image.embeds)
    cache.put(b"b", embeds(), GRID)  # evicts a
    assert b"a" not in cache and cache.num_bytes <= cache.max_bytes
    assert torch.equal(image.embeds, before)
    assert not cache.holds(b"a", image.embeds)  # so mm_bytes_held counts it, not the cache
    image.release()
    assert ref() is None


def test_key_changes_report_net_additions_and_removals():
    cache = EncoderCache(2 * 128)
    cache.put(b"a", embeds(), GRID)
    cache.put(b"b", embeds(), GRID)
    assert cache.take_key_changes() == ([b"a", b"b"], [])
    cache.put(b"c", embeds(), GRID)  # evicts a
    cache.put(b"a", embeds(), GRID)  # evicts b, a is back
    added, removed = cache.take_key_changes()
    assert added == [b"c", b"a"] and removed == [b"b"]
    cache.put(b"d", embeds(), GRID)  # evicts c: added and gone before anyone heard
    added, removed = cache.take_key_changes()
    assert added == [b"d"] and set(removed) == {b"c"}
    assert cache.take_key_changes() == ([], [])
