"""Vision embeddings of recently seen images, keyed by image content key, LRU, bounded in
bytes: an image whose key is here skips the vision tower (and its pixels are dropped at
once).

Lifetimes (R3, R4). A span that takes an entry holds its own reference to the tensor until
the prefill chunk that consumes it has run, then releases it like any other embeddings;
the cache is then the only holder, and it never holds more than `max_bytes`. Entries are
not pinned: eviction only drops the cache's reference, so it cannot hurt a span that took
the tensor (the tensor lives on until that span releases it, and nothing writes into
embeddings in place). What such a span keeps after eviction is counted where every span's
embeddings are, in EngineStats.mm_bytes_held (see `LLMEngine.stats`, which leaves out the
tensors the cache holds, so no tensor is counted twice). Pinning would add an unpin on every
exit path (finish, abort, failure, a failed step) and let the cache grow past its budget;
not pinning costs only a re-encode when an evicted image comes back while a span still holds
its old tensor.

The API processes keep a mirror of which keys are here, to skip sending pixels for them;
`take_key_changes` reports the keys added and removed since the last call (the engine
server passes them on to every API process). The mirror is only a hint: a request that names
a key no longer here is refused (ErrorCode.IMAGE_MISSING) and sent again with its pixels.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine_proc.sequence import ImageSpan

MAX_UNREPORTED_REMOVALS = 65536  # evicted keys kept for take_key_changes (1 MiB of keys)


@dataclass
class _Entry:
    embeds: torch.Tensor  # [tokens, hidden * (1 + DeepStack taps)], on the device
    grid_thw: tuple[int, int, int]
    nbytes: int


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class EncoderCache:
    """LRU map from image key to embeddings; `max_bytes` 0 turns it off."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"encoder cache budget must not be negative, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.num_queries = 0  # images looked up when their request was added
        self.num_hits = 0  # images that took their embeddings from here
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._added: dict[bytes, None] = {}  # since the last take_key_changes, in order
        self._removed: set[bytes] = set()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
        """(embeddings, grid) of `key`, now the most recently used; None when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.embeds, entry.grid_thw

    def query(self, image: ImageSpan) -> bool:
        """`fill`, counted as one lookup: once per image, when its request is added (not
        counted when the cache is off)."""
        if not self.enabled:
            return False
        self.num_queries += 1
        return self.fill(image)

    def fill(self, image: ImageSpan) -> bool:
        """If the cache holds `image`'s key with the same grid, the span takes its
        embeddings and drops its pixels at once (R3: the embeddings carry everything)."""
        entry = self._entries.get(image.key) if self._entries else None
        if entry is None or entry.grid_thw != tuple(image.grid_thw):
            return False
        self._entries.move_to_end(image.key)
        image.embeds = entry.embeds
        image.pixels = None
        image.hidden = None
        self.num_hits += 1
        return True

    def holds(self, key: bytes, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is this cache's entry for `key` (then the cache counts it)."""
        entry = self._entries.get(key)
        return entry is not None and entry.embeds is tensor

    def put(self, key: bytes, embeds: torch.Tensor, grid_thw: tuple[int, int, int]) -> None:
        """Insert (or refresh) `key`, evicting the least recently used entries until it
        fits; an entry larger than the whole budget is not cached."""
        nbytes = tensor_bytes(embeds)
        if not key or nbytes > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.nbytes
        while self.num_bytes + nbytes > self.max_bytes:
            self._evict_oldest()
        self._entries[key] = _Entry(embeds, tuple(grid_thw), nbytes)
        self.num_bytes += nbytes
        self._removed.discard(key)
        self._added[key] = None

    def _evict_oldest(self) -> None:
        key, entry = self._entries.popitem(last=False)
        self.num_bytes -= entry.nbytes
        self._added.pop(key, None)
        if len(self._removed) >= MAX_UNREPORTED_REMOVALS:
            # only an engine whose changes nobody takes (offline use) gets here; the API's
            # mirror is a hint (IMAGE_MISSING covers a stale one), so forgetting is safe
            self._removed.clear()
        self._removed.add(key)

    def take_key_changes(self) -> tuple[list[bytes], list[bytes]]:
        """(keys added, keys removed) since the last call. Apply the removals first: a key
        removed and added again since is in `added` only."""
        added, removed = list(self._added), list(self._removed)
        self._added, self._removed = {}, set()
        return added, removed

    def keys(self) -> list[bytes]:
        return list(self._entries)
