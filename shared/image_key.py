"""Content keys of images: what the prefix cache and the encoder cache key on.

A key is a 16-byte blake2b digest, prefixed by what was hashed, so keys of different
origins never collide: an image's encoded bytes with the resize settings that turn them
into pixels (the API process, before decoding), or the resized pixels themselves with
their grid (the engine, for an image sent without a key).
"""

from __future__ import annotations

import hashlib

import numpy as np

DIGEST_SIZE = 16


def pixels_key(pixels: np.ndarray, grid_thw: tuple[int, int, int]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"flatserve-pix")
    h.update(np.asarray(grid_thw, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).data)
    return b"p" + h.digest()
