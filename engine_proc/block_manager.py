"""Paged KV cache bookkeeping: which cache blocks each sequence holds, and which full blocks
are cached by content for reuse (prefix caching).

Block `b` holds the K/V of tokens `[i * block_size, (i + 1) * block_size)` of every
sequence whose `block_table[i] == b`; the model runner turns that into flat slots
`b * block_size + offset`.

Prefix caching (the design of vLLM v1 and nano-vllm): once a sequence's full block is in
the cache, it is registered under its content hash (engine_proc/block_hash.py). A new
sequence takes the longest run of its leading full blocks found there and computes only
the rest. A block has a reference count (how many block tables hold it); at zero it goes
to the end of the free list but keeps its content and its hash, so a later hit can take it
back. Fresh blocks come from the front of the free list, the least recently freed first,
and lose their hash. A sequence frees its blocks tail first, so a shared prefix outlives
the private blocks after it. Only blocks no other sequence writes to are ever shared: full
blocks, whose K/V never changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from engine_proc.block_hash import hash_next_block
from engine_proc.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # free blocks (ref 0), least recently freed first; an OrderedDict so that a cached
        # block a new sequence hits leaves from the middle in O(1)
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_block_ids: dict[bytes, int] = {}  # content hash -> block
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # block -> its hash

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can use: unused, cached ones included (evicted on use)."""
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """The longest cached run of `seq`'s leading full blocks, leaving at least one
        token to compute (its logits are needed); [] without prefix caching. Hashes the
        blocks it looks at for the first time, stopping after the first miss."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = seq.block_hashes
        found = []
        for i in range(max_blocks):
            digest = hashes[i] if i < len(hashes) else hash_next_block(seq, self.block_size)
            block = self.cached_block_ids.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, num_tokens: int, cached: Collection[int] = ()) -> bool:
        """Whether `allocate(seq, num_tokens, cached)` would succeed: cached blocks in use
        by other sequences cost nothing, cached blocks on the free list do."""
        num_shared = sum(1 for b in cached if self.ref_counts[b])
        return self.num_blocks_for(num_tokens) - num_shared <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int, cached: Collection[int] = ()) -> None:
        """Give a sequence that holds no blocks enough for its first `num_tokens` tokens:
        the `cached` blocks (from `find_cached_blocks`) first, then fresh ones."""
        assert not seq.block_table, f"sequence {seq.request_id} already holds blocks"
        if not self.can_allocate(num_tokens, cached):
            raise RuntimeError(
                f"allocate {self.num_blocks_for(num_tokens)} blocks ({len(cached)} cached) "
                f"with {len(self.free_block_ids)} free"
            )
        for block in cached:
            if self.ref_counts[block] == 0:
                del self.free_block_ids[block]
            self.ref_counts[block] += 1
        fresh = self._take_fresh
        seq.block_table = list(cached)
        seq.block_table += [fresh() for _ in range(self.num_blocks_for(num_tokens) - len(cached))]
        seq.num_cached_blocks = len(cached)

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
            seq.block_table.append(self._take_fresh())

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register `seq`'s blocks that became full and computed since the last call, so
        later sequences can hit them. Cheap when none did: one comparison per step."""
        num_full = seq.num_computed_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_cached_blocks:
            return
        hashes = seq.block_hashes
        for i in range(seq.num_cached_blocks, num_full):
            digest = hashes[i] if i < len(hashes) else hash_next_block(seq, self.block_size)
            block = seq.block_table[i]
            # a block with this content may be cached already (the same prompt computed
            # twice at once): keep that one, this block stays private
            if digest not in self.cached_block_ids:
                self.cached_block_ids[digest] = block
                self.block_hashes[block] = digest
        seq.num_cached_blocks = num_full

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references, tail first: its last blocks are evicted before its
        first ones, which other sequences are likelier to share."""
        ref_counts = self.ref_counts
        for block in reversed(seq.block_table):
            ref_counts[block] -= 1
            if ref_counts[block] == 0:
                self.free_block_ids[block] = None
        seq.block_table = []
        seq.num_cached_blocks = 0

    def _take_fresh(self) -> int:
        """The least recently freed block, its cached content forgotten."""
        block, _ = self.free_block_ids.popitem(last=False)
        digest = self.block_hashes[block]
        if digest is not None:
            self.block_hashes[block] = None
            del self.cached_block_ids[digest]
        self.ref_counts[block] = 1
        return block
