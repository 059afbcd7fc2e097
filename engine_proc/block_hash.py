"""Content hashes of full KV blocks: what the prefix cache finds a block by.

A block's K/V depends on every token before it and on the images whose embeddings fill
its placeholder rows (and, through the mRoPE positions, on the images before it). So a
block's hash chains its parent's hash with its own token ids and, for each image whose
placeholder tokens overlap it, the image's content key and the index inside the image of
the block's first placeholder row of it: two different images of the same size never
share a block, the same image at the same place does. Images wholly before the block
reach it through the parent hash.
"""

from __future__ import annotations

import hashlib

import numpy as np

from engine_proc.sequence import Sequence

DIGEST_SIZE = 16


def hash_next_block(seq: Sequence, block_size: int) -> bytes:
    """Hash `seq`'s first full block not hashed yet, append it to `seq.block_hashes` and
    return it. Each block is hashed once in a sequence's life (preemption keeps them)."""
    index = len(seq.block_hashes)
    start, end = index * block_size, (index + 1) * block_size
    assert end <= seq.num_tokens, f"block {index} of {seq.request_id} is not full"
    h = hashlib.blake2b(seq.block_hashes[-1] if index else b"", digest_size=DIGEST_SIZE)
    h.update(np.asarray(seq.token_ids[start:end], dtype=np.int64).tobytes())
    for image in seq.images:
        if image.offset >= end:
            break
        if image.end > start:
            h.update(image.key)
            h.update((max(start, image.offset) - image.offset).to_bytes(8, "little"))
    digest = h.digest()
    seq.block_hashes.append(digest)
    return digest
