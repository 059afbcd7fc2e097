import numpy as np
import pytest

from engine_proc.block_hash import hash_next_block
from engine_proc.block_manager import BlockManager
from engine_proc.sequence import ImageSpan, Sequence
from shared.sampling_params import SamplingParams


def make_seq(num_tokens: int) -> Sequence:
    return Sequence("r", list(range(num_tokens)), SamplingParams())


def test_allocate_append_free_round_trip():
    bm = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq(5)
    assert bm.can_allocate(5) and not bm.can_allocate(17)
    bm.allocate(seq, seq.num_tokens)
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 2
    # tokens 6..8 fit the second block; the 9th needs a third
    for n in range(6, 9):
        seq.append_token(n)
        assert bm.can_append(seq)
        bm.append(seq)
        assert len(seq.block_table) == 2
    seq.append_token(9)
    bm.append(seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == bm.num_blocks - 3
    bm.free(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 4


def test_blocks_are_exclusive_and_exhaustion_is_reported():
    bm = BlockManager(num_blocks=3, block_size=2)
    a, b = make_seq(4), make_seq(2)
    bm.allocate(a, 4)
    bm.allocate(b, 2)
    assert not set(a.block_table) & set(b.block_table)
    assert bm.num_free_blocks == 0
    b.append_token(7)
    assert not bm.can_append(b)
    with pytest.raises(RuntimeError):
        bm.append(b)
    bm.free(a)
    assert bm.can_append(b)


def test_reservation_larger_than_tokens():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(3)
    bm.allocate(seq, 13)  # reserve for later growth
    assert len(seq.block_table) == 4
    seq.token_ids.extend(range(10))
    assert bm.can_append(seq)
    bm.append(seq)
    assert len(seq.block_table) == 4  # nothing new needed


def test_invalid_sizes():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


# ---- prefix caching ------------------------------------------------------------------------


def computed(bm: BlockManager, seq: Sequence, num_tokens: int) -> Sequence:
    """What the scheduler does after a step that computed `seq`'s first `num_tokens`."""
    seq.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(seq)
    return seq


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.find_cached_blocks(seq)
    bm.allocate(seq, seq.num_tokens, cached)
    seq.num_computed_tokens = len(cached) * bm.block_size
    return cached


def test_a_sequence_reuses_the_cached_blocks_of_its_prefix():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = Sequence("a", list(range(10)), SamplingParams())
    assert admit(bm, a) == []
    computed(bm, a, 10)  # blocks 0 and 1 are full, block 2 is not
    b = Sequence("b", list(range(9)) + [99, 98], SamplingParams())
    assert bm.find_cached_blocks(b) == a.block_table[:2]
    # a's blocks cost nothing: only b's third block comes from the free pool
    assert bm.can_allocate(b.num_tokens, a.block_table[:2])
    admit(bm, b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8 and bm.num_free_blocks == 8 - 4
    assert [bm.ref_counts[i] for i in a.block_table] == [2, 2, 1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and not any(bm.ref_counts)


def test_a_hit_always_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = make_seq(9)
    admit(bm, a)
    computed(bm, a, 8)
    same = make_seq(8)  # its two blocks are cached, but it needs the logits of token 7
    assert len(bm.find_cached_blocks(same)) == 1


def test_freed_blocks_stay_cached_until_reused_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    admit(bm, a)
    computed(bm, a, 6)
    first, second, third, partial = a.block_table
    bm.free(a)  # tail first: the partial block, then the prefix from its end
    assert list(bm.free_block_ids)[-4:] == [partial, third, second, first]
    assert bm.num_free_blocks == 6
    # a hit on a free cached block takes it off the free list, and counts as taken
    b = Sequence("b", [1, 2, 3, 4, 9], SamplingParams())
    cached = bm.find_cached_blocks(b)
    assert cached == [first, second]
    admit(bm, b)
    assert first not in bm.free_block_ids and bm.num_free_blocks == 3
    # fresh blocks: the never-used one first, then the least recently freed: a's partial
    # block, then its third, whose hash goes with it
    c = make_seq(6)
    bm.allocate(c, 6)
    assert c.block_table[1:] == [partial, third] and c.block_table[0] not in (first, second)
    again = Sequence("a2", [1, 2, 3, 4, 5, 6, 7], SamplingParams())
    assert bm.find_cached_blocks(again) == [first, second]  # the third was evicted
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and not any(bm.ref_counts)


def test_the_same_content_computed_twice_keeps_one_cached_copy():
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_seq(5), make_seq(5)
    admit(bm, a)
    admit(bm, b)  # both admitted before either computed: no hit
    computed(bm, a, 5)
    computed(bm, b, 5)
    assert bm.find_cached_blocks(make_seq(5)) == a.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and len(bm.cached_block_ids) == 2


def test_without_prefix_caching_nothing_is_found():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq(5)
    admit(bm, a)
    computed(bm, a, 5)
    assert bm.find_cached_blocks(make_seq(5)) == [] and not bm.cached_block_ids
    assert a.block_hashes == []  # nothing hashed either


def test_block_hashes_tell_images_apart_by_key_and_by_row():
    def seq(key: bytes, offset: int = 2) -> Sequence:
        pixels = np.zeros((28, 28, 3), np.uint8)
        images = [ImageSpan(pixels, (1, 2, 2), offset, 4, key)]
        return Sequence("s", [1] * 12, SamplingParams(), images)

    def hashes(s: Sequence) -> list[bytes]:
        for _ in range(3):
            hash_next_block(s, 4)
        return s.block_hashes

    same, twin, other, shifted = hashes(seq(b"x")), hashes(seq(b"x")), hashes(seq(b"y")), \
        hashes(seq(b"x", offset=3))
    assert same == twin
    # block 1 holds tokens 4-7: from the image's row 2, or its row 1 when shifted (the
    # tokens, all alike here, would tell real prompts apart earlier)
    assert other[0] != same[0] and shifted[1] != same[1]
    # every later block differs through the chain, though its tokens are the same
    assert other[2] != same[2] and shifted[2] != same[2]
