"""Prefix caching for hybrid models: snapshots of the recurrent state at KV block boundaries.

A cached KV prefix is not enough to resume a hybrid model: its linear layers need their
state after exactly that prefix. So the scheduler keeps copies of sequences' states at
block boundaries, in extra slots of the state tensors (engine_proc/state_cache.py), each
registered under the content hash of the KV block that ends at its boundary (the hash
chains every token and image before it, engine_proc/block_hash.py). Two boundaries are kept
per sequence: the last one inside its prompt (its prefill chunk is cut there, so the state
exists: a later request with the same prompt and more resumes there), and the latest one
its decoding reached (a conversation that re-sends its history resumes after the reply).

A new sequence takes the longest run of its leading KV blocks that is cached, cut back to
the last block with a snapshot, and starts from a copy of that snapshot in its own slot.
Snapshots are least-recently-used within a fixed number (a byte budget the engine counts
with the caches); the copies run inside the step on every rank (StepInputs'
`state_restores` before the forward, `state_saves` after it).
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, first_slot: int, num_snapshots: int) -> None:
        self.num_snapshots = num_snapshots
        self.free_slots = list(range(first_slot + num_snapshots - 1, first_slot - 1, -1))
        self.by_hash: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self.hash_of: dict[int, bytes] = {}

    @property
    def num_registered(self) -> int:
        return len(self.by_hash)

    def lookup(self, digest: bytes) -> int | None:
        """The snapshot after the block of hash `digest`, marked as just used; None if
        there is none."""
        slot = self.by_hash.get(digest)
        if slot is not None:
            self.by_hash.move_to_end(digest)
        return slot

    def take(self) -> int | None:
        """A slot to save a snapshot into: a free one, else the least recently used
        snapshot's (forgotten); None when there are no snapshots at all."""
        if self.free_slots:
            return self.free_slots.pop()
        if not self.by_hash:
            return None
        digest, slot = self.by_hash.popitem(last=False)
        del self.hash_of[slot]
        return slot

    def register(self, slot: int, digest: bytes) -> bool:
        """`slot` now holds the state after the block of hash `digest`. If another
        snapshot holds that state already (the same prefix computed twice at once), it
        stays and `slot` is freed (False)."""
        if digest in self.by_hash:
            self.free_slots.append(slot)
            return False
        self.by_hash[digest] = slot
        self.hash_of[slot] = digest
        return True

    def release(self, slot: int) -> None:
        """Forget what `slot` holds and free it."""
        digest = self.hash_of.pop(slot, None)
        if digest is not None:
            del self.by_hash[digest]
        self.free_slots.append(slot)

    def release_if_holds(self, slot: int, digest: bytes) -> None:
        """Release `slot` if it still holds the state after block `digest` (it may have
        been evicted and reused since)."""
        if self.hash_of.get(slot) == digest:
            self.release(slot)
