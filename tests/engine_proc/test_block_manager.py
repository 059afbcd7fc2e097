import pytest

from engine_proc.block_manager import BlockManager
from engine_proc.sequence import Sequence
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
