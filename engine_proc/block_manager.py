"""Paged KV cache bookkeeping: which cache blocks each sequence owns.

Block `b` holds the K/V of tokens `[i * block_size, (i + 1) * block_size)` of the sequence
whose `block_table[i] == b`; the model runner turns that into flat slots
`b * block_size + offset`. No prefix caching yet, so a block has exactly one owner.
"""

from __future__ import annotations

from collections import deque

from engine_proc.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        return self.num_blocks_for(num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Give a sequence that holds no blocks enough for its first `num_tokens` tokens."""
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        n = self.num_blocks_for(num_tokens)
        if n > len(self.free_block_ids):
            raise RuntimeError(f"allocate {n} blocks with {len(self.free_block_ids)} free")
        pop = self.free_block_ids.popleft
        seq.block_table = [pop() for _ in range(n)]

    def can_append(self, seq: Sequence) -> bool:
        """Whether the cache can hold one more token of `seq` (the one it decodes next)."""
        missing = self.num_blocks_for(seq.num_tokens) - len(seq.block_table)
        return missing <= len(self.free_block_ids)

    def append(self, seq: Sequence) -> None:
        """Grow `seq`'s block table to cover all its tokens (at most one block per decode)."""
        missing = self.num_blocks_for(seq.num_tokens) - len(seq.block_table)
        if missing > len(self.free_block_ids):
            raise RuntimeError(f"append {missing} blocks with {len(self.free_block_ids)} free")
        for _ in range(missing):
            seq.block_table.append(self.free_block_ids.popleft())

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table = []
